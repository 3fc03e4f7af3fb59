"""Host time one DoRA Linear adds over a LoRA Linear, per call, in the ways a training step calls it.

A step at a few thousand tokens on a 1-3B-class model is host-bound (``profile_step.py``: the GPU is busy for a
third of it), so what a DoRA module costs on the host is what it costs. Host time on the GPU machines drifts by up
to 2x within minutes, so the two layers are timed in pairs: each iteration runs the LoRA layer's call, then the
DoRA layer's (the same base weight, input and A, B), and the record keeps the median of the per-pair differences.
``perf_counter`` around the call without a sync is the host's issue time; the queue is drained every 16 pairs.

Calls: the forward alone (grad on: the training node; grad off: the no-grad first pass of a reentrant
checkpoint), forward + backward, the same under a non-reentrant checkpoint (forward, recompute, backward: what
``gradient_checkpointing_enable`` runs per layer and step), and that plus an optimizer step (AdamW, foreach).
Parts of the DoRA forward are timed alone as well: the norm, the training node, ``F.linear(x, A)``.

    PYTHONPATH=<ours> python benchmarks/profile_module.py --shapes 1536x1536x4096x32,4096x4096x512x8 \\
        --out $OUT/profile_module.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn


def layers(d_in: int, d_out: int, rank: int, dtype: torch.dtype, device: str):
    """(LoRA layer, DoRA layer) on one base Linear each with the same weights, in training mode."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Linear(d_in, d_out, bias=False, device=device, dtype=dtype)
    out = []
    for dora in (False, True):
        net = nn.Sequential(nn.Linear(d_in, d_out, bias=False, device=device, dtype=dtype))
        net[0].weight.data.copy_(base.weight)
        config = LoraConfig(r=rank, target_modules=["0"], use_dora=dora, init_lora_weights=False)
        model = get_peft_model(net, config).to(dtype)
        layer = model.base_model.model[0]
        torch.manual_seed(1)
        for p in (layer.lora_A["default"].weight, layer.lora_B["default"].weight):
            p.data.normal_(0, 0.02)
        out.append(layer.train())
    return out


def paired(calls: dict, pairs: int, sync) -> dict:
    """Median host µs of each call and of the per-pair difference DoRA − LoRA."""
    times: dict = {k: [] for k in calls}
    for i in range(pairs):
        for name, fn in calls.items():
            t0 = time.perf_counter_ns()
            fn()
            times[name].append((time.perf_counter_ns() - t0) / 1e3)
        if i % 16 == 15:
            sync()
    sync()
    out = {k: round(statistics.median(v), 1) for k, v in times.items()}
    if set(calls) == {"lora", "dora"}:
        out["dora_minus_lora"] = round(statistics.median(d - lo for d, lo in zip(times["dora"], times["lora"])), 1)
    return out


def profile_shape(d_in, d_out, tokens, rank, dtype, device, pairs) -> dict:
    lora, dora = layers(d_in, d_out, rank, dtype, device)
    x = torch.randn(1, tokens, d_in, device=device, dtype=dtype, requires_grad=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    opts = {
        id(m): torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-6, foreach=True)
        for m in (lora, dora)
    }
    grad_out = torch.ones(1, tokens, d_out, device=device, dtype=dtype)

    def fwd(m):
        return lambda: m(x)

    def fwd_nograd(m):
        def run():
            with torch.no_grad():
                m(x)

        return run

    def fwd_bwd(m):
        return lambda: m(x).backward(grad_out)

    def ckpt(m):
        return lambda: checkpoint.checkpoint(m, x, use_reentrant=False).backward(grad_out)

    def ckpt_step(m):
        opt = opts[id(m)]

        def run():
            checkpoint.checkpoint(m, x, use_reentrant=False).backward(grad_out)
            opt.step()
            opt.zero_grad(set_to_none=True)

        return run

    for make in (fwd_bwd, ckpt_step):  # warm-up: kernels compiled, norm graphs captured, caches set
        for m in (lora, dora):
            for _ in range(4):
                make(m)()
    sync()
    res = {"d_in": d_in, "d_out": d_out, "tokens": tokens, "rank": rank, "dtype": str(dtype), "calls": {}}
    for name, make in (("forward", fwd), ("forward_no_grad", fwd_nograd), ("forward_backward", fwd_bwd),
                       ("checkpointed_forward_backward", ckpt), ("checkpointed_step", ckpt_step)):  # fmt: skip
        res["calls"][name] = paired({"lora": make(lora), "dora": make(dora)}, pairs, sync)

    # parts of the DoRA training forward, alone
    dl = dora.lora_magnitude_vector["default"]
    a_w, b_w, w = dora.lora_A["default"].weight, dora.lora_B["default"].weight, dora.base_layer.weight
    s = dora.scaling["default"]
    from peft.tuners.lora import dora as dora_mod
    from peft.tuners.lora import dora_dispatch, dora_fused

    result, a = F.linear(x, w), F.linear(x, a_w)
    norm = dl._forward_norm(w, a_w, b_w, s, "default")
    mag = dl.weight
    stride = dora_dispatch.branch_node_stride(a, result, b_w, mag, None)
    eps = dora_mod.eps_for(w.dtype)
    parts = {
        "F.linear(x, A)": lambda: F.linear(x, a_w),
        "norm (training forward)": lambda: dl._forward_norm(w, a_w, b_w, s, "default"),
        "LinearGates": lambda: dora_dispatch.LinearGates(result, mag, (x, a_w, b_w), True, True),
        "output node (B matmul + kernel)": lambda: dora_fused.FusedDoRALinearFunction.apply(
            result, a, b_w, mag, None, (norm, None, float(s), eps, stride, dl._reuse.zero_free)
        ),
        "LoRA's tail (B matmul, scale, add)": lambda: result + F.linear(a, b_w) * s,
        "adapted_output": lambda: dl.adapted_output(
            x,
            result,
            lora_A=dora.lora_A["default"],
            lora_B=dora.lora_B["default"],
            scaling=s,
            base_layer=dora.base_layer,
        ),  # fmt: skip
    }
    res["dora_forward_parts"] = paired(parts, pairs, sync) if stride is not None and device == "cuda" else {}
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="1536x1536x4096x32,4096x4096x512x8", help="d_in x d_out x tokens x rank, ...")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import peft

    dtype = getattr(torch, args.dtype)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    result = {"env": {"peft": Path(peft.__file__).parent.parent.name, "torch": torch.__version__, "gpu": gpu},
              "pairs": args.pairs, "shapes": []}  # fmt: skip
    for spec in args.shapes.split(","):
        d_in, d_out, tokens, rank = (int(v) for v in spec.split("x"))
        res = profile_shape(d_in, d_out, tokens, rank, dtype, args.device, args.pairs)
        result["shapes"].append(res)
        print(json.dumps(res), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
