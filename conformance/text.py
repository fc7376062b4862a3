"""Text in and out for a client: a model's tokenizer and chat template, without torch.

The node speaks tokens only; a person speaks text. `load_text_codec` finds the tokenizer of a
model alias, a Hugging Face directory (`tokenizer.json`, the chat template from
`tokenizer_config.json` or `chat_template.jinja`) or a GGUF file (its own vocabulary, merges and
template, rebuilt as a `tokenizers` byte-level BPE the way llama.cpp splits text), and renders
chat messages with the template as `transformers` does (a sandboxed Jinja environment).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from proto.models import AliasUnavailable, is_gguf, resolve

if TYPE_CHECKING:  # both are imported only when a codec is built, so the kit loads without them
    from jinja2 import Template
    from tokenizers import Tokenizer

#: llama.cpp's token types: normal, unknown, control, user-defined, unused, byte.
CONTROL, USER_DEFINED = 3, 4
#: How llama.cpp splits text before BPE, by the GGUF's `tokenizer.ggml.pre`.
GPT2_PRES = ("default", "gpt2", "olmo", "jais", "poro-chat", "viking")
DIGIT_PRES = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b")
LLAMA3_PRES = ("llama-bpe", "llama3", "dbrx", "smaug-bpe", "falcon3")
QWEN2_PRES = ("qwen2", "deepseek-r1-qwen")
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


class TextCodecError(ValueError):
    """No usable tokenizer or chat template for the model; the message says what is missing."""


@dataclass
class TextCodec:
    """A model's tokenizer (a `tokenizers.Tokenizer`) and its chat template."""

    tokenizer: Tokenizer
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    _template: Template | None = field(default=None, repr=False)

    def encode(self, text: str) -> list[int]:
        """Plain text, with the model's BOS in front when the model asks for one."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token is not None:
            bos = self.tokenizer.token_to_id(self.bos_token)
            if bos is None:
                raise TextCodecError(f"the BOS token {self.bos_token!r} is not in the vocabulary")
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, special tokens (end of turn, ...) left out."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat template applied to `messages` ({"role", "content"} dicts)."""
        if self.chat_template is None:
            raise TextCodecError("the model has no chat template; send --text instead")
        if self._template is None:
            self._template = _jinja().from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered conversation; the template writes any BOS itself."""
        return self.tokenizer.encode(self.render(messages, add_generation_prompt), add_special_tokens=False).ids


class StreamDecoder:
    """Text as tokens arrive: each call returns only the new characters, holding back a
    character whose UTF-8 bytes are still split across tokens."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.shown = 0

    def feed(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        new, self.shown = text[self.shown :], len(text)
        return new


def load_text_codec(model: str) -> TextCodec:
    """The codec of an alias, a Hugging Face directory or a GGUF file; TextCodecError if none."""
    try:
        path, _ = resolve(model)
    except AliasUnavailable as e:
        raise TextCodecError(str(e)) from None
    if is_gguf(path):
        return gguf_codec(Path(path))
    if (Path(path) / "tokenizer.json").is_file():
        return directory_codec(Path(path))
    raise TextCodecError(
        f"{model}: no tokenizer found (expected a model alias, a .gguf file or a directory with "
        f"tokenizer.json)"
    )


def directory_codec(directory: Path) -> TextCodec:
    """`tokenizer.json`, and the template and special tokens of `tokenizer_config.json`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    config = _json(directory / "tokenizer_config.json")
    template = config.get("chat_template")
    jinja_file = directory / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return TextCodec(
        tokenizer,
        template,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        add_bos=bool(config.get("add_bos_token", False)),
    )


def gguf_codec(path: Path) -> TextCodec:
    """The GGUF's own byte-level BPE vocabulary and merges, its chat template and BOS/EOS."""
    from gguf import GGUFReader

    try:
        fields = GGUFReader(path).fields
    except (ValueError, OSError) as e:  # not a GGUF file, or a truncated one
        raise TextCodecError(f"{path} is not a readable GGUF file: {e}") from None

    def get(key: str, default=None):
        field = fields.get(key)
        return default if field is None else field.contents()

    kind = get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TextCodecError(
            f"{path}: tokenizer model {kind!r} is not supported (byte-level BPE, 'gpt2', only); "
            f"use a checkpoint directory with tokenizer.json"
        )
    tokens, types = get("tokenizer.ggml.tokens"), get("tokenizer.ggml.token_type", [])
    tokenizer = bpe_tokenizer(tokens, get("tokenizer.ggml.merges", []), types, get("tokenizer.ggml.pre", "default"))
    bos, eos = get("tokenizer.ggml.bos_token_id"), get("tokenizer.ggml.eos_token_id")
    return TextCodec(
        tokenizer,
        get("tokenizer.chat_template"),
        bos_token=None if bos is None else tokens[bos],
        eos_token=None if eos is None else tokens[eos],
        add_bos=bool(get("tokenizer.ggml.add_bos_token", False)),
    )


def bpe_tokenizer(tokens: list[str], merges: list[str], types: list[int], pre: str):
    """A `tokenizers` byte-level BPE equal to llama.cpp's for the pre-tokenizer `pre`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    pairs = [_pair(m) for m in merges]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre in LLAMA3_PRES))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in GPT2_PRES:
        tokenizer.pre_tokenizer = byte_level
    elif pre in DIGIT_PRES:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in LLAMA3_PRES or pre in QWEN2_PRES:
        split = LLAMA3_SPLIT if pre in LLAMA3_PRES else QWEN2_SPLIT
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        raise TextCodecError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported")
    tokenizer.decoder = decoders.ByteLevel()
    kinds = list(zip(tokens, types, strict=True))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in kinds if k == CONTROL])
    tokenizer.add_tokens([AddedToken(t, normalized=False) for t, k in kinds if k == USER_DEFINED])
    return tokenizer


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _jinja():
    """Jinja as `transformers` sets it up for chat templates: sandboxed, blocks trimmed."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TextCodecError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    return env


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value
