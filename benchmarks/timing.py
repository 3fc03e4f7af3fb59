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


def python_hotspots(fn, calls: int = 1, top: int = 40, under: str = "", before=None) -> dict:
    """Where the host's Python time goes in ``calls`` calls of ``fn`` (cProfile, deterministic): the ``top``
    functions by own time and by cumulative time, ms per call, as ``"file:line(function)"`` with the file cut to its
    last two path parts; ``under`` keeps only functions whose file path contains it (e.g. ``"peft"``) in a third
    list; ``before()``, where given, runs unprofiled ahead of every call. cProfile slows Python calls more than C++
    ones, so compare shares between kinds, not absolute times."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(calls):
        if before is not None:
            before()
        prof.enable()
        fn()
        prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}

    def label(key) -> str:
        path, line, name = key
        return f"{'/'.join(path.split('/')[-2:])}:{line}({name})"

    def rows(keys, col: int) -> list:
        ranked = sorted(keys, key=lambda k: -stats[k][col])[:top]
        return [[label(k), round(stats[k][1] / calls, 1), round(stats[k][col] * 1e3 / calls, 3)] for k in ranked]

    total = sum(v[2] for v in stats.values()) * 1e3 / calls
    out = {"total_ms": round(total, 3), "by_own_time": rows(stats, 2), "by_cumulative_time": rows(stats, 3)}
    if under:
        mine = [k for k in stats if under in k[0]]
        out[f"own_time_under_{under}_ms"] = round(sum(stats[k][2] for k in mine) * 1e3 / calls, 3)
        out[f"by_own_time_under_{under}"] = rows(mine, 2)
    return out
