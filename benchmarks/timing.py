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


def kernel_us(fn, n: int = 20, name_chars: int = 60) -> dict:
    """Mean GPU µs per call of ``fn``, kernel by kernel (torch.profiler, CUDA activity only), names cut to
    ``name_chars``."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    agg = collections.Counter()
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            agg[e.name[:name_chars]] += e.device_time / n
    return {k: round(v, 2) for k, v in agg.most_common()}
