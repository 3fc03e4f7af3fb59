"""How much host time DoRA's one-node training branch costs over what its math needs, on a GPU machine's host.

The grid's small training steps are host-bound (``probe_host.py``): DoRA/LoRA there is a ratio of host times. This
probe asks whether a leaner composition could close the gap: it times the host's issue time of a forward and
backward (no optimizer, no checkpointing, ``perf_counter`` without a sync, the queue drained between steps) of
``--modules`` chained ``Linear(--dim, --dim)`` with tiny token counts, so that the GPU waits on the host, for

* ``peft_lora``, ``peft_dora``: PEFT's LoRA and ours (DoRA), the model as users build it;
* ``torch_lora``: the same LoRA math written as plain PyTorch modules (``base + s·B·A·x``): PEFT's own per-call
  overhead taken out;
* ``torch_dora``: DoRA's output formula in the same plain modules, as ATen ops whose autograd runs in C++
  (``y = base + ((g − 1)·base + g·(s·lora))``, ``g = m / n`` with ``n`` a kept tensor standing for the norm, so
  no norm work): what DoRA's output and backward cost the host at least, without a Python autograd node.

``peft_dora − peft_lora`` is ours' extra per module; ``torch_dora − torch_lora`` the formula's own. The record
keeps every round's medians (µs per module) and the kinds alternate within each round. ``--modes``: ``bf16`` (base
and adapters), ``autocast`` (fp32 adapters beside the bf16 base, bf16 autocast) and ``mixed`` (the same without
autocast: PEFT's default adapters in a training loop of its own).

    PYTHONPATH=<ours> python benchmarks/probe_lean.py --out $OUT/probe_lean.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class _TorchAdapter(nn.Module):
    """A frozen Linear with a LoRA (or DoRA output formula) written as plain PyTorch ops."""

    def __init__(self, dim: int, rank: int, dora: bool, dtype, adapter_dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim, dtype=dtype) / dim**0.5, requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim, dtype=adapter_dtype) / dim**0.5)
        self.lora_b = nn.Parameter(torch.randn(dim, rank, dtype=adapter_dtype) / rank)
        self.scale, self.dora = 2.0, dora
        if dora:
            self.magnitude = nn.Parameter(torch.rand(dim, dtype=adapter_dtype) + 0.5)
            self.register_buffer("norm", torch.rand(dim, dtype=adapter_dtype) + 1.0)

    def forward(self, x):
        """As PEFT's LoRA layer: x cast to the adapters' dtype outside autocast, the sum cast to the base's dtype."""
        result = F.linear(x, self.weight)
        x_a = x if torch.is_autocast_enabled("cuda") else x.to(self.lora_a.dtype)
        lora = F.linear(F.linear(x_a, self.lora_a), self.lora_b)
        if not self.dora:
            return (result + lora * self.scale).to(result.dtype)
        g = self.magnitude / self.norm
        return (result + ((g - 1) * result + g * (lora * self.scale))).to(result.dtype)


def _peft_model(args, dora: bool, dtype, adapter_dtype):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    body = nn.Sequential(*[nn.Linear(args.dim, args.dim, bias=False) for _ in range(args.modules)])
    body = body.to(device="cuda", dtype=dtype)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", use_dora=dora)
    model = get_peft_model(body, config)  # fp32 adapters beside the half base (PEFT's autocast_adapter_dtype)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.to(adapter_dtype)
    model.train()
    return model


def _torch_model(args, dora: bool, dtype, adapter_dtype):
    torch.manual_seed(0)
    mods = [_TorchAdapter(args.dim, args.rank, dora, dtype, adapter_dtype) for _ in range(args.modules)]
    return nn.Sequential(*mods).to("cuda").train()


def _host_us(model, x, autocast: bool, steps: int, modules: int) -> float:
    """Median host issue time of forward + backward, µs per module."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        out.float().sum().backward()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) / modules * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", type=int, default=32)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--modes",
        default="bf16,autocast,mixed",
        help="bf16: all bf16; autocast: fp32 adapters, bf16 base, bf16 autocast; mixed: the same without autocast",
    )
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import peft
    from peft.tuners.lora.dora_dispatch import tier_counts  # ours: the tiers each mode's DoRA forwards took

    result = {"env": {"peft": peft.__version__, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}}
    result["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    for mode in args.modes.split(","):
        tier_counts.clear()
        autocast = mode == "autocast"
        dtype, adapter_dtype = torch.bfloat16, (torch.float32 if mode in ("autocast", "mixed") else torch.bfloat16)
        models = {
            "peft_lora": _peft_model(args, False, dtype, adapter_dtype),
            "peft_dora": _peft_model(args, True, dtype, adapter_dtype),
            "torch_lora": _torch_model(args, False, dtype, adapter_dtype),
            "torch_dora": _torch_model(args, True, dtype, adapter_dtype),
        }
        x = torch.randn(args.tokens, args.dim, device="cuda", dtype=dtype, requires_grad=True)
        for model in models.values():  # warm-up: records, norm graphs, cuBLAS handles
            _host_us(model, x, autocast, 10, args.modules)
        rounds = {k: [] for k in models}
        for _ in range(args.rounds):
            for name, model in models.items():
                rounds[name].append(round(_host_us(model, x, autocast, args.steps, args.modules), 2))
        med = {k: statistics.median(v) for k, v in rounds.items()}
        result[mode] = {
            "rounds_us_per_module": rounds,
            "median_us_per_module": med,
            "peft_dora_extra_us": round(med["peft_dora"] - med["peft_lora"], 2),
            "torch_dora_extra_us": round(med["torch_dora"] - med["torch_lora"], 2),
            "tiers": dict(tier_counts),
        }
        print(mode, json.dumps(result[mode]["median_us_per_module"]), "extra peft/torch",
              result[mode]["peft_dora_extra_us"], result[mode]["torch_dora_extra_us"], flush=True)  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
