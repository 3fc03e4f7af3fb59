"""Per-module cost of DoRA against plain LoRA: the seven projections of one Llama layer (hidden 4096, intermediate
14336, 32/8 heads) with an adapter of rank r on each, timed without the rest of the model.

For each implementation (each in its own subprocess, its wheel first on ``PYTHONPATH``) and precision mode it
measures a training call (forward + backward of all seven projections, ``tokens`` rows), an inference forward and a
1-token decode forward, each as

* ``wall_us``: median wall time per call over repeats of ``iters`` back-to-back calls (CUDA-synchronised at the end),
* ``gpu_us``: summed CUDA kernel time per call (torch.profiler),
* ``host_us``: CPU time per call spent issuing it (the profiler's range around each call),
* ``launches``: kernels per call.

``wall ≈ max(host, gpu)``: where ``host_us`` exceeds ``gpu_us`` the call is host-bound and launches decide its cost.

    python benchmarks/bench_layer.py --wheel ours=W1 --wheel upstream=W2 [--wheel before=W3] --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from timing import loop_us


HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

PROJ = {  # name: (in_features, out_features) of a Llama-3-8B-like layer
    "q_proj": (4096, 4096),
    "k_proj": (4096, 1024),
    "v_proj": (4096, 1024),
    "o_proj": (4096, 4096),
    "gate_proj": (4096, 14336),
    "up_proj": (4096, 14336),
    "down_proj": (14336, 4096),
}
# implementation -> (wheel key, use_dora, extra environment)
IMPLS = {
    "lora": ("upstream", False, {}),
    "upstream": ("upstream", True, {}),
    "ours_eager": ("ours", True, {"PEFT_DORA_FUSED": "0"}),
    "ours_fused": ("ours", True, {}),
    "ours_fused_reuse": ("ours", True, {"PEFT_DORA_NORM_CACHE": "1"}),
    "before_fused": ("before", True, {}),
}
MEASURES = ("train", "infer", "decode")


# ---------------------------------------------------------------------------------------------------------------
# Worker: one implementation, all modes and measures.
# ---------------------------------------------------------------------------------------------------------------


def _worker(spec: dict) -> dict:
    import torch
    from torch import nn

    import peft
    from peft import LoraConfig, get_peft_model

    device = torch.device("cuda")
    torch.manual_seed(0)
    out = {"peft_file": os.path.relpath(peft.__file__, spec["root"]) if spec.get("root") else None, "records": []}

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            for name, (d_in, d_out) in PROJ.items():
                setattr(self, name, nn.Linear(d_in, d_out, bias=False))

        def forward(self, x, x_down):
            return [getattr(self, n)(x_down if n == "down_proj" else x) for n in PROJ]

    for mode in spec["modes"]:
        base = Layer().to(device=device, dtype=torch.bfloat16)
        r = spec["rank"]
        config = LoraConfig(r=r, lora_alpha=r / 2, use_rslora=True, use_dora=spec["use_dora"],
                            target_modules=list(PROJ), init_lora_weights=True)  # fmt: skip
        model = get_peft_model(base, config)
        with torch.no_grad():  # a trained-looking adapter: B non-zero, so the norm's cross terms are live
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 1e-3)
        if mode == "bf16":
            model.to(torch.bfloat16)

        def ctx():
            return torch.autocast("cuda", dtype=torch.bfloat16, enabled=(mode == "autocast"))

        tokens = spec["tokens"]
        x = torch.randn(1, tokens, 4096, device=device, dtype=torch.bfloat16, requires_grad=True)
        xd = torch.randn(1, tokens, 14336, device=device, dtype=torch.bfloat16, requires_grad=True)
        grads = [torch.randn(1, tokens, d_out, device=device, dtype=torch.bfloat16) for _, d_out in PROJ.values()]
        x1 = torch.randn(1, 1, 4096, device=device, dtype=torch.bfloat16)
        xd1 = torch.randn(1, 1, 14336, device=device, dtype=torch.bfloat16)

        def train():
            with ctx():
                outs = model(x, xd)
            torch.autograd.backward(outs, grads)

        @torch.no_grad()
        def infer():
            with ctx():
                model(x, xd)

        @torch.no_grad()
        def decode():
            with ctx():
                model(x1, xd1)

        fns = {"train": train, "infer": infer, "decode": decode}
        for measure in spec["measures"]:
            model.train(measure == "train")
            fn = fns[measure]
            iters = spec["iters"] if measure != "decode" else spec["iters"] * 10
            rec = {"mode": mode, "measure": measure, "rank": r, "tokens": 1 if measure == "decode" else tokens}
            rec.update(_time(fn, iters, spec["repeats"], torch))
            rec.update(_profile(fn, torch))
            out["records"].append(rec)
            model.zero_grad(set_to_none=True)
            print(f"[{spec['impl']}] {mode} {measure}: wall {rec['wall_us']:.0f} us, gpu {rec['gpu_us']:.0f} us, "
                  f"host {rec['host_us']:.0f} us, {rec['launches']:.0f} launches", flush=True)  # fmt: skip
        model = base = fns = None  # free this mode's weights before the next
        torch.cuda.empty_cache()
    return out


def _time(fn, iters: int, repeats: int, torch) -> dict:
    t = loop_us(fn, torch.cuda.synchronize, warmup=3, loops=repeats, calls=iters)
    return {"wall_us": t["median"], "wall_us_min": t["min"], "wall_us_max": t["max"]}


def _profile(fn, torch, calls: int = 6) -> dict:
    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("bench_call"):
                fn()
            torch.cuda.synchronize()
    events = prof.events()
    host = [e.cpu_time_total for e in events if e.name == "bench_call" and e.device_type.name == "CPU"]
    kernels = [e for e in events if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
               and e.name != "bench_call"]  # fmt: skip
    return {
        "host_us": statistics.median(host),
        "gpu_us": sum(e.time_range.elapsed_us() for e in kernels) / calls,
        "launches": len(kernels) / calls,
    }


# ---------------------------------------------------------------------------------------------------------------
# Parent: install wheels, run one worker per implementation, write the JSON.
# ---------------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheel", action="append", default=[], help="KEY=PATH with KEY in ours, upstream, before")
    p.add_argument("--impls", default="lora,upstream,ours_eager,ours_fused,ours_fused_reuse,before_fused")
    p.add_argument("--modes", default="autocast,bf16")
    p.add_argument("--measures", default=",".join(MEASURES))
    p.add_argument("--rank", type=int, default=384)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        Path(spec["result"]).write_text(json.dumps(_worker(spec)))
        return 0

    from bench_model import environment, install  # the same wheel installs and environment record

    wheels = dict(w.split("=", 1) for w in args.wheel)
    impls = [i for i in args.impls.split(",") if IMPLS[i][0] in wheels]
    doc = {"kind": "layer", "config": {k: getattr(args, k) for k in ("rank", "tokens", "iters", "repeats")},
           "projections": PROJ, "records": {}, "errors": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench_layer_") as tmp:
        tmp = Path(tmp)
        targets = {k: install(Path(v), tmp / "installs") for k, v in wheels.items()}
        for impl in impls:
            key, use_dora, extra = IMPLS[impl]
            spec = {"impl": impl, "use_dora": use_dora, "modes": args.modes.split(","), "rank": args.rank,
                    "measures": args.measures.split(","), "tokens": args.tokens, "iters": args.iters,
                    "repeats": args.repeats, "result": str(tmp / f"{impl}.json"),
                    "root": str(targets[key])}  # fmt: skip
            spec_path = tmp / f"{impl}.spec.json"
            spec_path.write_text(json.dumps(spec))
            env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_DORA_")}
            env.update(extra)
            env["PYTHONPATH"] = os.pathsep.join([str(targets[key]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            proc = subprocess.run([sys.executable, __file__, "--out", "-", "--worker", str(spec_path)], env=env)
            if proc.returncode != 0:
                doc["errors"][impl] = f"worker exited with {proc.returncode}"
                continue
            doc["records"][impl] = json.loads((tmp / f"{impl}.json").read_text())
        doc["env"] = environment("cuda", {})
    doc["ratios_vs_lora"] = _ratios(doc)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    for impl, rows in doc["ratios_vs_lora"].items():
        print(impl, json.dumps(rows))
    return 0 if not doc["errors"] else 1


def _ratios(doc: dict) -> dict:
    """wall_us of each implementation over plain LoRA's, per (mode, measure)."""
    lora = {(r["mode"], r["measure"]): r["wall_us"] for r in doc["records"].get("lora", {}).get("records", [])}
    out = {}
    for impl, res in doc["records"].items():
        out[impl] = {f"{r['mode']}/{r['measure']}": round(r["wall_us"] / lora[(r["mode"], r["measure"])], 3)
                     for r in res["records"] if (r["mode"], r["measure"]) in lora}  # fmt: skip
    return out


if __name__ == "__main__":
    sys.exit(main())
