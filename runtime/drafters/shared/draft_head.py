"""The projection from draft features to token logits over a draft vocabulary: the target's own lm_head (frozen),
or a trained copy of it with its final norm (EAGLE-3), optionally restricted to a reduced draft vocabulary
(EAGLE-3's d2t/t2d). The full lm_head costs a drafter that calls it every draft step dearly; a few thousand
frequent tokens cover most text.
"""
from __future__ import annotations

import torch
from torch import nn

from runtime.target.cpu_packing import Packable


class DraftHead(nn.Module, Packable):
    def __init__(self, lm_head: torch.Tensor | Packable, keep_ids: torch.Tensor | None = None,
                 norm: nn.Module | None = None):
        """`lm_head`: the target's head layer (a lean one keeps only packed rows) or its weight. `norm`: a trained
        head, whose weight (a copy of the rows kept) and final norm are parameters saved with the drafter; None: the
        target's lm_head as it is, frozen and never saved."""
        super().__init__()
        layer = isinstance(lm_head, Packable)
        self.vocab_size = (lm_head.weight if layer else lm_head).shape[0]
        if keep_ids is not None:
            keep_ids = torch.unique(keep_ids.long())
            if keep_ids.numel() == 0 or int(keep_ids.max()) >= self.vocab_size or int(keep_ids.min()) < 0:
                raise ValueError(f"draft vocabulary ids must lie in [0, {self.vocab_size}) and be non-empty")
        weight = lm_head.weight_rows(keep_ids) if layer else lm_head if keep_ids is None else lm_head[keep_ids]
        if norm is None:  # the target's lm_head: frozen, never saved with a drafter
            self.register_buffer("weight", weight.detach(), persistent=False)
        else:
            self.weight = nn.Parameter(weight.detach().clone())
        self.norm = norm
        self.register_buffer("keep_ids", keep_ids, persistent=False)

    @classmethod
    def whole(cls, lm_head: Packable) -> "DraftHead":
        """The layer's whole head, its weight and packed copies shared rather than read back and packed again (a
        sibling's 151,936 rows are 0.5 GB a copy): for inference, as packed copies are."""
        head = cls(torch.empty(lm_head.weight.shape, dtype=lm_head.weight.dtype, device="meta"))
        head.weight, head.panels, head.packed = lm_head.weight.detach(), lm_head.panels, lm_head.packed
        return head

    @property
    def reduced(self) -> bool:
        return self.keep_ids is not None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary [..., Vd]."""
        return self.linear(h if self.norm is None else self.norm(h), None)

    def to_target(self, draft: torch.Tensor) -> torch.Tensor:
        """Scatter per-draft-token values (probabilities) into the full target vocabulary, zeros elsewhere."""
        if self.keep_ids is None:
            return draft
        out = draft.new_zeros(*draft.shape[:-1], self.vocab_size)
        out[..., self.keep_ids] = draft
        return out

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Map target token ids to draft vocabulary indices (-1 where the token is outside it)."""
        if self.keep_ids is None:
            return target_ids
        lut = torch.full((self.vocab_size,), -1, dtype=torch.long, device=target_ids.device)
        lut[self.keep_ids] = torch.arange(self.keep_ids.numel(), device=target_ids.device)
        return lut[target_ids]


def frequent_token_ids(token_ids: torch.Tensor, size: int, always: torch.Tensor | None = None,
                       fill: torch.Tensor | None = None) -> torch.Tensor:
    """The `size` most frequent ids in a token stream (plus `always`, e.g. special tokens): a draft vocabulary.
    Slots the stream leaves (it holds fewer distinct ids) go to `fill`'s ids, lowest first: BPE gives its earliest,
    commonest merges the lowest ids."""
    counts = torch.bincount(token_ids.long().flatten())
    top = torch.argsort(counts, descending=True, stable=True)[:size]
    top = top[counts[top] > 0]
    if fill is not None and top.numel() < size:
        fill = torch.unique(fill.long())
        top = torch.cat([top, fill[~torch.isin(fill, top)][:size - top.numel()]])
    return torch.unique(top if always is None else torch.cat([top, always.long()]))
