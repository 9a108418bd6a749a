"""The interface between the engine and every drafter (n-gram, LM, Medusa, EAGLE)."""
from __future__ import annotations

import abc
import re
from dataclasses import dataclass

import torch

from runtime.sampling import SamplingParams
from runtime.tree import DraftTree


@dataclass(frozen=True)
class DraftBudget:
    depth: int  # longest root-to-leaf path
    width: int = 1  # most children per node
    nodes: int = 0  # most nodes in the tree; 0 -> depth * width

    def __post_init__(self):
        for name in ("depth", "width"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DraftBudget: {name}={v!r}, expected an int >= 1")
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 0:
            raise ValueError(f"DraftBudget: nodes={self.nodes!r}, expected an int >= 0 (0 = depth * width)")

    @property
    def max_nodes(self) -> int:
        return self.nodes or self.depth * self.width


BUDGET_SPEC = "DEPTHxWIDTH[/NODES][+LOOKUP][@MAX_TREE]"


def budget_fields(text: str) -> dict:
    """A budget spec, e.g. 2x3/6+8@5 -> EngineConfig fields: a fixed budget (not adapted while decoding), LOOKUP
    n-gram lookup nodes, MAX_TREE the most nodes a verify holds (drafter's and lookup's together; 0: no limit).
    ValueError on a malformed spec."""
    m = re.fullmatch(r"(\d+)x(\d+)(?:/(\d+))?(?:\+(\d+))?(?:@(\d+))?", text.strip())
    expected = f"{text!r}: expected {BUDGET_SPEC} with depth, width >= 1, e.g. 2x3/6+8@5"
    if m is None:
        raise ValueError(expected)
    depth, width, nodes, lookup, max_tree = (int(g or 0) for g in m.groups())
    try:
        budget = DraftBudget(depth, width, nodes)
    except ValueError as e:
        raise ValueError(f"{expected} ({e})") from None
    return {"budget": budget, "adaptive": False, "lookup": lookup, "max_tree": max_tree}


def budget_spec(row: dict) -> str:
    """The spec budget_fields reads, of a draft budget entry (depth, width, nodes, lookup, max_tree): 2x3/6+8@5."""
    return f"{row['depth']}x{row['width']}/{row['nodes']}" + f"+{row['lookup']}" * bool(row.get("lookup")) \
        + f"@{row['max_tree']}" * bool(row.get("max_tree"))


class Drafter(abc.ABC):
    """Proposes draft trees below the root, the last committed token (not yet in the target KV cache).

    Sequence bookkeeping: after reset(x_0..x_n, f_0..f_{n-1}) the root is x_n; commit(tokens, features) appends
    the accepted path plus the target's next token, and the features of the rows that produced them (old root
    and accepted nodes), so len(features) == len(tokens) - 1 holds over the whole sequence.
    """

    vocab_size: int
    needs_features: bool = False  # True: the engine passes target last hidden states (after the final norm)
    # True: propose() also gathers draft_attention(); only SpecAttn verification reads it (the engine sets it)
    track_attention: bool = False

    @abc.abstractmethod
    def reset(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """Start a new sequence: tokens [n+1] long, features [n, H] or None."""

    @abc.abstractmethod
    def propose(self, budget: DraftBudget, params: SamplingParams,
                generator: torch.Generator | None = None) -> DraftTree:
        """A tree within the budget. Siblings must be listed in the order they were drawn (draw_children)."""

    @abc.abstractmethod
    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        """Append newly committed tokens [m] and their features [m, H] (or None)."""

    def use_static(self, use_graph: bool, compile: bool = False) -> None:
        """EngineConfig.static_verify: draft at static shapes too, as CUDA graphs where `use_graph` (each step fused
        by torch.compile first where `compile`), where this drafter can (EAGLE's greedy trees); the default keeps
        drafting as it is."""

    def draft_attention(self) -> torch.Tensor | None:
        """SpecAttn: how the last propose()'s root and tree queries attended to the committed prefix, as
        non-negative weights over the target's key positions 0..prefix-1, [draft layers, heads, prefix]; None
        after a commit or while track_attention is off. Drafters without attention return None (the default), and verification stays dense."""
        return None
