"""Where a DoRA training step's time goes on several GPUs, against LoRA's: under FSDP2 with the sharded norm and
without it (each rank computing the whole norm), or under another engine of the benchmark (``--engine fsdp1``,
``zero2``, ``zero3``; ``--precision mp``: fp32 parameters with bf16 compute, as the benchmark's).

Started as ``torchrun --nproc_per_node N benchmarks/profile_multi_gpu.py --out OUT.json`` with our wheel's install
first on ``PYTHONPATH``. Every process builds the multi-GPU benchmark's model (``multi_gpu_worker.build``: a seeded
Llama, adapters on all linear projections, non-reentrant checkpointing), wraps it as the benchmark does (FSDP2's
``fully_shard``, FSDP1, or DeepSpeed's engine with its backward and step), and for each variant times ``--steps``
AdamW steps (CUDA events, the slowest process) and profiles one step on process 0: GPU time per kernel class (GEMMs,
NCCL, Triton, elementwise), the busiest kernels, the busiest host ops, and the GPU busy time of the compute stream
against the step's wall time (what is left is waiting: for an all-gather, for the host).

Variants: ``lora`` (``use_dora=False``), ``ours`` (defaults), ``ours_whole_norm`` (``PEFT_DORA_SHARDED_NORM=0``:
every rank computes the whole norm from the gathered W, the sharded norm's all-gather off), ``ours_own_group`` (the
sharded norm's all-gather on a communicator of its own: NCCL runs one communicator's collectives in order, so on
FSDP2's it queues with the parameter all-gathers and gradient reduce-scatters), ``ours_eager``
(``PEFT_DORA_FUSED=0``). The two that change the sharded norm run under FSDP2 only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_multi_gpu as bmg  # noqa: E402
import model_worker as mw  # noqa: E402
import multi_gpu_worker as mgw  # noqa: E402
from profile_step import top  # noqa: E402


VARIANTS = ("lora", "ours", "ours_whole_norm", "ours_own_group", "ours_eager")
VARIANT_ENV = ("PEFT_DORA_FUSED", "PEFT_DORA_SHARDED_NORM")  # what a variant sets: cleared before and after it
_OWN_GROUP = []


def profile_step(step, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    classes = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA":
            label = mw.kernel_class(e.key)
            classes[label] = classes.get(label, 0.0) + e.device_time_total / 1000.0 / steps
    # busy time per stream from the raw kernel events (overlapping NCCL and compute streams counted apart)
    busy: dict = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.time_range.elapsed_us() > 0:
            stream = getattr(ev, "device_resource_id", None)
            key = f"{'nccl' if 'nccl' in ev.name.lower() else 'compute'}:{stream}"
            busy[key] = busy.get(key, 0.0) + ev.time_range.elapsed_us() / 1000.0 / steps
    return {
        "classes_ms": {k: round(v, 3) for k, v in sorted(classes.items())},
        "busy_ms_per_stream": {k: round(v, 3) for k, v in sorted(busy.items())},
        "kernels": top(prof, steps, device=True, n=25),
        "host": top(prof, steps, device=False),
    }


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(variant: str, spec: dict, rank: int, device, mesh, world: int, proc: int, steps: int) -> dict:
    from peft.tuners.lora import dora, dora_dist

    for name in VARIANT_ENV:
        os.environ.pop(name, None)
    if variant == "ours_eager":
        os.environ["PEFT_DORA_FUSED"] = "0"
    elif variant == "ours_whole_norm":  # as users switch it
        os.environ["PEFT_DORA_SHARDED_NORM"] = "0"
    dora._invalidate_fused_cache()
    row_group = dora_dist._row_group
    if variant == "ours_own_group":  # the norm's all-gather on a communicator of its own, not FSDP2's
        if not _OWN_GROUP:
            _OWN_GROUP.append(dist.new_group(list(range(world))))

        def own(fp, found=row_group):
            hit = found(fp)
            return None if hit is None else (_OWN_GROUP[0],) + hit[1:]

        dora_dist._row_group = own
    try:
        spec = dict(spec, impl={"name": variant, "dora": variant != "lora"})
        model = mgw.build_wrapped(spec, rank, device, mesh)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec["lr"])
        zero = spec["engine"].startswith("zero")
        if zero:
            model, opt = mgw.deepspeed_engine(model, opt, spec)
        data = mgw.batches(dict(spec, warmup=0, steps=1), world, proc, device)[0]

        def step():
            if zero:  # the engine's backward and step (which zeroes the gradients), as the benchmark trains
                model.backward(model(input_ids=data, labels=data, use_cache=False).loss)
                model.step()
                return
            opt.zero_grad(set_to_none=True)
            model(input_ids=data, labels=data, use_cache=False).loss.backward()
            opt.step()

        for _ in range(3):
            step()
        times = []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1000.0)
        t = torch.tensor(times, device=device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = {"variant": variant, "rank": rank, "median_ms": statistics.median(t.tolist()), "samples_ms": t.tolist()}
        prof = profile_step(step, 2)
        if proc == 0:
            out["profile"] = prof
        model = opt = step = None  # the closure's cells too: the model's memory goes before the next variant
        mw.release()
        return out
    finally:
        dora_dist._row_group = row_group
        for name in VARIANT_ENV:
            os.environ.pop(name, None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8b", choices=list(bmg.SHAPES))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, a smoke run")
    p.add_argument("--engine", default="fsdp2", choices=list(mgw.ENGINES), help="as the benchmark's --engine")
    p.add_argument("--precision", default="bf16", choices=("bf16", "mp"), help="as the benchmark's --precision")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    cfg = bmg.resolve_config(bmg.parse_args(["--shape", args.shape, "--layers", str(args.layers), "--seq",
                                             str(args.seq), "--device", args.device, "--engine", args.engine,
                                             "--precision", args.precision]))  # fmt: skip
    if args.engine != "fsdp2" and set(args.variants.split(",")) & {"ours_whole_norm", "ours_own_group"}:
        p.error("ours_whole_norm and ours_own_group change the FSDP2 sharded norm: --engine fsdp2 only")
    spec = dict(cfg, model=cfg["model"], warmup=0, steps=1)
    device, mesh, world, proc = mgw.setup(spec)
    results = []
    for variant in args.variants.split(","):
        rec = run_variant(variant, spec, args.rank, device, mesh, world, proc, args.steps)
        results.append(rec)
        if proc == 0:
            print(f"{variant}: {rec['median_ms']:.2f} ms; classes {rec['profile']['classes_ms']}; "
                  f"streams {rec['profile']['busy_ms_per_stream']}", flush=True)  # fmt: skip
            gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
            doc = {"world": world, "gpu": gpu, "args": dict(vars(args), out=Path(args.out).name), "results": results}
            Path(args.out).write_text(json.dumps(doc, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
