"""Text <-> token ids as serving, validate and the benchmark all do it, and where a generation stops."""
from __future__ import annotations

import json
from pathlib import Path


def encode(tokenizer, prompt: str, chat_template: bool = True) -> list[int]:
    """A user turn in the tokenizer's chat template with the assistant's turn opened (or the plain text)."""
    if chat_template and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False).input_ids
    return tokenizer(prompt).input_ids


def stop_ids(tokenizer) -> tuple[int, ...]:
    """Where generation ends: the tokenizer's end-of-sequence token (the chat template's end of turn)."""
    return (tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ()


def generation_stop_ids(model_dir: str | Path) -> tuple[int, ...]:
    """Where HF `generate` stops for the model in `model_dir`: generation_config.json's eos ids, else config.json's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:  # no generation_config.json: HF derives one from the model config
        eos = json.loads((Path(model_dir) / "config.json").read_text()).get("eos_token_id")
    return tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
