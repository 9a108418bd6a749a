"""The drift alert: acceptance on live traffic against what validate measured for the bundle. When the tokens per
drafted verify over the last `window` drafted verifies fall below the validated tau by more than `margin`, the
traffic no longer looks like what the drafter was trained and validated on: serving logs one line and raises the
`draftsmith_drift_alert` gauge, and both go back once acceptance recovers. Each time the alert goes up it can call
a hook (pipeline.serving.retrain_trigger starts a retraining DAG run)."""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.errors import DraftsmithError
from pipeline.serving.settings import env_number

WINDOW_ENV, MARGIN_ENV = "DRAFTSMITH_DRIFT_WINDOW", "DRAFTSMITH_DRIFT_MARGIN"
log = logging.getLogger("draftsmith.serving")


@dataclass(frozen=True)
class DriftSettings:
    window: int = 512  # drafted verifies the rolling tau covers
    margin: float = 0.3  # tokens per verify below the validated tau that count as drift

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise DraftsmithError(f"drift window={self.window!r}: expected an integer >= 1")
        if not (isinstance(self.margin, (int, float)) and math.isfinite(self.margin) and self.margin >= 0):
            raise DraftsmithError(f"drift margin={self.margin!r}: expected a number >= 0")

    @staticmethod
    def from_env() -> "DriftSettings":
        """$DRAFTSMITH_DRIFT_WINDOW and $DRAFTSMITH_DRIFT_MARGIN; a bad one is a one-line error naming it."""
        d = DriftSettings()
        return DriftSettings(env_number(WINDOW_ENV, d.window, int, 1), env_number(MARGIN_ENV, d.margin, float, 0))


class DriftMonitor:
    """Reads the engine's counters (runtime.serving.spec_counters) whenever asked; cheap enough for every request."""

    def __init__(self, counters, validated_tau: float | None, settings: DriftSettings = DriftSettings(),
                 on_alert: Callable[[str], None] | None = None):
        """`on_alert(reason)`: called once each time the alert goes up (not at every check while it stays up)."""
        self.counters, self.validated_tau, self.settings, self.on_alert = counters, validated_tau, settings, on_alert
        counters.window = settings.window
        self.alert = False

    def check(self) -> bool:
        """Whether the alert is up; logs one line each time it goes up or down. No verdict (the alert stays as it
        is) without a validated tau or before the window has filled."""
        c, s = self.counters, self.settings
        tau = c.rolling_tau()
        if self.validated_tau is None or tau is None or c.recent_drafts < s.window:
            return self.alert
        drifted = tau < self.validated_tau - s.margin
        if drifted != self.alert:
            self.alert = drifted
            if drifted:
                log.warning("drift: rolling tau %.2f over the last %d drafted verifies is below the bundle's validated "
                            "tau %.2f by more than %.2f: traffic has moved away from what the drafter was trained on",
                            tau, s.window, self.validated_tau, s.margin)
                if self.on_alert is not None:
                    try:  # whatever the hook does, the request that ran this check is answered
                        self.on_alert(f"drift alert: rolling tau {tau:.2f} over the last {s.window} drafted "
                                      f"verifies, validated tau {self.validated_tau:.2f}, margin {s.margin:.2f}")
                    except Exception as e:
                        log.warning("drift: the alert's hook failed: %s", e)
            else:
                log.warning("drift over: rolling tau %.2f is back within %.2f of the validated tau %.2f", tau,
                            s.margin, self.validated_tau)
        return self.alert
