"""Where an eval forward's extra host time goes, DoRA against LoRA, at host-bound grid points, without cProfile.

``profile_step.py --measure infer --pystats`` found DoRA's eval forward host-bound at small grid points (H100:
llama1b autocast r64 seq512 b8, 21.8 against LoRA's 11.7 ms, GPU busy ~9 ms for both), while cProfile put DoRA's
Python time at or below LoRA's: the extra host time is not where cProfile looks. This probe times the forward on
the real host (``perf_counter`` from an empty queue to the call's return: the host's issue time; and to the end of
the GPU work: the wall) and, in the same forwards, the host time spent inside the adapted layers' forwards
(``lora.Linear.forward``, wrapped), for LoRA and DoRA twins of one base model, in alternating rounds, under
variants: the cyclic garbage collector off (``gc_off``), and every eval output of DoRA composed by the small tier's
two PyTorch ops (``small``: ``dora_dispatch.SMALL_FORWARD_NUMEL`` unbounded) instead of the one-pass Triton kernel.

    PYTHONPATH=<ours> python benchmarks/probe_infer_host.py --points "llama1b autocast r64 seq512 b8 all drop0" \\
        --out $OUT/probe_infer_host.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_model as bm  # noqa: E402
import model_worker as mw  # noqa: E402
from profile_step import point_spec  # noqa: E402


_inside = [0.0, 0]  # seconds spent inside adapted layers' forwards, calls


def _wrap_layer_forward() -> None:
    from peft.tuners.lora import layer

    plain = layer.Linear.forward

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = plain(self, *args, **kwargs)
        _inside[0] += time.perf_counter() - t0
        _inside[1] += 1
        return out

    layer.Linear.forward = timed


def _forward_fn(model, ids, mode, device):
    def forward():
        with torch.no_grad(), mw.precision_ctx(mode, device):
            model(input_ids=ids, use_cache=False)

    return forward


def _time(forward, n: int, sync) -> dict:
    host, wall, inside = [], [], []
    for _ in range(n):
        sync()
        _inside[0], _inside[1] = 0.0, 0
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
        inside.append(_inside[0] * 1e3)
    return {
        "host_ms": statistics.median(host),
        "wall_ms": statistics.median(wall),
        "inside_layers_ms": statistics.median(inside),
        "layer_calls": _inside[1],
    }


def _layer_sizes(args, sync) -> dict:
    from torch import nn

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import dora_dispatch

    small_numel = dora_dispatch.SMALL_FORWARD_NUMEL
    out = {}
    for spec in args.sizes.split(","):
        tokens, d_in, d_out = (int(v) for v in spec.split(":"))
        x = torch.randn(tokens, d_in, device="cuda", dtype=torch.bfloat16)
        fns = {}
        for kind in ("lora", "dora"):
            torch.manual_seed(0)
            base = nn.Sequential(nn.Linear(d_in, d_out, bias=False)).cuda().to(torch.bfloat16)
            config = LoraConfig(r=16, target_modules=["0"], use_dora=kind == "dora", init_lora_weights=False)
            model = get_peft_model(base, config).to(torch.bfloat16).eval()
            fns[kind] = model
        rows = {}
        for _ in range(args.rounds):
            for name, kind, numel in (("lora", "lora", small_numel), ("dora_triton", "dora", 0),
                                      ("dora_small", "dora", 1 << 62)):  # fmt: skip
                dora_dispatch.SMALL_FORWARD_NUMEL = numel
                model = fns[kind]
                with torch.no_grad():
                    for _ in range(3):
                        model(x)
                    sync()
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    t0 = time.perf_counter()
                    start.record()
                    for _ in range(args.calls):
                        model(x)
                    end.record()
                    t1 = time.perf_counter()
                    end.synchronize()
                rows.setdefault(name, {"gpu_us": [], "host_us": []})
                rows[name]["gpu_us"].append(start.elapsed_time(end) * 1e3 / args.calls)
                rows[name]["host_us"].append((t1 - t0) * 1e6 / args.calls)
        dora_dispatch.SMALL_FORWARD_NUMEL = small_numel
        out[spec] = {k: {m: round(statistics.median(v), 2) for m, v in r.items()} for k, r in rows.items()}
        print(spec, out[spec], flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="")
    p.add_argument("--layers-only", action="store_true")
    p.add_argument("--sizes", default="512:2048:2048,4096:2048:2048,4096:2048:8192,8192:4096:14336")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    _wrap_layer_forward()
    from peft.tuners.lora import dora_dispatch

    small_numel = dora_dispatch.SMALL_FORWARD_NUMEL
    result = {"gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "points": {}}
    if args.layers_only:
        result["layers"] = _layer_sizes(args, sync)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return 0
    for label in [s.strip() for s in args.points.split(";") if s.strip()]:
        cfg, point = point_spec(label)
        if args.layers:
            cfg["config_kwargs"]["num_hidden_layers"] = args.layers
        mw.release()
        base = mw.build_base(cfg, device, torch.bfloat16)
        ids, _ = mw.make_inputs(cfg, device)
        modules = list(bm.GRID_TARGETS[point["targets"]])
        models = {}
        for kind in ("lora", "dora"):
            twin = copy.deepcopy(base)
            impl = {"name": kind, "dora": kind == "dora"}
            m = mw.wrap(twin, cfg, point["rank"], impl, point["mode"], modules, point["dropout"])
            mw.seed_adapters(m, 0, cfg["config_kwargs"]["initializer_range"])
            m.eval()
            models[kind] = _forward_fn(m, ids, point["mode"], device)
        for fn in models.values():
            for _ in range(3):
                fn()
        rows: dict = {}
        for _ in range(args.rounds):
            for kind, fn in models.items():
                for variant in ("default", "gc_off", "small") if kind == "dora" else ("default", "gc_off"):
                    if variant == "gc_off":
                        gc.collect()
                        gc.disable()
                    if variant == "small":
                        dora_dispatch.SMALL_FORWARD_NUMEL = 1 << 62
                    try:
                        rows.setdefault(f"{kind} {variant}", []).append(_time(fn, args.calls, sync))
                    finally:
                        gc.enable()
                        dora_dispatch.SMALL_FORWARD_NUMEL = small_numel
        out = {}
        for key, rs in rows.items():
            out[key] = {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
            out[key]["rounds_host_ms"] = [round(r["host_ms"], 3) for r in rs]
            out[key]["rounds_inside_layers_ms"] = [round(r["inside_layers_ms"], 3) for r in rs]
            print(label, key, out[key], flush=True)
        result["points"][label] = out
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
