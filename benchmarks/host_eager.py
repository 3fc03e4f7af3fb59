"""Host time of an eager DoRA Linear against a LoRA Linear, per module: a CPU stand-in for the GPU's host cost.

The grid's small training steps and QDoRA at 1024 tokens are host-bound on the GPU machines (``profile_step.py``):
what DoRA adds there is Python and op dispatch per module, not GPU work. This measures that part on any CPU, so a
change to the per-forward path can be judged before a device run. A model of ``--modules`` chained
``Linear(--dim, --dim)`` (plain, or bitsandbytes NF4 with ``--base nf4``) gets LoRA or DoRA (``--rank``) on every
one; the tensors are small, so the time is the host's. ``--tiers fused`` runs the fused tiers' Python (gates, memos,
autograd nodes, launch arguments) with every Triton launch replaced by a no-op (``TRITON_INTERPRET=1``, so the
tiers are chosen as on a GPU; outputs are not computed); ``--tiers eager`` runs the PyTorch tiers. ``--measure
train`` times a training step (forward under non-reentrant checkpointing, reentrant with ``--reentrant``, none with
``--no-checkpointing``; backward,
AdamW), ``train-forward`` only that step's forward (under the same checkpointing; the graph it records is freed
unused), so that ``train`` less ``train-forward`` is the backward's and the optimizer's part, ``eval`` an eval forward
without autograd; ``--autocast`` keeps the adapters in fp32 beside a ``--dtype``
base and runs the step under bf16 autocast (the grid's autocast mode; the QLoRA recipe on NF4). LoRA and DoRA
alternate in one process, ``--rounds`` rounds of ``--calls`` calls; the record keeps each round and the medians in µs
per module, DoRA's extra over LoRA's, the ATen ops one call dispatches per module (a count that does not drift with
the host), and the tiers DoRA ran. ``--graphs`` sends training norms down the GPU's path (a norm graph per layer,
replayed as a no-op through the layer's record; without it the CPU computes each norm eagerly, a path no GPU
training step takes once its graphs are captured).

    python benchmarks/host_eager.py --measure train --tiers fused --out benchmarks/results/profile/host_eager.json

A CPU op costs less host time than a CUDA launch, so the absolute figures are lower than on a GPU machine's host;
the Python part of DoRA's extra is what carries over.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn


sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_compiled import Chain, alternate  # noqa: E402


def _base(args) -> nn.Module:
    torch.manual_seed(0)
    model = Chain(0)
    model.layers = nn.ModuleList(nn.Linear(args.dim, args.dim, bias=args.bias) for _ in range(args.modules))
    for layer in model.layers:
        layer.weight.data.normal_(std=args.dim**-0.5)
    if args.base == "plain":
        return model.to(args.dtype)
    import bitsandbytes as bnb

    quantized = []
    for layer in model.layers:
        q = bnb.nn.Linear4bit(args.dim, args.dim, bias=args.bias, compute_dtype=args.dtype, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(layer.weight.data.to(args.dtype), requires_grad=False, quant_type="nf4")
        if args.bias:
            q.bias = nn.Parameter(layer.bias.data.to(args.dtype), requires_grad=False)
        q.support_avx512bf16_for_cpu = False  # the GPU's layout and kernels' path, on any CPU (no CPU repacking)
        quantized.append(q.to("cpu"))  # quantizes on bitsandbytes' CPU backend
    model.layers = nn.ModuleList(quantized)
    model.is_loaded_in_4bit = True
    return model


def build(args, dora: bool) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=args.rank, target_modules=[f"layers.{i}" for i in range(args.modules)], use_dora=dora,
        lora_dropout=args.dropout,
        init_lora_weights=False,  # B != 0: the norm and gradients are those of a trained adapter
    )  # fmt: skip
    model = get_peft_model(_base(args), config)
    if args.base == "plain" and not (args.autocast or args.mixed):
        model = model.to(args.dtype)  # adapters in the model's dtype, as the grid's bf16 mode has them
    return model  # with --autocast or --mixed: fp32 adapters (PEFT's autocast_adapter_dtype) beside the base's dtype


def _stub_launches() -> None:
    """Every Triton launch a no-op: the fused tiers' host work without the interpreter's."""
    from peft.tuners.lora import dora_launch

    dora_launch.Launcher.launch = lambda self, grid, args, meta: None


class _NoOpGraph:
    """A captured CUDA graph whose replay does nothing: the host's part of a replay without the GPU's."""

    def replay(self) -> None:
        pass


def _emulate_cuda_autocast_query() -> None:
    """``--autocast``: ``torch.is_autocast_enabled()`` without a device answers for the CPU, as it answers for CUDA on
    a GPU. PEFT's bitsandbytes LoRA layers ask it that way (``requires_conversion``) and, on the CPU, would otherwise
    cast ``x`` to the adapters' fp32 and the output back in every forward, for QLoRA and QDoRA alike: a path no GPU
    step under CUDA autocast takes."""
    query = torch.is_autocast_enabled

    def is_autocast_enabled(device_type=None):
        return query("cpu" if device_type is None else device_type)

    torch.is_autocast_enabled = is_autocast_enabled


def _emulate_norm_graphs() -> None:
    """``--graphs``: training norms take the GPU's path on the CPU: a layer's norm graph is "captured" on its second
    call for the same tensors (``compute()`` once, its result kept as the graph's output buffer) and replayed as a
    no-op from then on, through the layer's record (``dora_norm.eager_record``) as on a GPU. The norms are not
    recomputed after an optimizer step, so outputs are not DoRA's: only the host work of the GPU's path is timed
    (without the driver's launch of the graph, the same in every build). Patches what every build since the record
    has (``dora_norm.norm_graph_applies``, ``dora_graph.NormGraph._capture``)."""
    from peft.tuners.lora import dora_graph, dora_norm, dora_settings

    def applies(weight, lora_A, lora_B) -> bool:
        env = dora_settings.current()
        return env.norm_graph is not False and env.fused is not False and not torch.compiler.is_compiling()

    def capture(self, device, compute):
        out = compute()
        self.graph, self.out = _NoOpGraph(), out
        dora_graph.graph_counts["captured"] += 1
        return out.clone()  # what a build that copies returns here; a build that hands out the buffer returns out

    dora_norm.norm_graph_applies = applies
    dora_graph.NormGraph._capture = capture


def _step_fn(args, model):
    fn = _bare_step_fn(args, model)
    if not args.autocast:
        return fn

    def under_autocast(x):  # the grid's autocast mode: a bf16 base, fp32 adapters, bf16 autocast
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fn(x)

    return under_autocast


def _bare_step_fn(args, model):
    if args.measure == "eval":
        model.eval()

        @torch.no_grad()
        def forward(x):
            model(x)

        return forward
    from torch.utils.checkpoint import checkpoint

    model.train()
    if args.measure == "train-forward":

        def forward_only(x):
            checkpoint(model, x, use_reentrant=args.reentrant) if args.checkpointing else model(x)

        return forward_only
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    dora = any(hasattr(m, "lora_magnitude_vector") and len(m.lora_magnitude_vector) for m in model.modules())
    optimizer_step = opt.step if dora else _without_dora_step_hook(opt.step)

    def step(x):
        y = checkpoint(model, x, use_reentrant=args.reentrant) if args.checkpointing else model(x)
        # a squared loss: its gradient is a contiguous tensor, as a next layer's matmul hands back (sum()'s is a
        # broadcast one, which sends DoRA's fused backward to its eager fallback)
        y.float().square().mean().backward()
        optimizer_step()
        opt.zero_grad(set_to_none=True)

    return step


def _null_step(model, dora: bool):
    """An optimizer step that changes no value (SGD, learning rate 0, zero gradients): it updates every trainable
    tensor in place, so each version counter moves as in a training step, and DoRA's optimizer-step hook runs after
    it (the magnitudes' zero test, the epoch) for the DoRA model only (see :func:`_without_dora_step_hook`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(params, lr=0.0, foreach=True)
    return opt.step if dora else _without_dora_step_hook(opt.step)


def _step_before_forward(args, model, dora: bool):
    """What runs, untimed, before each ``train-forward`` call: as between training steps, an optimizer step (the
    versions move, DoRA's step hook runs). Under non-reentrant checkpointing (or none) :func:`_null_step`. Under
    ``--reentrant`` a whole training step (forward, backward, AdamW) instead: there the forward runs without
    autograd, and what a DoRA layer answers it from (its training record) is made by the grad-enabled recompute in
    the backward, which forwards alone never run; timed after null steps, every such forward took the full path."""
    if not args.reentrant or not args.checkpointing:
        return _null_step(model, dora)
    step = _step_fn(argparse.Namespace(**{**vars(args), "measure": "train"}), model)
    x = torch.randn(args.tokens, args.dim, dtype=args.dtype, requires_grad=True)
    return lambda: step(x)


def _without_dora_step_hook(optimizer_step):
    """The LoRA model's optimizer step without DoRA's global optimizer-step hook (``dora_cache._after_optimizer_step``):
    in this one process it would test the DoRA model's magnitudes after LoRA's step too, work a LoRA-only process
    does not have, which made LoRA's count the larger and DoRA's extra the smaller."""
    from torch.optim.optimizer import _global_optimizer_post_hooks as hooks

    from peft.tuners.lora import dora_cache

    def step():
        ours = {k: h for k, h in hooks.items() if h is dora_cache._after_optimizer_step}
        for k in ours:
            del hooks[k]
        try:
            optimizer_step()
        finally:
            hooks.update(ours)

    return step


def _train_record_switched(fn, on: bool):
    """``fn`` with DoRA's training record (``DoraLinearLayer.recorded_training_output``) and the training nodes'
    direct C++ apply (``dora_fused.linear_node``) on, as shipped, or off (``--compare-train-record``'s ``dora_full``:
    every training forward takes the full path, through ``Function.apply``), switched before each call."""
    from peft.tuners.lora import dora, dora_fused

    record, node = dora.DoraLinearLayer.recorded_training_output, dora_fused.linear_node

    def switched(x):
        dora.DoraLinearLayer.recorded_training_output = record if on else (lambda self, *args, **kwargs: None)
        dora_fused.linear_node = node if on else dora_fused.FusedDoRALinearFunction.apply
        fn(x)

    return switched


def ops_per_module(fn, x, modules: int) -> float:
    """ATen ops one call of ``fn`` dispatches, per module (with its autograd backward and the optimizer): on a
    host-bound GPU step each is a launch or at least a dispatch, and unlike the CPU's timings the count does not
    drift."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn(x)
    return round(Count.n / modules, 2)


def _norm_once() -> None:
    """``--probe norm-once``: every DoRA layer keeps the first norm it computed and returns it from then on, whatever A
    and B have become. Wrong on purpose: what the norm's per-forward host work costs, as an upper bound on what
    computing it less often could save."""
    from peft.tuners.lora.dora import DoraLinearLayer

    DoraLinearLayer._forward_norm = first_norm_kept(DoraLinearLayer._forward_norm)


def first_norm_kept(fresh):
    """``_forward_norm`` that keeps each layer's first norm (``fresh``'s) and returns it from then on, in the layer's
    ``_probe_norm`` (deleting it starts over)."""

    def kept(self, *args, **kwargs):
        norm = self.__dict__.get("_probe_norm")
        if norm is None:
            norm = self.__dict__["_probe_norm"] = fresh(self, *args, **kwargs)
        return norm

    return kept


def run(args) -> dict:
    from peft.tuners.lora import dora_cache, dora_dispatch, dora_graph

    if args.tiers == "fused":
        _stub_launches()
    if args.graphs:
        _emulate_norm_graphs()
    if args.autocast:
        _emulate_cuda_autocast_query()
    if args.probe == "norm-once":
        _norm_once()
    torch.set_num_threads(1)
    kinds = ("lora", "dora", "dora_full") if args.compare_train_record else ("lora", "dora")
    models = {kind: build(args, kind != "lora") for kind in kinds}
    fns = {kind: _step_fn(args, model) for kind, model in models.items()}
    if args.compare_train_record:
        fns = {kind: _train_record_switched(fn, kind != "dora_full") for kind, fn in fns.items()}
    # a forward alone follows no optimizer step: one that changes nothing runs between calls, untimed, so that the
    # versions move and DoRA's step hook runs (the magnitudes' zero test, the epoch) as between training steps
    before = None
    if args.measure == "train-forward":
        before = {kind: _step_before_forward(args, model, kind != "lora") for kind, model in models.items()}
    x = torch.randn(args.tokens, args.dim, dtype=args.dtype, requires_grad=args.measure != "eval")
    for fn in fns.values():  # warm-up: first calls, norm graphs and memos, optimizer state
        for _ in range(3):
            fn(x)
    dora_dispatch.tier_counts.clear()
    dora_graph.graph_counts.clear()
    epoch = dora_cache._epoch[0]
    rounds, med = alternate(fns, x, args.calls, args.modules, args.rounds, before)
    steps_seen = dora_cache._epoch[0] - epoch
    replays = dora_graph.graph_counts["replayed"]
    ops = {kind: ops_per_module(fn, x, args.modules) for kind, fn in fns.items()}
    extra = {}
    if args.compare_train_record:
        extra = {"dora_full_extra_us_per_module": round(med["dora_full"] - med["lora"], 2)}
    return {
        **extra,
        "aten_ops_per_module": ops,
        "rounds_us_per_module": rounds,
        "median_us_per_module": {k: round(v, 2) for k, v in med.items()},
        "dora_extra_us_per_module": round(med["dora"] - med["lora"], 2),
        "dora_over_lora": round(med["dora"] / med["lora"], 4),
        "tiers": dict(dora_dispatch.tier_counts),
        "norm_graph_replays": replays,  # with --graphs: one per DoRA module and step (through its record)
        # optimizer steps DoRA's step hook saw in the timed rounds: the DoRA model's (its training steps, or with
        # train-forward the null steps between its forwards), none of LoRA's
        "dora_optimizer_steps_seen": steps_seen,
    }


def _env() -> dict:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
        rev = rev.stdout.strip() or None
    except OSError:
        rev = None
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": platform.processor(), "rev": rev}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--measure", choices=("train", "train-forward", "eval"), default="train")
    p.add_argument("--tiers", choices=("fused", "eager"), default="fused")
    p.add_argument("--base", choices=("plain", "nf4"), default="plain")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="fp32 keeps the CPU's own matmul time small (bf16 matmuls are slow on many CPUs)")  # fmt: skip
    p.add_argument("--modules", type=int, default=28)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--bias", action="store_true")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument(
        "--autocast", action="store_true", help="fp32 adapters, the step under bf16 autocast (--dtype: the base's)"
    )
    precision.add_argument(
        "--mixed", action="store_true", help="fp32 adapters beside the --dtype base, no autocast (PEFT's default)"
    )
    p.add_argument("--dropout", type=float, default=0.0, help="lora_dropout (LoRA's and DoRA's)")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument(
        "--reentrant",
        action="store_true",
        help="reentrant checkpointing (prepare_model_for_kbit_training's default, the QLoRA recipe's): the forward "
        "runs without autograd, the backward recomputes it with autograd",
    )
    p.add_argument(
        "--graphs",
        action="store_true",
        help="training norms take the GPU's path: norm graphs captured and replayed as no-ops, through the layer's "
        "record (outputs are not DoRA's; see _emulate_norm_graphs)",
    )
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument(
        "--probe",
        choices=("none", "norm-once"),
        default="none",
        help="norm-once: each layer's first norm is reused forever (wrong: a cost probe, see _norm_once)",
    )
    p.add_argument(
        "--compare-train-record",
        action="store_true",
        help="also a third model, DoRA with its training record and direct node apply switched off (dora_full), "
        "alternated with the other two in the same process",
    )
    p.add_argument("--label", help="what is measured, kept in the record (e.g. which build of peft is imported)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.tiers == "fused":
        if "peft" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--tiers fused needs TRITON_INTERPRET=1 before peft is imported (run as a script)")
        os.environ["TRITON_INTERPRET"] = "1"  # read by peft's dora_launch at import: tiers chosen as on a GPU
        try:
            import triton  # noqa: F401
        except ImportError:
            raise SystemExit("--tiers fused needs Triton (pip install triton); --tiers eager runs without") from None
    else:
        os.environ.setdefault("PEFT_DORA_FUSED", "0")
    args.dtype = getattr(torch, args.dtype)
    result = run(args)
    config = {k: (str(v).replace("torch.", "") if k == "dtype" else v) for k, v in vars(args).items() if k != "out"}
    doc = {"kind": "host_eager", "config": config, "env": _env(), **result}
    print(
        f"{args.measure} {args.tiers} {args.base}: LoRA {result['median_us_per_module']['lora']} µs/module, DoRA "
        f"{result['median_us_per_module']['dora']} (+{result['dora_extra_us_per_module']}); aten ops per module "
        f"{result['aten_ops_per_module']}; tiers {result['tiers']}"
        + (
            f"; without the training record +{result['dora_full_extra_us_per_module']}"
            if args.compare_train_record
            else ""
        )
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
