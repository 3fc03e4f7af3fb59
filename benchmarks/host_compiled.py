"""Host time of a compiled DoRA Linear against a compiled LoRA Linear, per module and eval forward (or training step).

A model of ``--modules`` chained ``nn.Linear(64, 64)`` with LoRA or DoRA (r = 8) on every one, ``torch.compile``d
(``default``), called in eval mode without autograd on 16 tokens: the tensors are so small that the time is the
host's, which is what a compiled DoRA forward adds per module at small shapes (the norm op's call, its memo lookup,
``g``'s kernels). LoRA and DoRA are timed in alternating rounds in one process; each round is the mean over
``--calls`` calls, the record keeps every round and the medians, in µs per module. ``--measure train`` times a
training step instead (forward, backward of the sum, gradients set to None); there a CPU computes every training
norm for real, where a GPU replays a norm graph, so that measure does not stand in for the GPU's host time.

    python benchmarks/host_compiled.py --out benchmarks/results/profile/host_compiled_eval.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch import nn


class Chain(nn.Module):
    """Linears called in a loop over a ModuleList, as a transformer calls its layers."""

    def __init__(self, modules: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(modules))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build(dora: bool, modules: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=8, target_modules=[f"layers.{i}" for i in range(modules)], use_dora=dora)
    return get_peft_model(Chain(modules), config).eval()


def per_module_us(fn, x, calls: int, modules: int, before=None) -> float:
    """Mean µs per module of ``calls`` calls of ``fn(x)``; ``before()`` runs untimed ahead of each call."""
    if before is None:
        start = time.perf_counter()
        for _ in range(calls):
            fn(x)
        return (time.perf_counter() - start) / calls / modules * 1e6
    total = 0.0
    for _ in range(calls):
        before()
        start = time.perf_counter()
        fn(x)
        total += time.perf_counter() - start
    return total / calls / modules * 1e6


def alternate(fns: dict, x, calls: int, modules: int, rounds: int, before=None) -> tuple[dict, dict]:
    """``rounds`` rounds of every function in ``fns``, in alternating order (ABBA...), each the mean µs per module
    over ``calls`` calls (each after ``before[name]()``, untimed, where given): the rounds and their medians."""
    out: dict = {name: [] for name in fns}
    for k in range(rounds):
        for name in fns if k % 2 == 0 else reversed(list(fns)):
            pre = before[name] if before else None
            out[name].append(round(per_module_us(fns[name], x, calls, modules, pre), 2))
    return out, {name: statistics.median(values) for name, values in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modules", type=int, default=64)
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: no intra-op threads to wait on)")
    p.add_argument(
        "--pairing",
        choices=("models", "adapters"),
        default="models",
        help="models: a LoRA and a DoRA model, each compiled; adapters: one compiled model holding both adapters",
    )
    p.add_argument(
        "--measure",
        choices=("eval", "train"),
        default="eval",
        help="eval: forward without autograd; train: forward, backward of the sum and the gradients set to None",
    )
    p.add_argument("--label", help="which build of peft is imported (kept in the record; git_rev is this checkout's)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    import peft

    torch.set_num_threads(args.threads)
    x = torch.randn(16, 64)
    train = args.measure == "train"
    before = None
    if args.pairing == "models":
        models = {name: build(dora, args.modules).train(train) for name, dora in (("lora", False), ("dora", True))}
        compiled = {name: torch.compile(model) for name, model in models.items()}
    else:  # one model with the DoRA adapter and a LoRA twin adapter, switched by set_adapter (untimed) before every
        # call of either, as the paired measures alternate them
        from peft import LoraConfig

        model = build(True, args.modules)
        twin = LoraConfig(r=8, target_modules=[f"layers.{i}" for i in range(args.modules)], use_dora=False)
        model.add_adapter("twin", twin)
        model.eval()
        one = torch.compile(model)
        compiled = {"lora": one, "dora": one}
        before = {"lora": lambda: model.set_adapter("twin"), "dora": lambda: model.set_adapter("default")}
    if train:
        if args.pairing != "models":
            p.error("--measure train times --pairing models")

        def step(compiled_model, model):
            def run(x):
                compiled_model(x).sum().backward()
                model.zero_grad(set_to_none=True)

            return run

        compiled = {name: step(compiled[name], models[name]) for name in compiled}
    with torch.enable_grad() if train else torch.no_grad():
        for name, fn in compiled.items():
            for _ in range(5):  # compile and warm up
                if before:
                    before[name]()
                fn(x)
        rounds, medians = alternate(compiled, x, args.calls, args.modules, args.rounds, before)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {
        "what": (
            "compiled training step (forward, backward of the sum, gradients set to None)"
            if train
            else "compiled eval forward, no autograd"
        )
        + ", host time per adapted Linear (us), 16x64 input",
        "measure": args.measure,
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "peft": peft.__version__,
        "git_rev": rev,
        "label": args.label,
        # how peft::dora_weight_norm is defined in the installed peft (torch.library.custom_op before 2026-11-26)
        "norm_op_api": "custom_op" if "peft::dora_weight_norm" in torch._library.custom_ops.OPDEFS else "Library",
        "modules": args.modules,
        "threads": args.threads,
        "pairing": args.pairing,
        "calls_per_round": args.calls,
        "rounds_us_per_module": rounds,
        "median_us_per_module": medians,
        "dora_extra_us_per_module": round(medians["dora"] - medians["lora"], 2),
    }
    print(json.dumps(doc["median_us_per_module"]), "extra", doc["dora_extra_us_per_module"])
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
