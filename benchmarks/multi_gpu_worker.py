"""One implementation's share of the multi-GPU training benchmark, one process per GPU, started by ``torchrun`` from
``bench_multi_gpu.py``.

Started as ``torchrun --standalone --nproc_per_node N multi_gpu_worker.py SPEC.json``. For each rank in the spec every
process builds the same seeded random Llama (``model_worker.build_base``), wraps it with LoRA or DoRA on all linear
projections, seeds the adapters (``model_worker.seed_adapters``), shards it with the spec's engine, and trains
``warmup + steps`` steps on its rows of a seeded global batch, timed by ``model_worker.measure``. This module owns
the engines (the sharding), the distributed gradient proof and the per-step collectives (loss mean, step time max,
peak memory per rank); rank 0 writes the result file after every rank, and a failing process writes
``RESULT.rankN.err``. Two references of ours run through the same worker (the spec's ``task``): ``single`` trains
in one process on the whole global batch with no engine, so its losses are the ones the engine's run must match;
``norm_check`` shards an all-fp32 model with FSDP2 and compares each DoRA Linear's sharded norm with the whole one
(:func:`check_norms`).

Nothing here imports from the repository root: the script directory is ``sys.path[0]``, so the overlay tree there
cannot shadow the installed package the parent put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import traceback
import types
from pathlib import Path
from typing import Optional

import model_worker as mw
import torch
import torch.distributed as dist


def shard_fsdp2(model, spec: dict, mesh) -> None:
    """Raw FSDP2: ``fully_shard`` on every decoder layer, then on the root (in place). ``mp`` keeps fp32 parameters and
    computes in bf16 with fp32 gradient reduction (gloo runs both precisions too, for the CPU smoke)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": mesh, "reshard_after_forward": bool(spec["reshard"])}
    if spec["precision"] == "mp":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def shard_fsdp1(model, spec: dict, mesh):
    """FSDP1: ``FullyShardedDataParallel`` on every decoder layer (and the root), ``use_orig_params`` (PEFT's frozen
    base weights beside trainable adapters), FULL_SHARD or with ``--reshard 0`` SHARD_GRAD_OP; ``mp`` as for FSDP2.
    Returns the wrapper, which the caller trains."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    mp = None
    if spec["precision"] == "mp":
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
    device = next(model.parameters()).device
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}),
        sharding_strategy=ShardingStrategy.FULL_SHARD if spec["reshard"] else ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=mp,
        use_orig_params=True,
        device_id=device if device.type == "cuda" else torch.device("cpu"),
    )


def shard_later(model, spec: dict, mesh) -> None:
    """DeepSpeed ZeRO: nothing yet; :func:`deepspeed_engine` wraps the model and its optimizer together."""


def deepspeed_engine(model, opt, spec: dict):
    """(engine, optimizer) of ``deepspeed.initialize`` for ZeRO stage 2 or 3 with the run's torch AdamW (no DeepSpeed
    op to build), bf16 on GPUs (fp32 master weights in ZeRO's optimizer, as DeepSpeed runs bf16), fp32 on CPU."""
    import deepspeed

    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=deepspeed_config(spec))
    return engine, opt


def deepspeed_config(spec: dict) -> dict:
    return {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": int(spec["engine"][-1])},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": spec["device"].startswith("cuda")},
    }


# An engine is ``shard(model, spec, mesh)``, called after the adapters are seeded and cast and gradient checkpointing
# is on; it shards in place (None) or returns the wrapper to train, and the optimizer is built on the parameters it
# leaves (DeepSpeed's engines then wrap model and optimizer together, ``deepspeed_engine``).
ENGINES = {
    "fsdp2": shard_fsdp2,
    "fsdp1": shard_fsdp1,
    "zero2": shard_later,
    "zero3": shard_later,
}

# ---------------------------------------------------------------------------------------------------------------
# Gradient proof over shards.
# ---------------------------------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def global_grads(named_params: list) -> list:
    """(name, stand-in) per trainable tensor whose ``grad`` is a 0-d tensor holding the whole gradient's norm: each
    rank's squared norm of its own shard, summed over ranks in one all-reduce (a NaN anywhere stays NaN). A gradient
    missing on every rank is missing (``grad`` None); FSDP1 gives a parameter a gradient only on the ranks whose flat
    shard holds part of it. So :func:`model_worker.grad_check` judges the whole tensors."""
    rows = []
    for _, p in named_params:
        g = None if p.grad is None else _local(p.grad)
        sq = torch.zeros((), dtype=torch.float32, device=p.device) if g is None else g.float().square().sum()
        rows.append(torch.stack([sq, torch.tensor(float(g is None), device=sq.device)]))
    table = torch.stack(rows)
    world = 1
    if dist.is_initialized():
        dist.all_reduce(table)
        world = dist.get_world_size()
    return [(n, types.SimpleNamespace(grad=None if miss >= world else sq.sqrt())) for (n, _), (sq, miss) in
            zip(named_params, table.cpu())]  # fmt: skip


class ZeroGradProof(mw.GradProof):
    """:class:`model_worker.GradProof` on DeepSpeed's whole fp32 gradients (``safe_get_full_grad``: between backward
    and the engine's step, a collective under ZeRO-3)."""

    def __call__(self) -> None:
        from deepspeed.utils import safe_get_full_grad

        grads = [(n, types.SimpleNamespace(grad=safe_get_full_grad(p))) for n, p in self.params]
        self.last = mw.grad_check(grads)
        self.steps += 1
        self.bad += [n for n in self.last["bad"] if n not in self.bad]


class ShardedGradProof(mw.GradProof):
    """:class:`model_worker.GradProof` on whole gradients assembled from the ranks' shards (:func:`global_grads`)."""

    def __call__(self) -> None:
        self.last = mw.grad_check(global_grads(self.params))
        self.steps += 1
        self.bad += [n for n in self.last["bad"] if n not in self.bad]


# ---------------------------------------------------------------------------------------------------------------
# One rank of the adapters: build, shard, train, measure.
# ---------------------------------------------------------------------------------------------------------------


_HF_DS_CONFIG = None  # ZeRO-3 under zero.Init: the HfDeepSpeedConfig that tells transformers and PEFT (build)


def build(spec: dict, rank: int, device: torch.device, zero_init: bool = False):
    """The seeded base in the run's parameter dtype, LoRA/DoRA (alpha 2r) on all linear projections with seeded
    A, B (non-zero) and magnitudes, non-reentrant gradient checkpointing; the same on every process.

    ``zero_init`` (ZeRO-3 with ``meta_init``): the base built under ``deepspeed.zero.Init`` as transformers builds it
    once ``HfDeepSpeedConfig`` is alive (each weight partitioned as it is made, initialised gathered), so no process
    holds it whole; PEFT and the seeding gather each base weight for its norm. A quantized ``meta_init`` base is built
    a decoder layer at a time (:func:`quantized_layers`)."""
    from peft import LoraConfig, get_peft_model

    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    if zero_init:
        from transformers.integrations import HfDeepSpeedConfig

        global _HF_DS_CONFIG  # transformers holds it by a weak reference: kept alive for the process
        _HF_DS_CONFIG = HfDeepSpeedConfig(deepspeed_config(spec))
        base = mw.build_base(spec["model"], device, dtype)
    elif spec.get("quant") and spec.get("meta_init"):
        base = quantized_layers(spec, device, dtype)
    else:
        base = mw.build_base(spec["model"], device, dtype)
        if spec.get("quant"):
            quantize(base, spec["quant"], device)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                        use_dora=spec["impl"]["dora"])  # fmt: skip
    with torch.device(device):
        model = get_peft_model(base, config)
    mw.seed_adapters(model, spec["model"]["seed"], spec["model"]["config_kwargs"]["initializer_range"])
    model = model.to(dtype)  # one dtype for FSDP's flat all-gather (PEFT keeps adapters in fp32 by default)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.base_model.model.enable_input_require_grads()
    return model


def build_sharded(spec: dict, rank: int, device: torch.device, mesh):
    """:func:`build` and :func:`shard_fsdp2` for a model that does not fit one GPU whole (``--meta-init``): the
    embedding, final norm, rotary table and LM head built as :func:`build` builds them, the decoder layers on the meta
    device, PEFT's adapters on them there, ``fully_shard`` as the benchmark shards, then each layer's shards made real
    on ``device`` (``to_empty``) and filled: projection weights N(0, initializer_range) and norm weights 1 drawn per
    parameter name and process (the same model in every implementation launched on as many processes, not the same
    as :func:`build`'s), then A, B and the magnitudes by ``seed_adapters`` (this process's rows of them). Returns the
    model, sharded."""
    from torch.distributed.tensor import DTensor
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from peft import LoraConfig, get_peft_model

    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    base = _layerless_base(spec, device, dtype)
    layers = base.config.num_hidden_layers
    with torch.device("meta"):
        base.model.layers = torch.nn.ModuleList(LlamaDecoderLayer(base.config, i).to(dtype) for i in range(layers))
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules="all-linear",
                      use_dora=spec["impl"]["dora"])  # fmt: skip
    model = get_peft_model(base, lora).to(dtype)
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.base_model.model.enable_input_require_grads()
    shard_fsdp2(model, spec, mesh)
    proc = dist.get_rank()
    with torch.no_grad():  # the base's shards; then the adapters as everywhere (their rows of the same values)
        for layer in model.base_model.model.model.layers:
            layer.to_empty(device=device)
            for name, param in layer.named_parameters(prefix=f"layer{layer.self_attn.layer_idx}"):
                if "lora_" not in name:  # the adapters are seed_adapters', below
                    _draw_base_param(param.to_local() if isinstance(param, DTensor) else param, name, spec, proc)
    mw.seed_adapters(model, spec["model"]["seed"], spec["model"]["config_kwargs"]["initializer_range"])
    return model


def _layerless_base(spec: dict, device: torch.device, dtype: torch.dtype):
    """:func:`model_worker.build_base`'s embedding, final norm, rotary table and LM head with no decoder layer yet
    (its config still counts the spec's layers): the meta-init builds add the layers their own way."""
    cfg = spec["model"]
    base = mw.build_base(dict(cfg, config_kwargs=dict(cfg["config_kwargs"], num_hidden_layers=0)), device, dtype)
    base.config.num_hidden_layers = cfg["config_kwargs"]["num_hidden_layers"]
    return base


def _draw_base_param(t: torch.Tensor, name: str, spec: dict, *key) -> None:
    """A decoder layer's base parameter as the meta-init builds fill it, in place: a norm weight 1, a projection
    weight N(0, initializer_range) drawn per parameter name (and ``key``: :func:`build_sharded`'s process)."""
    if name.endswith("norm.weight"):
        t.fill_(1.0)
    else:
        cfg = spec["model"]
        gen = mw._gen(t.device, cfg["seed"], name, *key, "W")
        t.copy_(torch.randn(t.shape, generator=gen, device=t.device) * cfg["config_kwargs"]["initializer_range"])


def meta_sharded(spec: dict) -> bool:
    """Whether :func:`build_sharded` builds the spec's model (FSDP2 ``meta_init`` without ``quant``)."""
    return bool(spec.get("meta_init")) and spec["engine"] == "fsdp2" and not spec.get("quant")


def build_wrapped(spec: dict, rank: int, device: torch.device, mesh, engine: bool = True):
    """The model of :func:`build` wrapped by the spec's engine (``ENGINES``; DeepSpeed's ZeRO wraps it later, with its
    optimizer), or not (``engine=False``: the single-process reference). With ``meta_init`` no process holds the
    whole model in the parameter dtype: FSDP2 builds it by :func:`build_sharded`, ZeRO-3 under ``zero.Init``, and a
    quantized model is built and quantized a decoder layer at a time (:func:`build`)."""
    if meta_sharded(spec):
        return build_sharded(spec, rank, device, mesh)
    if spec.get("meta_init") and spec["engine"] == "zero3":
        return build(spec, rank, device, zero_init=True)  # DeepSpeed wraps it later, with its optimizer
    model = build(spec, rank, device)
    return (ENGINES[spec["engine"]](model, spec, mesh) or model) if engine else model


def quantize(base, kind: str, device, dtype: torch.dtype = torch.bfloat16) -> None:
    """Every projection of the decoder layers as a bitsandbytes 4-bit Linear of ``kind`` (NF4 with double
    quantization, or FP4) in ``dtype`` storage and compute, as ``BitsAndBytesConfig(bnb_4bit_quant_storage=...)``
    loads it for FSDP: FSDP2 shards only floating-point storage. The layer is its weight's ``module``, which keeps the
    quantization state for FSDP2's gathered copy (a plain parameter). Also the CPU tests' QDoRA model (fp32)."""
    for layer in base.model.layers:
        quantize_layer(layer, kind, device, dtype)


def quantize_layer(layer, kind: str, device, dtype: torch.dtype = torch.bfloat16) -> None:
    """:func:`quantize` of one decoder layer."""
    import bitsandbytes as bnb

    nested = kind == "nf4"
    for parent in layer.modules():
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=dtype, quant_type=kind, compress_statistics=nested,
                                  quant_storage=dtype, device="meta")  # fmt: skip
            # where the weight is: Params4bit quantizes on its first move to a device, also onto its own device
            # (the 70B runs spent minutes sending each layer's weights through the host)
            q.weight = bnb.nn.Params4bit(child.weight.data.to(dtype), requires_grad=False, quant_type=kind,
                                         compress_statistics=nested, quant_storage=dtype, module=q)  # fmt: skip
            if child.bias is not None:
                q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            q.support_avx512bf16_for_cpu = False  # no in-place CPU repacking (FSDP2 shards the standard layout)
            setattr(parent, name, q.to(device))


def quantized_layers(spec: dict, device: torch.device, dtype: torch.dtype):
    """The base of :func:`build` for a quantized ``meta_init`` run: the embedding, final norm, rotary table and LM head
    as :func:`build` builds them, then each decoder layer made on ``device``, its projection weights drawn
    N(0, initializer_range) per parameter name (the same in every process and implementation, not the same values as
    :func:`build`'s) and quantized before the next is made: a 70B model is whole in every process only 4-bit (about
    40 GB in bf16 storage), never in bf16 (140 GB). FSDP2 then shards it as any other."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    base = _layerless_base(spec, device, dtype)
    with torch.no_grad():
        for i in range(base.config.num_hidden_layers):
            with torch.device(device):
                layer = LlamaDecoderLayer(base.config, i).to(dtype)
            for name, param in layer.named_parameters(prefix=f"layer{i}"):
                _draw_base_param(param, name, spec)
            quantize_layer(layer, spec["quant"], device, dtype)
            base.model.layers.append(layer)
    return base


def batches(spec: dict, world: int, rank: int, device: torch.device) -> list:
    """Every step's rows of this process: a seeded global batch of ``batch * world`` rows per step, row r, r + N, ...
    to process r, so every implementation trains on the same tokens. Labels are the inputs."""
    g = torch.Generator().manual_seed(spec["model"]["seed"] + 1)
    n, vocab = spec["warmup"] + spec["steps"], spec["model"]["config_kwargs"]["vocab_size"]
    shape = (spec["batch"] * world, spec["seq"])
    return [torch.randint(0, vocab, shape, generator=g)[rank::world].to(device) for _ in range(n)]


def _gather(value) -> list:
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def train_step(model, opt, ids: torch.Tensor, zero: bool, proof=None, autocast=None) -> torch.Tensor:
    """One training step on ``ids`` (labels = inputs): the forward (under ``autocast`` where given), the backward
    and the optimizer step, DeepSpeed's engine doing both under ZeRO (``zero``: its step also zeroes the gradients,
    so ``proof``, where given, runs between the two); returns the loss."""
    with autocast if autocast is not None else contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    if zero:
        model.backward(loss)
        if proof is not None:
            proof()
        model.step()  # the optimizer step, and the gradients zeroed
    else:
        loss.backward()
        opt.step()
    return loss


def train_rank(spec: dict, rank: int, device: torch.device, mesh, world: int, proc: int) -> dict:
    """One (impl, rank) record: per-step time (the slowest process's), per-step loss (mean over processes), peak over
    static per process, the gradient proof of every step, and for ours the norm counters per step and the tiers.
    The ``single`` reference trains the plain model (no engine); ``mp`` there is fp32 parameters under
    ``torch.autocast(bfloat16)``, the nearest unsharded twin of the engines' bf16 compute."""
    from peft.tuners.lora import dora

    single = spec["task"] == "single"
    model = build_wrapped(spec, rank, device, mesh, engine=not single)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec["lr"])
    zero = not single and spec["engine"].startswith("zero")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=single and spec["precision"] == "mp")
    if zero:
        model, opt = deepspeed_engine(model, opt, spec)
    data, losses, counts = iter(batches(spec, world, proc, device)), [], []
    norm_counts = getattr(dora, "norm_counts", None)  # ours only
    seen = [dict(norm_counts or {})]

    def step(proof=None):
        losses.append(train_step(model, opt, next(data), zero, proof, autocast).detach().float())

    proof = ZeroGradProof(model) if zero else ShardedGradProof(model)

    def after():  # untimed: the gradients of the step just taken (AdamW leaves them), the norm counters' delta
        if not zero:  # ZeRO's gradients are gone after its step: one proof step after the timed ones
            proof()
        if norm_counts is not None:
            now = dict(norm_counts)
            counts.append({k: v - seen[-1].get(k, 0) for k, v in now.items() if v != seen[-1].get(k, 0)})
            seen.append(now)

    before = (lambda: None) if zero else (lambda: opt.zero_grad(set_to_none=True))
    out = mw.measure(step, device, spec["warmup"], spec["steps"], before, after)
    if zero:
        data = iter(batches(spec, world, proc, device))
        step(proof)
        losses.pop()
    times = torch.tensor(out["samples_ms"], dtype=torch.float64, device=device)
    loss = torch.stack(losses).to(torch.float64)
    if dist.is_initialized():
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(loss)
        loss /= world
    peaks = _gather(out["peak_delta_mb"])
    rec = dict(mw.summary(times.tolist()), measure="train", rank=rank)
    rec.update(losses=[round(x, 6) for x in loss.tolist()], step0_loss=loss[0].item(), grad_proof=proof.result(),
               peak_delta_mb_per_rank=peaks, static_mb_per_rank=_gather(out["static_mb"]),
               peak_delta_mb=None if None in peaks else max(peaks), tiers=out["tiers"],
               norm_counts=counts if norm_counts is not None else None,
               local_ms_per_rank=_gather(out["median_ms"]),
               host_issue_ms_per_rank=_gather(out["host_issue_median_ms"]),
               allocator_per_step_per_rank=_gather(out["allocator_per_call"]))  # fmt: skip
    if meta_sharded(spec):  # build_sharded's frozen base, which every implementation trained: the same values in each
        frozen = [_local(p).double().sum() for p in model.parameters() if not p.requires_grad]
        total = torch.stack(frozen).sum()
        dist.all_reduce(total)
        rec["base_sum"] = total.item()
    if zero:
        model.destroy()
    else:
        opt.zero_grad(set_to_none=True)
    mw.release(model, opt)
    return rec


def train_pairs(spec: dict, rank: int, device: torch.device, mesh, world: int, proc: int) -> dict:
    """:func:`_paired_steps`, then both models and optimizers released (gc and the allocator's cache) before the next
    rank's models are built."""
    out = _paired_steps(spec, rank, device, mesh, world, proc)
    mw.release()
    return out


def _paired_steps(spec: dict, rank: int, device: torch.device, mesh, world: int, proc: int) -> dict:
    """The launch's DoRA against a plain-LoRA twin *model* in the same process (``spec["pairs"]`` ABBA pairs of
    training steps, :func:`model_worker.alternate`, after two warm-up steps each): the twin is built, seeded and
    sharded by the same engine (its own base with the same seeded weights, A and B; no magnitudes), with its own
    AdamW. Launches seconds apart land in different phases of the host's speed (single rounds of the separate
    launches have read 0.88-1.40x at one point under ZeRO-3); two steps back to back share one, as the grid's paired
    step does. A step's time is the slowest process's (each sample's maximum over processes, then the pairs'
    ratios). Every FSDP step's gradients are proved over the shards, untimed; under ZeRO, whose step drops them,
    one untimed proof step per side after the pairs. Static memory holds both models, so the peak is not taken here
    (the ``train`` record has it)."""
    import itertools

    zero = spec["engine"].startswith("zero")
    twin = dict(spec, impl=dict(spec["impl"], name="lora_twin", dora=False))
    sides = {}
    for side, side_spec in (("dora", spec), ("lora", twin)):
        model = build_wrapped(side_spec, rank, device, mesh).train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec["lr"])
        if zero:
            model, opt = deepspeed_engine(model, opt, side_spec)
        proof = ZeroGradProof(model) if zero else ShardedGradProof(model)
        sides[side] = (model, opt, proof, itertools.cycle(batches(spec, world, proc, device)))
    timer = mw.Timer(device)

    def step_ms(side: str) -> float:
        model, opt, proof, data = sides[side]
        ids, times = next(data), []
        if not zero:
            opt.zero_grad(set_to_none=True)
        with timer.region(times):
            train_step(model, opt, ids, zero)
        if not zero:
            proof()
        return times[0]

    out = mw.alternate("train_step_paired", {s: lambda s=s: step_ms(s) for s in sides}, spec["pairs"], warmup=2)
    for model, opt, proof, data in sides.values() if zero else ():  # ZeRO's proof: between a backward and its step
        train_step(model, opt, next(data), zero, proof)
    samples = torch.tensor([out["samples_ms"], out["lora_samples_ms"]], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(samples, op=dist.ReduceOp.MAX)
    dora_ms, lora_ms = samples.tolist()
    ratios = [d / lo for d, lo in zip(dora_ms, lora_ms)]
    out.update(mw.summary(dora_ms))
    out.update(lora_median_ms=statistics.median(lora_ms), lora_samples_ms=[round(t, 4) for t in lora_ms],
               pair_ratios=[round(r, 4) for r in ratios], ratio_median=statistics.median(ratios),
               grad_proof=sides["dora"][2].result(), lora_grad_proof=sides["lora"][2].result())  # fmt: skip
    if not out["lora_grad_proof"]["ok"]:  # a LoRA side that did not train makes no ratio either
        out["grad_proof"] = dict(out["grad_proof"], ok=False)
    for model, opt, _, _ in sides.values():
        if zero:
            model.destroy()
        else:
            opt.zero_grad(set_to_none=True)
    sides.clear()  # the models, optimizers and proofs: gone with this frame (train_pairs collects them)
    return dict(out, rank=rank)


@torch.no_grad()
def check_norms(model) -> dict:
    """Each DoRA Linear's norm under FSDP2 (this rank's rows, gathered) against the whole norm of the gathered
    tensors, with the layer unsharded through FSDP2's public ``unshard``/``reshard``; the worst over processes."""
    from peft.tuners.lora import dora, dora_dist
    from peft.tuners.lora.layer import Linear

    worst, row_sharded, modules = 0.0, 0, 0
    for layer in model.base_model.model.model.layers:
        layer.unshard()
        for module in layer.modules():
            if not isinstance(module, Linear) or "default" not in module.lora_magnitude_vector:
                continue
            weight = module.get_base_layer().weight
            lora_A, lora_B = module.lora_A["default"].weight, module.lora_B["default"].weight
            scaling = module.scaling["default"]
            shards = dora_dist.norm_shards(weight, lora_A, lora_B)
            row_sharded += shards is not None and shards.group is not None
            dora.invalidate_norm_caches()
            sharded = module.lora_magnitude_vector["default"]._forward_norm(weight, lora_A, lora_B, scaling, "default")
            whole = dora.factored_row_norm(weight, lora_A, lora_B, scaling)
            worst = max(worst, ((sharded - whole).abs() / whole.abs()).max().item())
            modules += 1
        layer.reshard()
    return {"max_rel_err": max(_gather(worst)), "modules": modules, "row_sharded": row_sharded}


def norm_check(spec: dict, device: torch.device, mesh, world: int, proc: int) -> dict:
    """:func:`check_norms` on the spec's first rank, sharded as :func:`shard_fsdp2` (the launcher sends an fp32 spec:
    no rounding hides a wrong row), after one forward and backward, so FSDP2's state is that of training."""
    rank = spec["ranks"][0]
    model = build_wrapped(spec, rank, device, mesh)
    model.train()
    ids = batches(spec, world, proc, device)[0]
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    out = dict(check_norms(model), rank=rank, precision=spec["precision"])
    mw.release(model)
    return out


# ---------------------------------------------------------------------------------------------------------------
# The process.
# ---------------------------------------------------------------------------------------------------------------


def pin_cores() -> Optional[list]:
    """``BENCH_PIN_CORES=1``: this process on its own contiguous share of the cores it may run on (one share per local
    process, by ``LOCAL_RANK``), set before the process group and CUDA start their threads, which inherit it; the
    cores it got, or None where it is not asked (or the host has fewer cores than processes)."""
    if os.environ.get("BENCH_PIN_CORES") != "1":
        return None
    cores = sorted(os.sched_getaffinity(0))
    local, procs = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    share = len(cores) // procs
    if share < 1:
        return None
    mine = cores[local * share : (local + 1) * share]
    os.sched_setaffinity(0, mine)
    return mine


def setup(spec: dict):
    """Process group (NCCL on GPUs, gloo on CPU), this process's device and the 1-D device mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    world, proc = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return device, init_device_mesh(device.type, (world,)), world, proc


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    impl, result_path = spec["impl"], Path(spec["result"])
    pinned = pin_cores()  # before the process group and CUDA start their threads
    device, mesh, world, proc = setup(spec)
    result = {"impl": impl["name"], "round": spec["round"], "records": [], "errors": [], "world": world,
              "backend": dist.get_backend(), "pinned_cores": pinned}  # fmt: skip
    try:
        import peft

        info = mw.check_peft(impl)
        info["peft_file"] = peft.__file__
        info["env"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None
        result["info"] = info
        if spec["task"] == "norm_check":
            result["norm_check"] = norm_check(spec, device, mesh, world, proc)
            if proc == 0:
                print(f"[norm_check] {result['norm_check']}", flush=True)
        else:
            for rank in spec["ranks"]:
                rec = dict(train_rank(spec, rank, device, mesh, world, proc), impl=impl["name"], round=spec["round"])
                rec["mode"] = spec["precision"]
                result["records"].append(rec)
                if proc == 0:
                    finite = all(math.isfinite(x) for x in rec["losses"])
                    print(
                        f"[{impl['name']} r{spec['round']}] rank {rank}: step {rec['median_ms']:.2f} ms, loss0 "
                        f"{rec['step0_loss']:.4f}, proof {rec['grad_proof']['ok']}, finite {finite}",
                        flush=True,
                    )
                    result_path.write_text(json.dumps(result))
                if spec.get("pairs") and impl["dora"] and spec["task"] == "train":  # against a LoRA twin model
                    pair = dict(train_pairs(spec, rank, device, mesh, world, proc), impl=impl["name"])
                    pair.update(round=spec["round"], mode=spec["precision"])
                    result["records"].append(pair)
                    if proc == 0:
                        print(
                            f"[{impl['name']} r{spec['round']}] rank {rank}: paired with a LoRA twin, step "
                            f"{pair['median_ms']:.2f} ms vs {pair['lora_median_ms']:.2f}, ratio median "
                            f"{pair['ratio_median']:.3f}, proof {pair['grad_proof']['ok']}",
                            flush=True,
                        )
                        result_path.write_text(json.dumps(result))
    except Exception:
        err = traceback.format_exc()
        print(f"[process {proc}] {err}", file=sys.stderr, flush=True)
        result_path.with_suffix(f".rank{proc}.err").write_text(err[-3000:])
        raise
    if proc == 0:
        result_path.write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # without the interpreter's finalization: once in some dozens of gloo launches a native thread aborted in its
    # teardown of what still holds the process group's state (as in tests' sharded_training_worker.exit_now)
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
