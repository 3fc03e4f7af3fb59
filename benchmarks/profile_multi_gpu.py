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

Variants: ``lora`` (``use_dora=False``), ``ours`` (defaults; ``ours@PEFT_DORA_X=v@...`` with those settings),
``ours_whole_norm`` (``PEFT_DORA_SHARDED_NORM=0``:
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
from timing import python_hotspots  # noqa: E402


VARIANTS = ("lora", "ours", "ours_whole_norm", "ours_own_group", "ours_eager")
VARIANT_ENV = ("PEFT_DORA_FUSED", "PEFT_DORA_SHARDED_NORM")  # what a variant sets: cleared before and after it
_OWN_GROUP = []


_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # runtime launches (PyTorch, cuBLAS) and driver ones (Triton's)


def _covering(spans: list, t: float) -> list:
    """The names of the spans (``(ts, end, name)``, sorted by ``ts``) that cover time ``t``, outermost first."""
    return [name for ts, end, name in spans if ts <= t <= end]


def compute_gaps(trace: dict, steps: int, min_us: float = 2.0) -> dict:
    """Where the compute stream (the stream with the most non-NCCL kernel time) sits idle, per step, from a Chrome
    trace of the profiler: each gap between two of its kernels is **host** time where the next kernel's launch call
    ended after the previous kernel (the GPU waited for the host to issue it), and **wait** time otherwise (the
    kernel was queued and waited on another stream: a collective, a copy). A wait is named by the kernel of another
    stream that ended last before the kernel started (``stream:name``); host time by the innermost host op that was
    running on the launching thread in the middle of the gap, and, where the trace has Python frames
    (``with_stack``), by the innermost frame and by the innermost frame of this package (``peft/...``). Launches are
    the runtime's and the driver's (Triton launches through the driver API: without those a late Triton kernel reads
    as a wait). Gaps under ``min_us`` are launch latency and left out."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    launches = {
        e["args"]["correlation"]: (e["ts"] + e.get("dur", 0), e.get("tid"))
        for e in events
        if e.get("ph") == "X" and e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})
    }
    ops: dict = {}
    frames: dict = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        table = ops if e.get("cat") == "cpu_op" else frames if e.get("cat") == "python_function" else None
        if table is not None:
            table.setdefault(e.get("tid"), []).append((e["ts"], e["ts"] + e.get("dur", 0), e["name"][:90]))
    for table in (ops, frames):
        for spans in table.values():
            spans.sort()
    busy: dict = {}
    for k in kernels:
        if "nccl" not in k["name"].lower():
            busy[k["args"].get("stream")] = busy.get(k["args"].get("stream"), 0.0) + k.get("dur", 0)
    if not busy:
        return {}
    stream = max(busy, key=busy.get)
    mine = sorted((k for k in kernels if k["args"].get("stream") == stream), key=lambda k: k["ts"])
    others = sorted(
        (k["ts"] + k.get("dur", 0), f"{k['args'].get('stream')}:{k['name'][:60]}")
        for k in kernels
        if k["args"].get("stream") != stream
    )
    host = wait = 0.0
    waits: dict = {}
    by_op: dict = {}
    by_frame: dict = {}
    by_our_frame: dict = {}
    for prev, nxt in zip(mine, mine[1:]):
        end = prev["ts"] + prev.get("dur", 0)
        gap = nxt["ts"] - end
        if gap < min_us:
            continue
        issued, tid = launches.get(nxt["args"].get("correlation"), (None, None))
        late = 0.0 if issued is None else min(gap, max(0.0, issued - end))
        if late > 0:
            host += late
            mid = end + late / 2
            inner = _covering(ops.get(tid, []), mid)
            label = inner[-1] if inner else "(no host op)"
            by_op[label] = by_op.get(label, 0.0) + late
            chain = _covering(frames.get(tid, []), mid)
            if chain:
                by_frame[chain[-1]] = by_frame.get(chain[-1], 0.0) + late
                ours = [f for f in chain if "peft/" in f]
                label = ours[-1] if ours else "(none of peft)"
                by_our_frame[label] = by_our_frame.get(label, 0.0) + late
        rest = gap - late
        if rest >= min_us:
            wait += rest
            before = [name for t, name in others if end <= t <= nxt["ts"] + 1]
            label = before[-1] if before else "(nothing ended on another stream)"
            waits[label] = waits.get(label, 0.0) + rest
    span = (mine[-1]["ts"] + mine[-1].get("dur", 0) - mine[0]["ts"]) if mine else 0.0
    ms = 1000.0 * steps

    def ranked(table: dict, n: int = 10) -> dict:
        return {k: round(v / ms, 3) for k, v in sorted(table.items(), key=lambda kv: -kv[1])[:n]}

    return {
        "stream": stream,
        "span_ms": round(span / ms, 3),
        "busy_ms": round(busy[stream] / ms, 3),
        "idle_waiting_for_host_ms": round(host / ms, 3),
        "idle_waiting_on_other_streams_ms": round(wait / ms, 3),
        "waits_by_kernel_ms": ranked(waits),
        "host_gaps_by_op_ms": ranked(by_op),
        "host_gaps_by_frame_ms": ranked(by_frame),
        "host_gaps_by_peft_frame_ms": ranked(by_our_frame),
    }


def profile_step(step, steps: int, stack: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=stack) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    gaps = {}
    if cuda:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                gaps = compute_gaps(json.load(f), steps)
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
        "compute_gaps": gaps,
    }


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_variant(
    variant: str,
    spec: dict,
    rank: int,
    device,
    mesh,
    world: int,
    proc: int,
    steps: int,
    stack: bool = False,
    pystats: bool = False,
) -> dict:
    from peft.tuners.lora import dora, dora_dist

    name_env = variant.split("@")  # "ours@PEFT_DORA_X=0@...": ours with those settings
    variant, extra_env = name_env[0], dict(kv.split("=", 1) for kv in name_env[1:])
    if extra_env and (variant != "ours" or any(not k.startswith("PEFT_DORA_") for k in extra_env)):
        raise SystemExit(f"{'@'.join(name_env)}: only ours takes settings, and only PEFT_DORA_* ones")
    for name in VARIANT_ENV + tuple(extra_env):
        os.environ.pop(name, None)
    os.environ.update(extra_env)
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
        label = "@".join(name_env)
        spec = dict(spec, impl={"name": variant, "dora": variant != "lora"})
        model = mgw.build_wrapped(spec, rank, device, mesh)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec["lr"])
        zero = spec["engine"].startswith("zero")
        if zero:
            model, opt = mgw.deepspeed_engine(model, opt, spec)
        data = mgw.batches(dict(spec, warmup=0, steps=1), world, proc, device)[0]

        phases = []  # host issue time of each timed step's forward, backward and optimizer step (no sync between)

        def step():
            t0 = time.perf_counter()
            if zero:  # the engine's backward and step (which zeroes the gradients), as the benchmark trains
                loss = model(input_ids=data, labels=data, use_cache=False).loss
                t1 = time.perf_counter()
                model.backward(loss)
                t2 = time.perf_counter()
                model.step()
            else:
                opt.zero_grad(set_to_none=True)
                loss = model(input_ids=data, labels=data, use_cache=False).loss
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                opt.step()
            phases.append((t1 - t0, t2 - t1, time.perf_counter() - t2))

        for _ in range(3):
            step()
        del phases[:]
        times = []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1000.0)
        t = torch.tensor(times, device=device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out = {"variant": label, "rank": rank, "median_ms": statistics.median(t.tolist()), "samples_ms": t.tolist()}
        host = {
            name: round(statistics.median(p[i] for p in phases) * 1000.0, 3)
            for i, name in enumerate(("forward", "backward", "optimizer"))
        }
        # each timed step's host issue time (forward + backward + optimizer), beside its wall time in samples_ms:
        # whether a slow step is one whose host was late, on this process or another
        issued = [round(sum(p) * 1000.0, 3) for p in phases]
        hot = python_hotspots(step, calls=2, top=60, under="peft") if pystats else None
        prof = profile_step(step, 2, stack)
        every = [None] * world  # each process's compute-stream gaps: a wait on one is often the host of another
        dist.all_gather_object(every, {"host_issue_ms": host, "host_issue_ms_per_step": issued,
                                       "compute_gaps": prof["compute_gaps"], "python": hot})  # fmt: skip
        if proc == 0:
            out["profile"] = dict(prof, per_process=every)
        model = opt = step = None  # the closure's cells too: the model's memory goes before the next variant
        mw.release()
        return out
    finally:
        dora_dist._row_group = row_group
        for name in VARIANT_ENV + tuple(extra_env):
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
    p.add_argument("--stack", action="store_true", help="Python frames in the profile: host gaps named by function")
    p.add_argument("--pystats", action="store_true", help="cProfile two steps per process (benchmarks/timing.py)")
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
        rec = run_variant(variant, spec, args.rank, device, mesh, world, proc, args.steps, args.stack, args.pystats)
        results.append(rec)
        if proc == 0:
            hosts = [p["host_issue_ms"] for p in rec["profile"]["per_process"]]
            print(f"{rec['variant']}: {rec['median_ms']:.2f} ms; host issue {hosts}; classes "
                  f"{rec['profile']['classes_ms']}; gaps {rec['profile']['compute_gaps']}", flush=True)  # fmt: skip
            gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
            doc = {"world": world, "gpu": gpu, "args": dict(vars(args), out=Path(args.out).name), "results": results}
            Path(args.out).write_text(json.dumps(doc, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
