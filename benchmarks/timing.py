"""Wall-clock loops shared by the benchmarks (no torch import here, so every worker can use it)."""

from __future__ import annotations

import statistics
import time


def loop_us(fn, sync, warmup: int, loops: int, calls: int) -> dict:
    """µs per call over ``loops`` runs of ``calls`` back-to-back calls after ``warmup`` calls, each run ended by
    ``sync()`` (e.g. ``torch.cuda.synchronize``): ``{"median", "min", "max"}`` over the runs."""
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}
