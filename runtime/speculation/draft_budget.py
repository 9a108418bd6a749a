"""Draft budgets: the tree a drafter may grow (DraftBudget), and everything a bundle serves with around it
(ServedBudget: whether the engine adapts the tree, the n-gram lookup branch, the verify cap). A ServedBudget is the
one shape of a served budget: parsed from `pipeline bench --budget`, written to draft_budget.json, recorded by
register, and turned into EngineConfig fields."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

SPEC = "DEPTHxWIDTH[/NODES][+LOOKUP][@MAX_TREE]"
_SPEC_RE = re.compile(r"(\d+)x(\d+)(?:/(\d+))?(?:\+(\d+))?(?:@(\d+))?")


def _count(owner: str, name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{owner}: {name}={value!r}, expected an int >= {least}")


@dataclass(frozen=True)
class DraftBudget:
    depth: int  # longest root-to-leaf path
    width: int = 1  # most children per node
    nodes: int = 0  # most nodes in the tree; 0 -> depth * width

    def __post_init__(self):
        _count("DraftBudget", "depth", self.depth, 1)
        _count("DraftBudget", "width", self.width, 1)
        _count("DraftBudget", "nodes", self.nodes, 0)

    @property
    def max_nodes(self) -> int:
        return self.nodes or self.depth * self.width

    def fits(self, limit: "DraftBudget") -> bool:
        """Whether this tree stays within `limit` in depth, width and nodes."""
        return self.depth <= limit.depth and self.width <= limit.width and self.max_nodes <= limit.max_nodes


@dataclass(frozen=True)
class ServedBudget:
    tree: DraftBudget = field(default_factory=lambda: DraftBudget(depth=5))
    adaptive: bool = False  # the engine shrinks the depth to recent acceptance and may stop drafting
    lookup: int = 0  # nodes of the n-gram lookup branch joined to each greedy tree; 0: none
    max_tree: int = 0  # most nodes a greedy verify holds, the drafter's and the lookup's together; 0: no limit

    def __post_init__(self):
        if not isinstance(self.tree, DraftBudget):
            raise ValueError(f"ServedBudget: tree={self.tree!r}, expected a DraftBudget")
        _count("ServedBudget", "lookup", self.lookup, 0)
        _count("ServedBudget", "max_tree", self.max_tree, 0)

    @staticmethod
    def parse(text: str) -> "ServedBudget":
        """A fixed budget from its spec, e.g. 2x3/6+8@5; ValueError naming the spec on a malformed one."""
        m = _SPEC_RE.fullmatch(text.strip())
        expected = f"{text!r}: expected {SPEC} with depth, width >= 1, e.g. 2x3/6+8@5"
        if m is None:
            raise ValueError(expected)
        depth, width, nodes, lookup, max_tree = (int(g or 0) for g in m.groups())
        try:
            return ServedBudget(DraftBudget(depth, width, nodes), lookup=lookup, max_tree=max_tree)
        except ValueError as e:
            raise ValueError(f"{expected} ({e})") from None

    @property
    def spec(self) -> str:
        """What parse reads: 2x3/6+8@5 (adaptive is not part of it)."""
        t = self.tree
        return f"{t.depth}x{t.width}/{t.max_nodes}" + f"+{self.lookup}" * bool(self.lookup) \
            + f"@{self.max_tree}" * bool(self.max_tree)

    def label(self, corpus: bool = False) -> str:
        """'2x2/4 adaptive + lookup 8 (corpus), cut to 5': for reports."""
        t = self.tree
        return f"{t.depth}x{t.width}/{t.max_nodes}" + " adaptive" * self.adaptive \
            + f" + lookup {self.lookup}" * bool(self.lookup) + " (corpus)" * bool(self.lookup and corpus) \
            + f", cut to {self.max_tree}" * bool(self.max_tree)

    def to_dict(self) -> dict:
        """The keys draft_budget.json and register's tags hold."""
        t = self.tree
        return {"depth": t.depth, "width": t.width, "nodes": t.max_nodes, "adaptive": self.adaptive,
                "lookup": self.lookup, "max_tree": self.max_tree}

    @staticmethod
    def from_dict(row: dict) -> "ServedBudget":
        """A draft_budget.json entry (chosen, a sweep row or a device candidate); older bundles have no lookup or
        max_tree."""
        return ServedBudget(DraftBudget(row["depth"], row["width"], row["nodes"]), bool(row.get("adaptive", False)),
                            row.get("lookup", 0), row.get("max_tree", 0))

    def engine_fields(self) -> dict:
        """The EngineConfig fields this budget sets."""
        return {"budget": self.tree, "adaptive": self.adaptive, "lookup": self.lookup, "max_tree": self.max_tree}

    @staticmethod
    def of(engine_config) -> "ServedBudget":
        """The budget an EngineConfig runs."""
        c = engine_config
        return ServedBudget(c.budget, c.adaptive, c.lookup, c.max_tree)


@dataclass(frozen=True)
class BatchPolicy:
    """From each batch size on, the budget every speculating row drafts within (None: plain batched decoding)."""
    steps: tuple[tuple[int, ServedBudget | None], ...]  # (from this many rows, budget), the first from 1 row
    report: dict | None = field(default=None, compare=False)  # measure_policy's measurements

    def __post_init__(self):
        sizes = [n for n, _ in self.steps]
        if not sizes or sizes[0] != 1 or sizes != sorted(set(sizes)):
            raise ValueError(f"BatchPolicy: steps from {sizes}, expected ascending batch sizes starting at 1")

    @staticmethod
    def fixed(budget: ServedBudget | None) -> "BatchPolicy":
        """The same budget at every batch size."""
        return BatchPolicy(((1, budget),))

    def at(self, rows: int) -> ServedBudget | None:
        return next(b for n, b in reversed(self.steps) if n <= rows)

    def budgets(self) -> list[ServedBudget | None]:
        return [b for _, b in self.steps]

    def to_dict(self) -> dict:
        """JSON: each step's first batch size and budget (ServedBudget.to_dict, None: plain), and the report."""
        return {"steps": [[n, None if b is None else b.to_dict()] for n, b in self.steps], "report": self.report}

    @staticmethod
    def from_dict(d: dict) -> "BatchPolicy":
        """What to_dict wrote; KeyError, TypeError or ValueError for anything else."""
        steps = tuple((int(n), None if b is None else ServedBudget.from_dict(b)) for n, b in d["steps"])
        return BatchPolicy(steps, d.get("report"))

    def describe(self) -> str:
        """'1: 2x2/4+8; 4+: plain decoding'"""
        parts = []
        for i, (n, b) in enumerate(self.steps):
            upto = self.steps[i + 1][0] - 1 if i + 1 < len(self.steps) else None
            rows = f"{n}+" if upto is None else str(n) if upto == n else f"{n}-{upto}"
            parts.append(f"{rows}: {'plain decoding' if b is None else b.label()}")
        return "; ".join(parts)
