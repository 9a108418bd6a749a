"""Device helpers shared by the timers."""
from __future__ import annotations

import platform
from typing import Callable

import torch

from kernels.cpu_gemm import cpu_info


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A call that waits for the work queued on `device`, so a timer charges it to the code that queued it (CUDA
    runs asynchronously; the CPU needs no wait)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (x86 `model name`, Arm `Model` or `Hardware`), else platform's
    guess where /proc/cpuinfo has none."""
    return (cpu_info("model name") or cpu_info("Model") or cpu_info("Hardware") or platform.processor()
            or platform.machine())
