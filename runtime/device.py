"""Device helpers shared by the timers."""
from __future__ import annotations

from typing import Callable

import torch


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for the work queued on `device`, so a timer charges it to the code that queued it (CUDA
    runs asynchronously; the CPU needs no wait)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
