"""Where a DoRA training step's time goes, against LoRA's, at grid points (``bench_model.py --grid``'s shapes).

One optimizer step as users run it: forward with non-reentrant gradient checkpointing, backward, AdamW (or, with
``--measure infer``, one eval-mode forward without autograd). For each point and kind (ours DoRA, plain LoRA; one
process, the same base model) it records:

* the step's wall time (CUDA events, the queue empty at its start) and the host's issue time per phase
  (forward, backward, optimizer; ``perf_counter`` without a sync), median of ``--repeats``;
* from one profiled step: GPU busy time, the CUDA runtime calls (launches, graph launches, synchronizations, copies)
  and the busiest host ops and GPU kernels.

A step whose host issue time exceeds its GPU busy time is host-bound: its DoRA/LoRA ratio is the ratio of host
times, and what DoRA adds per module on the host is (host_dora - host_lora) / modules.

``--small-forward-numel N`` sets ``dora_dispatch.SMALL_FORWARD_NUMEL`` (the largest output an eval forward composes
with two PyTorch ops and reused factors instead of a Triton launch) for the run: a probe of that crossover, not a
setting users have; ``--scaled-b-kept-numel N`` likewise sets the largest B whose ``s·g·B`` an eval record keeps.

    PYTHONPATH=<ours> python benchmarks/profile_step.py --points "qwen1.5b bf16 r32 seq4096 b1 all drop0" \\
        --out $OUT/profile_step.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as bm  # noqa: E402
import model_worker as mw  # noqa: E402
from timing import python_hotspots  # noqa: E402


RUNTIME_CALLS = ("LaunchKernel", "GraphLaunch", "Synchronize", "Memcpy", "HostAlloc", "EventRecord", "EventQuery")


def point_spec(label: str) -> tuple[dict, dict]:
    """(model cfg for ``model_worker``, point) of a default-grid label, or of any label of the same form; the tiny
    grid's shapes (``tiny_llama``, ``tiny_qwen``) are for CPU smoke runs."""
    shape, mode, rank, seq, batch, targets, dropout = label.split()[:7]
    point = dict(shape=shape, mode=mode, rank=int(rank[1:]), seq=int(seq[3:]), batch=int(batch[1:]),
                 targets=targets, dropout=float(dropout[4:]))  # fmt: skip
    shapes = {**bm.GRID_SHAPES, **bm.TINY_GRID_SHAPES}
    if shape not in shapes:
        raise SystemExit(f"{label!r}: no shape {shape!r} (choose from {', '.join(shapes)})")
    dims = dict(shapes[shape])
    config_class, model_class = dims.pop("config_class"), dims.pop("model_class")
    kwargs = dict(dims, vocab_size=32000, max_position_embeddings=8192, initializer_range=0.02)
    cfg = dict(config_class=config_class, model_class=model_class, config_kwargs=kwargs, seed=0,
               seq=point["seq"], batch=point["batch"], loss_tokens=point["seq"] // 4)  # fmt: skip
    return cfg, point


def runtime_calls(prof, steps: int) -> dict:
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CPU" and e.key.startswith(("cuda", "cu")) and any(k in e.key for k in RUNTIME_CALLS):
            out[e.key] = round(e.count / steps, 1)
    return dict(sorted(out.items()))


def top(prof, steps: int, device: bool, n: int = 20) -> list:
    rows = []
    for e in prof.key_averages():
        if device:
            t = getattr(e, "device_time_total", 0) if e.device_type.name == "CUDA" else 0
        else:
            t = e.self_cpu_time_total if e.device_type.name == "CPU" else 0
        if t > 0:
            rows.append([e.key[:100], round(e.count / steps, 1), round(t / 1000.0 / steps, 3)])
    return sorted(rows, key=lambda r: -r[2])[:n]


def profile_kind(
    base,
    cfg,
    point,
    dora: bool,
    repeats: int,
    device: torch.device,
    compile_mode=None,
    pystats: bool = False,
    measure: str = "train",
) -> tuple[dict, object]:
    impl = {"name": "dora" if dora else "lora", "dora": dora}
    modules = list(bm.GRID_TARGETS[point["targets"]])
    model = mw.wrap(base, cfg, point["rank"], impl, point["mode"], modules, point["dropout"])
    mw.seed_adapters(model, 0, cfg["config_kwargs"]["initializer_range"])
    model.train()
    ids, labels = mw.make_inputs(cfg, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, foreach=True)
    phases: dict = {"forward": []} if measure == "infer" else {"forward": [], "backward": [], "optimizer": []}
    forward = mw.compiled_call(model, compile_mode)

    def infer(record: bool = False):
        t0 = time.perf_counter()
        with torch.no_grad(), mw.precision_ctx(point["mode"], device):
            forward(input_ids=ids, use_cache=False)
        if record:
            phases["forward"].append((time.perf_counter() - t0) * 1e3)

    def train_step(record: bool = False):
        t0 = time.perf_counter()
        with mw.precision_ctx(point["mode"], device):
            loss = forward(input_ids=ids, labels=labels, use_cache=False).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if record:
            for name, a, b in (("forward", t0, t1), ("backward", t1, t2), ("optimizer", t2, t3)):
                phases[name].append((b - a) * 1e3)

    if measure == "infer":
        model.eval()
    step = infer if measure == "infer" else train_step
    for _ in range(3):
        step()
    timer, wall = mw.Timer(device), []
    if device.type == "cuda":
        torch.cuda.synchronize()
    for _ in range(repeats):
        with timer.region(wall):
            step(record=True)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    gpu_ms = sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA") / 1000.0
    host = {k: statistics.median(v) for k, v in phases.items()}
    res = {
        "modules": sum(1 for m in model.modules() if hasattr(m, "lora_A")),
        "wall_ms": statistics.median(wall),
        "wall_samples_ms": [round(w, 3) for w in wall],
        "host_issue_ms": round(sum(host.values()), 3),
        "host_issue_ms_by_phase": {k: round(v, 3) for k, v in host.items()},
        "gpu_busy_ms_profiled": round(gpu_ms, 3),
        "runtime_calls_per_step": runtime_calls(prof, 1),
        "top_host_ops": top(prof, 1, device=False),
        "top_kernels": top(prof, 1, device=True, n=60),  # enough to account for a DoRA step's extra GPU time
    }
    if pystats:  # the host's Python time by function, three steps under cProfile
        res["python"] = python_hotspots(step, calls=3, under="peft")
    if dora:
        from peft.tuners.lora import dora as dora_mod

        res["summary"] = dora_mod.summary(model)
    return res, model.unload()


def point_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a script that times grid points on a device: ``--points``, ``--device``, ``--layers``."""
    p.add_argument("--points", required=True, help="';'-separated grid point labels")
    p.add_argument("--device", default="cuda", help="cuda; cpu runs every code path (a smoke test, no timings)")
    p.add_argument("--layers", type=int, help="override the shape's decoder layers (a CPU smoke: 1)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    point_arguments(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--compile", help="torch.compile mode for both kinds (default, max-autotune-no-cudagraphs, ...)")
    p.add_argument("--pystats", action="store_true", help="also record the host's Python time by function (cProfile)")
    p.add_argument("--measure", default="train", choices=("train", "infer"), help="a training step or an eval forward")
    p.add_argument("--small-forward-numel", type=int, help="dora_dispatch.SMALL_FORWARD_NUMEL for this run (a probe)")
    p.add_argument("--scaled-b-kept-numel", type=int, help="dora_dispatch.SCALED_B_KEPT_NUMEL for this run (a probe)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import transformers

    import peft

    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
    from peft.tuners.lora import dora_dispatch

    if args.small_forward_numel is not None:
        dora_dispatch.SMALL_FORWARD_NUMEL = args.small_forward_numel
    if args.scaled_b_kept_numel is not None:
        dora_dispatch.SCALED_B_KEPT_NUMEL = args.scaled_b_kept_numel
    env = {"peft": Path(peft.__file__).parent.parent.name, "torch": torch.__version__,
           "transformers": transformers.__version__, "gpu": gpu, "compile": args.compile, "measure": args.measure,
           "small_forward_numel": args.small_forward_numel,
           "scaled_b_kept_numel": args.scaled_b_kept_numel}  # fmt: skip
    result = {"env": env, "points": {}}
    bases: dict = {}
    for label in [s.strip() for s in args.points.split(";") if s.strip()]:
        cfg, point = point_spec(label)
        if args.layers:
            cfg["config_kwargs"]["num_hidden_layers"] = args.layers
        if point["shape"] not in bases:
            bases.clear()
            mw.release()
            base = mw.build_base(cfg, device, torch.bfloat16)
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            bases[point["shape"]] = base
        base = bases[point["shape"]]
        out = {}
        for kind in ("lora", "dora", "lora_again"):
            res, base = profile_kind(
                base, cfg, point, kind == "dora", args.repeats, device, args.compile, args.pystats, args.measure
            )
            base.disable_input_require_grads()
            out[kind] = res
            mw.release()
            print(f"{label} {kind}: wall {res['wall_ms']:.2f} ms, host {res['host_issue_ms']:.2f} ms "
                  f"{res['host_issue_ms_by_phase']}, gpu {res['gpu_busy_ms_profiled']:.2f} ms, "
                  f"calls {res['runtime_calls_per_step']}", flush=True)  # fmt: skip
        bases[point["shape"]] = base
        lora_wall = statistics.median([out["lora"]["wall_ms"], out["lora_again"]["wall_ms"]])
        lora_host = statistics.median([out["lora"]["host_issue_ms"], out["lora_again"]["host_issue_ms"]])
        out["dora_over_lora_wall"] = out["dora"]["wall_ms"] / lora_wall
        out["dora_extra_host_us_per_module"] = (out["dora"]["host_issue_ms"] - lora_host) * 1e3 / out["dora"]["modules"]
        print(f"{label}: DoRA/LoRA wall {out['dora_over_lora_wall']:.3f}, extra host "
              f"{out['dora_extra_host_us_per_module']:.0f} us per module", flush=True)  # fmt: skip
        key, n = label, 1
        while key in result["points"]:  # a point timed again in the same run (a drift probe) keeps both records
            n += 1
            key = f"{label} #{n}"
        result["points"][key] = out
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
