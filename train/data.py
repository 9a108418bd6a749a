"""prepare: conversations -> chat-templated token ids + loss masks on assistant turns, split into training and
validation rows.

Stored as safetensors (no pickle): flat `input_ids`/`loss_mask` plus `offsets`, one row per conversation.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm


@dataclass
class TokenizedSet:
    input_ids: torch.Tensor  # [total] int32
    loss_mask: torch.Tensor  # [total] uint8: 1 where the token belongs to an assistant turn
    offsets: torch.Tensor  # [n+1] int64

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    def row(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.offsets[i].item(), self.offsets[i + 1].item()
        return self.input_ids[a:b].long(), self.loss_mask[a:b].bool()

    @staticmethod
    def from_rows(rows: list[tuple[list[int], list[int]]]) -> "TokenizedSet":
        if not rows:
            return TokenizedSet(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.uint8),
                                torch.zeros(1, dtype=torch.int64))
        lengths = torch.tensor([0] + [len(ids) for ids, _ in rows], dtype=torch.int64)
        flat_ids = [t for ids, _ in rows for t in ids]
        flat_mask = [m for _, mask in rows for m in mask]
        return TokenizedSet(torch.tensor(flat_ids, dtype=torch.int32), torch.tensor(flat_mask, dtype=torch.uint8),
                            lengths.cumsum(0))

    def save(self, path: Path) -> None:
        save_file({"input_ids": self.input_ids, "loss_mask": self.loss_mask, "offsets": self.offsets}, str(path))

    @staticmethod
    def load(path: Path) -> "TokenizedSet":
        t = load_file(str(path))
        return TokenizedSet(t["input_ids"], t["loss_mask"], t["offsets"])


def assistant_spans(tokenizer, turns: list[dict], max_chars: int) -> tuple[str, list[tuple[int, int]]] | None:
    """Render `turns` with the chat template; return the text and the char spans of assistant replies.

    A reply's span is what the template adds between `turns[:k]` + generation prompt and `turns[:k+1]`, so
    this works for any template that renders prefixes as prefixes. None if the template is not prefix-stable.
    """
    spans = []
    text = ""
    for k, turn in enumerate(turns):
        full = tokenizer.apply_chat_template(turns[: k + 1], tokenize=False)
        if turn["role"] == "assistant":
            head = tokenizer.apply_chat_template(turns[:k], tokenize=False, add_generation_prompt=True) if k else ""
            if not full.startswith(head):
                return None
            spans.append((len(head), len(full)))
        if not full.startswith(text):
            return None
        text = full
        if len(text) > max_chars:  # already longer than any kept row can be
            break
    return text, spans


def _encode(tokenizer, text: str, spans: list[tuple[int, int]], max_length: int) -> tuple[list[int], list[int]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, truncation=True,
                    max_length=max_length)
    mask = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def tokenize_conversation(tokenizer, turns: list[dict], max_length: int) -> tuple[list[int], list[int]] | None:
    rendered = assistant_spans(tokenizer, turns, max_chars=max_length * 16)
    if rendered is None:
        return None
    return _encode(tokenizer, *rendered, max_length)


def tokenize_prompt(tokenizer, history: list[dict], max_length: int) -> tuple[list[int], list[int]] | None:
    """The generation prompt after `history` (ids, mask of the assistant turns in it); None when the template is
    not prefix-stable or the prompt has max_length tokens or more (no room left to answer)."""
    rendered = assistant_spans(tokenizer, history, max_chars=max_length * 16)
    if rendered is None:
        return None
    text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    if not text.startswith(rendered[0]):
        return None
    ids, mask = _encode(tokenizer, text, rendered[1], max_length + 1)
    return (ids, mask) if len(ids) < max_length else None


def is_validation(turns: list[dict], fraction: float) -> bool:
    """Deterministic split by content hash: the same conversation lands on the same side in every run."""
    h = hashlib.sha256("\x1e".join(t["content"] for t in turns).encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < fraction


def split_conversations(conversations: list[list[dict]], val_fraction: float) -> dict[str, list[list[dict]]]:
    splits: dict[str, list[list[dict]]] = {"train": [], "val": []}
    for turns in conversations:
        splits["val" if is_validation(turns, val_fraction) else "train"].append(turns)
    return splits


def tokenize_rows(tokenizer, conversations: list[list[dict]], max_length: int, min_assistant_tokens: int,
                  dropped: dict[str, int], desc: str) -> list[tuple[list[int], list[int]]]:
    """Templated, truncated rows; conversations that give none are counted in `dropped` by reason."""
    rows = []
    for turns in tqdm(conversations, desc=desc, unit="conv", mininterval=1.0):
        row = tokenize_conversation(tokenizer, turns, max_length)
        if row is None:
            dropped["template"] = dropped.get("template", 0) + 1
        elif sum(row[1]) < min_assistant_tokens:
            dropped["too_few_assistant_tokens"] = dropped.get("too_few_assistant_tokens", 0) + 1
        else:
            rows.append(row)
    return rows


def save_split(name: str, ts: TokenizedSet, out_dir: Path, dropped: dict[str, int]) -> dict:
    if not len(ts):
        raise ValueError(f"prepare: the {name} split is empty (dropped {dropped}); use more data or change "
                         "data.val_fraction")
    ts.save(out_dir / f"{name}.safetensors")
    return {"rows": len(ts), "tokens": int(ts.input_ids.numel()), "loss_tokens": int(ts.loss_mask.sum())}


def prompts_from(ts: TokenizedSet, n: int) -> list[list[int]]:
    """Up to n held-out prompts: each row's tokens before its first assistant token (the generation prompt)."""
    out = []
    for i in range(len(ts)):
        ids, mask = ts.row(i)
        first = int(mask.nonzero()[0]) if mask.any() else 0
        if first > 0:
            out.append(ids[:first].tolist())
        if len(out) == n:
            break
    return out
