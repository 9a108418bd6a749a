"""Step timing on the device at hand: medians of interleaved rounds, so that other work on a shared machine slows
every timed call alike."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable

import torch

from runtime.device import synchronizer
from runtime.target.model import Transformer


def interleaved_ms(calls: dict[Hashable, Callable[[], object]], device: torch.device, rounds: int, steps: int,
                   progress: Callable[[int], object] = lambda n: None) -> dict[Hashable, float]:
    """Median over `rounds` of the ms per call of each named call, run `steps` times a round, after one untimed
    call each. Rounds interleave the calls, so noise from other work on the machine falls on each alike;
    `progress(1)` after each round."""
    sync = synchronizer(device)
    for call in calls.values():
        call()
    samples: dict[Hashable, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                call()
            sync()
            samples[name].append((time.perf_counter() - start) / steps)
        progress(1)
    return {name: 1e3 * statistics.median(s) for name, s in samples.items()}


@torch.inference_mode()
def verify_ms(target: Transformer, sizes: list[int], context: int, rounds: int = 5, steps: int = 2,
              progress: Callable[[int], object] = lambda n: None) -> dict[int, float]:
    """ms of the target's forward over n rows after `context` committed tokens, with every row's logits, as a
    verify of the root and n - 1 nodes computes them (a chain: the same shapes as any tree of n - 1 nodes), for
    each n in `sizes`; 1 is a plain decode step."""
    device = target.device
    cache = target.new_cache(1, context + max(sizes))
    ids = torch.randint(0, target.config.vocab_size, (1, context + max(sizes)),
                        generator=torch.Generator().manual_seed(0)).to(device)
    target(ids[:, :context], cache, torch.arange(context, device=device)[None])
    cache.advance(context)

    def forward(n: int) -> Callable[[], object]:
        positions = torch.arange(context, context + n, device=device)[None]
        mask = torch.ones(n, n, dtype=torch.bool, device=device).tril() if n > 1 else None
        return lambda: target(ids[:, context:context + n], cache, positions, mask)

    return interleaved_ms({n: forward(n) for n in sizes}, device, rounds, steps, progress)
