"""Host time of DoRA's pieces in a multi-GPU training step: ``profile_multi_gpu.py`` run with wall-clock timers
(``time.perf_counter``, no CUDA syncs) around the DoRA Linear's forward parts (``adapted_output``, the norm, the
FSDP2 sharded norm's own rows, its row all-gather, the fused training node's forward and backward) and the
optimizer-step hook, reset three optimizer steps after DoRA's first forward (so no Triton compile is counted), and
CUDA's sync debug mode ("warn") for the three steps after that, each synchronizing call's stack kept. Printed per
process as milliseconds per step.

    torchrun --standalone --nproc_per_node 2 benchmarks/probe_fsdp2_host_timers.py --variants ours --rank 128 \
        --out OUT.json   # then any other profile_multi_gpu.py argument

The training node's backward includes the checkpoint recompute of its decoder layer (its first ``saved_tensors``
access unpacks, which recomputes the layer's forward), so its timer is a layer's recompute plus the backwards.
"""

import atexit
import collections
import os
import runpy
import sys
import time
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.optim.optimizer import _global_optimizer_post_hooks as hooks

from peft.tuners.lora import dora, dora_cache, dora_dist, dora_fused
from peft.tuners.lora.dora import DoraLinearLayer


HERE = os.path.dirname(os.path.abspath(__file__))


T, N = collections.defaultdict(float), collections.Counter()
S = {"steps": 0, "first": None, "reset": None}
SYNCS = collections.Counter()


def timed(name, fn):
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            T[name] += time.perf_counter() - t
            N[name] += 1

    return w


class DistProxy:
    def __getattr__(self, k):
        return getattr(dist, k)


proxy = DistProxy()
proxy.all_gather_into_tensor = timed("all_gather_into_tensor", dist.all_gather_into_tensor)
dora_dist.dist = proxy
dora_dist.gather_rows = timed("gather_rows", dora_dist.gather_rows)
dora_dist.norm_shards = timed("norm_shards", dora_dist.norm_shards)
_fn = DoraLinearLayer._forward_norm


def first_norm(self, *a, **k):
    if S["first"] is None:
        S["first"] = S["steps"]
    return _fn(self, *a, **k)


DoraLinearLayer._forward_norm = first_norm
for name in (
    "_own_rows",
    "_sharded_norm",
    "_norm_shards",
    "_unit_followers",
    "_forward_norm",
    "_scale",
    "adapted_output",
):
    if hasattr(DoraLinearLayer, name):
        setattr(DoraLinearLayer, name, timed(name, getattr(DoraLinearLayer, name)))
dora.factored_row_norm = timed("factored_row_norm", dora.factored_row_norm)
for name in ("_backward_triton", "_output_triton", "output_saves_itself"):
    setattr(dora_fused, name, timed(name, getattr(dora_fused, name)))
dora_cache.prefetch_shard_zero_tests = timed("prefetch_shard_zero_tests", dora_cache.prefetch_shard_zero_tests)
cls = dora_fused.FusedDoRALinearFunction
cls.forward = staticmethod(timed("Fused.forward", cls.forward))
cls.backward = staticmethod(timed("Fused.backward", cls.backward))


def record_sync(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message):
        return
    frames = [f for f in traceback.extract_stack()[:-2] if "site-packages" in f.filename or "peft" in f.filename]
    where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}({f.name})" for f in frames[-4:][::-1])
    SYNCS[f"{str(message)[:60]} @ {where}"] += 1


warnings.showwarning = record_sync

_hook = dora_cache._after_optimizer_step


def after_step(*a, **k):
    t = time.perf_counter()
    _hook(*a, **k)
    T["after_optimizer_step"] += time.perf_counter() - t
    N["after_optimizer_step"] += 1
    S["steps"] += 1
    if S["first"] is not None and S["steps"] == S["first"] + 3:
        T.clear()
        N.clear()
        S["reset"] = S["steps"]
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(1)
    if S["reset"] is not None and S["steps"] == S["reset"] + 3 and torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode(0)


for k, h in list(hooks.items()):
    if h is _hook:
        hooks[k] = after_step


def report():
    rank = int(os.environ.get("RANK", 0))
    steps = max(1, S["steps"] - (S["reset"] or 0))
    rows = sorted(T.items(), key=lambda kv: -kv[1])
    print(
        f"[rank {rank}] host ms per step over {steps} steps: "
        + "; ".join(f"{k} {v * 1e3 / steps:.2f} ({N[k] / steps:.0f}x)" for k, v in rows),
        flush=True,
    )
    for k, n in SYNCS.most_common(8):
        print(f"[rank {rank}] sync x{n}: {k}", flush=True)


atexit.register(report)
sys.argv = ["profile_multi_gpu.py", *sys.argv[1:]]
runpy.run_path(os.path.join(HERE, "profile_multi_gpu.py"), run_name="__main__")
