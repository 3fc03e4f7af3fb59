"""Why a compiled DoRA model paired with a compiled LoRA twin costs more than either shows in its own process.

At the small compiled point (8-layer Llama-8B shape, r = 16, 512 tokens, one H200) the benchmark's paired
inference under ``mode="reduce-overhead"`` put DoRA at 1.38x its LoRA twin (8.0 against 5.9 ms, eight tight
pairs), while the same forwards timed in separate processes were 6.74 against 6.67 ms; the paired LoRA twin's
compiled training step took 43.7 ms against 26.9 in its own process under ``default``. This separates the two
effects in one process: both models are built as ``bench_model.py --compile`` builds them (DoRA on its base, a
plain-LoRA twin on its own base with the same seeded weights, each ``torch.compile``d on its own,
``cudagraph_mark_step_begin`` before every call), then

* ``runs``: ``--calls`` calls of one model back to back, then of the other, then the first again (A...B...A...);
* ``pairs``: ``--calls`` ABBA pairs, the benchmark's order;

each call's wall time (CUDA events, the queue empty at its start) and host issue time (``perf_counter``, no sync).
Then one profiled call of each model in each order (after the other model's call, and after its own): the CUDA
runtime calls (graph launches, copies, synchronizations, launches) and the busiest host ops; and cProfile's top
functions over ``--pystats`` alternating pairs per side (cudagraph trees' bookkeeping shows there by name).

    PYTHONPATH=<ours> python benchmarks/probe_compiled_pairs.py --compile reduce-overhead --measure infer \\
        --out $OUT/probe_compiled_pairs.json
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
import model_worker as mw  # noqa: E402
from profile_step import point_spec, runtime_calls, top  # noqa: E402
from timing import python_hotspots  # noqa: E402


def make_side(cfg: dict, point: dict, dora: bool, device, compile_mode: str, measure: str):
    """One side's step function: its own base (seeded as the benchmark's), the adapter and the compiled call, which
    the function keeps alive; ``step(record)`` appends (wall ms, host ms) to ``record`` where given."""
    base = mw.build_base(cfg, device, torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    impl = {"name": "dora" if dora else "lora", "dora": dora}
    model = mw.wrap(base, cfg, point["rank"], impl, point["mode"], dropout=point["dropout"])
    mw.seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
    forward = mw.compiled_call(model, compile_mode)
    ids, labels = mw.make_inputs(cfg, device)
    timer = mw.Timer(device)
    train = measure == "train"
    model.train(train)
    opt = (
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, foreach=True) if train else None
    )

    def work():
        with mw.precision_ctx(point["mode"], device):
            if not train:
                with torch.no_grad():
                    forward(input_ids=ids, use_cache=False)
                return
            loss = forward(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()

    def step(record=None):
        if train:
            model.zero_grad(set_to_none=True)
        wall: list = []
        with timer.region(wall):
            t0 = time.perf_counter()
            work()
            host = (time.perf_counter() - t0) * 1e3
        if record is not None:
            record.append((wall[0], host))

    return step


def stats(record: list) -> dict:
    walls, hosts = [w for w, _ in record], [h for _, h in record]
    return {
        "wall_median_ms": round(statistics.median(walls), 3),
        "host_median_ms": round(statistics.median(hosts), 3),
        "wall_ms": [round(w, 3) for w in walls],
        "host_ms": [round(h, 3) for h in hosts],
    }


def profiled(step, device) -> dict:
    cuda = device.type == "cuda"
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else lambda device: None
    sync(device)
    with torch.profiler.profile(activities=acts) as prof:
        step()
        sync(device)
    return {"runtime_calls": runtime_calls(prof, 1), "top_host_ops": top(prof, 1, device=False, n=25)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--point", default="llama8b autocast r16 seq512 b1 all drop0", help="a grid point label")
    p.add_argument("--layers", type=int, default=8, help="decoder layers (the benchmark's compiled runs: 8)")
    p.add_argument("--compile", default="reduce-overhead")
    p.add_argument("--measure", choices=("infer", "train"), default="infer")
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--pystats", type=int, default=3, help="alternating pairs under cProfile (0: none)")
    p.add_argument("--device", default="cuda", help="cuda; cpu runs every code path (a smoke test, no timings)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import peft

    device = torch.device(args.device)
    cfg, point = point_spec(args.point)
    cfg["config_kwargs"]["num_hidden_layers"] = args.layers
    sides = {
        name: make_side(cfg, point, name == "dora", device, args.compile, args.measure) for name in ("dora", "lora")
    }
    for _ in range(3):  # compile, capture, warm up: in the benchmark's order
        for name in ("dora", "lora"):
            sides[name]()
    out = {
        "env": {
            "peft": Path(peft.__file__).parent.parent.name,  # the install's folder (ours: PEFT_OURS), no machine path
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        },
        "config": dict(vars(args), out=Path(args.out).name),
    }
    runs = {"dora": [], "lora": [], "dora_again": []}
    for name in runs:
        for _ in range(args.calls):
            sides[name.split("_")[0]](runs[name])
    pairs = {"dora": [], "lora": []}
    for k in range(args.calls):
        for name in ("dora", "lora") if k % 2 == 0 else ("lora", "dora"):
            sides[name](pairs[name])
    out["runs"] = {name: stats(r) for name, r in runs.items()}
    out["pairs"] = {name: stats(r) for name, r in pairs.items()}
    lora_runs = out["runs"]["lora"]["wall_median_ms"]
    dora_runs = statistics.median([out["runs"][n]["wall_median_ms"] for n in ("dora", "dora_again")])
    out["dora_over_lora_runs"] = round(dora_runs / lora_runs, 4)
    out["dora_over_lora_pairs"] = round(
        out["pairs"]["dora"]["wall_median_ms"] / out["pairs"]["lora"]["wall_median_ms"], 4
    )
    prof = {}
    for name, other in (("dora", "lora"), ("lora", "dora")):
        sides[other]()
        prof[f"{name}_after_{other}"] = profiled(sides[name], device)
        sides[name]()
        prof[f"{name}_after_itself"] = profiled(sides[name], device)
    out["profiled"] = prof
    if args.pystats:  # each side's call after the other's (the pairs' order), that call alone profiled
        out["python_after_the_other"] = {
            name: python_hotspots(sides[name], calls=args.pystats, top=30, before=sides[other])
            for name, other in (("dora", "lora"), ("lora", "dora"))
        }
    print(
        f"{args.point} {args.compile} {args.measure}: DoRA/LoRA runs {out['dora_over_lora_runs']} "
        f"(DoRA {out['runs']['dora']['wall_median_ms']} / {out['runs']['dora_again']['wall_median_ms']}, LoRA "
        f"{lora_runs} ms), pairs {out['dora_over_lora_pairs']} (DoRA {out['pairs']['dora']['wall_median_ms']}, LoRA "
        f"{out['pairs']['lora']['wall_median_ms']} ms)",
        flush=True,
    )
    for key, rec in prof.items():
        print(f"  {key}: {rec['runtime_calls']}", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
