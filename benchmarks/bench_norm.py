"""The DoRA weight norm ``||W + s·B·A||`` alone, per path, on one CUDA GPU: which path the auto rule should take where.

Paths (``peft/tuners/lora/dora_norm.py``):

* ``kernel``: the one-pass Triton kernel (``dora_norm_triton.row_norm_checked``; ``PEFT_DORA_NORM_KERNEL=1`` takes
  it wherever it runs): ``‖W‖²``, ``W·Aᵀ`` (an fp32 ``A`` as hi and lo half parts) and the Gram in one read of W.
  The auto rule gives it half adapters of W's dtype up to ``dora_norm._KERNEL_MAX_RANK`` and fp32 adapters up to
  ``_KERNEL_MAX_RANK_MIXED``.
* ``split`` / ``split_kept``: cuBLAS GEMMs against a split ``A`` (``dora_norm_triton.split_row_norm``; auto above the
  kernel's ranks), with ``‖W‖²`` computed in a pass of its own or given, as a
  frozen W's kept value is in training (``split_kept``).
* ``torch``: the PyTorch form (``PEFT_DORA_NORM_KERNEL=0``).

Each path is captured once as a CUDA graph and replayed: the GPU time a training forward's norm graph (``dora_graph``)
or a ``reduce-overhead`` compiled step spends on it, without the host. Per Llama-3.1-8B projection shape, rank and
adapter dtype (W bf16), the record keeps µs per call (median of ``--rounds`` runs of ``--reps`` replays, CUDA events)
and the largest relative error against the fp64 norm of the same tensors, and sums a decoder layer's seven
projections per path; the summary names the fastest path per rank and adapter dtype.

    PYTHONPATH=<ours> python benchmarks/bench_norm.py --out $OUT/bench_norm.json

``--tiny`` runs small shapes under ``TRITON_INTERPRET=1`` on the CPU (no graphs, wall time): a smoke run of the
paths and the record, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from pathlib import Path

import torch
from timing import loop_us


# Llama-3.1-8B: (name, d_out, d_in) of a decoder layer's seven projections
LAYER = (("q", 4096, 4096), ("k", 1024, 4096), ("v", 1024, 4096), ("o", 4096, 4096),
         ("gate", 14336, 4096), ("up", 14336, 4096), ("down", 4096, 14336))  # fmt: skip
TINY_LAYER = (("q", 96, 64), ("k", 32, 64), ("down", 64, 160))
PATHS = ("kernel", "split", "split_kept", "torch")
ADAPTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tensors(d_out: int, d_in: int, r: int, adapter: torch.dtype, device, seed: int = 0) -> tuple:
    """W (bf16, N(0, 1/d_in)), A and B (``adapter``), with ``‖s·B·A‖`` about a tenth of ``‖W‖`` per row at s = 1."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (torch.randn(d_out, d_in, generator=g) / d_in**0.5).to(device, torch.bfloat16)
    a = (torch.randn(r, d_in, generator=g) / d_in**0.5).to(device, adapter)
    b = (torch.randn(d_out, r, generator=g) * (0.1 / r**0.5)).to(device, adapter)
    return w, a, b


def path_fn(path: str, w, a, b, scale: float):
    """A call of ``path`` on these tensors (None where the path cannot take them)."""
    from peft.tuners.lora import dora_norm, dora_settings
    from peft.tuners.lora import dora_norm_triton as nt

    if path == "kernel":
        return (lambda: nt.row_norm_checked(w, a, b, scale)) if nt.row_norm_supported(w, a, b) else None
    if path in ("split", "split_kept"):
        if not nt.split_norm_supported(w, a, b):
            return None
        cols = dora_norm._chunk_columns(
            w.shape[0], a.shape[0], w.shape[1], dora_settings.get_dora_norm_threshold_bytes()
        )
        kept = dora_norm.row_sq_norm(w) if path == "split_kept" else None
        return lambda: nt.split_row_norm(w, a, b, scale, kept if kept is not None else dora_norm.row_sq_norm(w), cols)

    def torch_form():
        with dora_settings.override(norm_kernel=False):
            return dora_norm.factored_row_norm(w, a, b, scale)

    return torch_form


def reference(w, a, b, scale: float) -> torch.Tensor:
    """The fp64 norm of the dense ``W + s·B·A``."""
    return torch.linalg.vector_norm(w.double() + scale * (b.double() @ a.double()), dim=1)


def gpu_us(fn, reps: int, rounds: int) -> float:
    """Median over ``rounds`` of the µs per replay of ``fn`` captured as a CUDA graph, ``reps`` replays each."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    del graph
    return statistics.median(samples)


def measure(args) -> dict:
    device = torch.device("cpu" if args.tiny else "cuda")
    layer = TINY_LAYER if args.tiny else LAYER
    ranks = [int(r) for r in args.ranks.split(",")]
    rows, layers = [], []
    for adapter_name in args.adapters.split(","):
        adapter = ADAPTER_DTYPES[adapter_name]
        for r in ranks:
            total = {p: 0.0 for p in PATHS}
            for name, d_out, d_in in layer:
                w, a, b = tensors(d_out, d_in, r, adapter, device)
                ref = reference(w, a, b, args.scale)
                for path in PATHS:
                    fn = path_fn(path, w, a, b, args.scale)
                    row = {"adapter": adapter_name, "rank": r, "proj": name, "d_out": d_out, "d_in": d_in, "path": path}
                    if fn is None:
                        rows.append(dict(row, supported=False))
                        total[path] = float("nan")
                        continue
                    err = ((fn().double() - ref).abs() / ref.clamp_min(1e-30)).max().item()
                    us = (
                        loop_us(fn, lambda: None, 1, 1, args.reps)["median"]
                        if args.tiny
                        else gpu_us(fn, args.reps, args.rounds)
                    )
                    rows.append(dict(row, supported=True, us=round(us, 2), max_rel_err=float(f"{err:.3g}")))
                    total[path] += us
                    print(f"{adapter_name} r={r:<4} {name:<5} {path:<10} {us:9.2f} µs  err {err:.2e}", flush=True)
            done = {p: v for p, v in total.items() if v == v}
            layers.append({"adapter": adapter_name, "rank": r, "layer_us": {p: round(v, 2) for p, v in done.items()},
                           "fastest": min(done, key=done.get) if done else None})  # fmt: skip
    return {"rows": rows, "layers": layers}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="8,16,32,64,128,256")
    p.add_argument("--adapters", default="fp32,bf16", help="adapter dtypes: fp32 (autocast's), bf16")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--reps", type=int, default=50, help="graph replays per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run under TRITON_INTERPRET=1 (set before starting)")
    p.add_argument("--out", help="the JSON")
    args = p.parse_args(argv)
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--tiny runs the Triton paths in the interpreter: start it with TRITON_INTERPRET=1")
    if not args.tiny and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --tiny on the CPU)")
    import peft

    result = measure(args)
    doc = {
        "schema": "bench_norm/1",
        "kind": "cpu_smoke" if args.tiny else "gpu",
        "env": {
            "gpu": None if args.tiny else torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "peft": peft.__version__,
        },  # fmt: skip
        "config": {
            "ranks": args.ranks,
            "adapters": args.adapters,
            "scale": args.scale,
            "reps": args.reps,
            "rounds": args.rounds,
            "weight_dtype": "bf16",
        },  # fmt: skip
        **result,
    }
    for row in result["layers"]:
        print(f"layer {row['adapter']} r={row['rank']}: {row['layer_us']} -> {row['fastest']}")
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
