"""Running totals of a batched engine's speculation, kept as plain ints so that a step pays a few additions; a
metrics endpoint reads them whenever it is scraped (pipeline.serving.metrics)."""
from __future__ import annotations

from collections import deque

ROLLING_WINDOW = 512  # drafted verifies the rolling acceptance covers, unless told otherwise


class SpecCounters:
    """Counts per row-verify since the engine was built; `recent_*` cover the last `window` drafted verifies."""

    def __init__(self, window: int = ROLLING_WINDOW):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"SpecCounters: window={window!r}, expected an int >= 1")
        self.window = window
        self.drafts = 0  # row-verifies that checked a draft of at least one token
        self.draft_tokens = 0  # draft tokens proposed, summed over those
        self.accepted_tokens = 0  # draft tokens the target accepted
        self.accepted_per_pos: list[int] = []  # [d]: drafts whose token at draft position d was accepted
        self.tokens_per_verify: dict[int, int] = {}  # tokens a drafted verify committed (accepted + 1) -> count
        self.plain_steps = 0  # row-steps decoded without a draft while a drafter was loaded
        self.steps = 0  # engine steps (one target forward over every busy row)
        self.last_batch = 0  # rows the latest step computed
        self._recent: deque[int] = deque()
        self.recent_tokens = 0  # tokens committed by the drafted verifies in the window

    def record_step(self, rows: int) -> None:
        self.steps += 1
        self.last_batch = rows

    def record_row(self, drafted: int, accepted: int, could_draft: bool) -> None:
        """One row's verify: `drafted` draft tokens offered, `accepted` of them kept; `could_draft`: a drafter is
        loaded (a step without a draft then counts as plain)."""
        if not drafted:
            self.plain_steps += could_draft
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        while len(self.accepted_per_pos) < accepted:
            self.accepted_per_pos.append(0)
        for d in range(accepted):
            self.accepted_per_pos[d] += 1
        tokens = accepted + 1
        self.tokens_per_verify[tokens] = self.tokens_per_verify.get(tokens, 0) + 1
        self._recent.append(tokens)
        self.recent_tokens += tokens
        while len(self._recent) > self.window:  # `window` may have been lowered since
            self.recent_tokens -= self._recent.popleft()

    @property
    def recent_drafts(self) -> int:
        return len(self._recent)

    def rolling_tau(self) -> float | None:
        """Tokens per drafted verify over the window; None before any draft."""
        n = len(self._recent)
        return self.recent_tokens / n if n else None
