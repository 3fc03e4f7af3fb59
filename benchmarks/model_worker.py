"""One implementation's share of the model benchmark, run in its own process by ``bench_model.py``.

Started as ``python model_worker.py SPEC.json``: SPEC names the implementation, the precision modes, the ranks and
the tasks (speed, fidelity, convergence, profile), and the file to write the results to. The parent puts the
implementation's ``--target`` install first on ``PYTHONPATH`` and sets ``PEFT_DORA_FUSED`` for the eager run; this
process checks that it imported the ``peft`` it was meant to before measuring anything.

Nothing here imports from the repository: the script directory is ``sys.path[0]``, so the overlay tree in the repo
root cannot shadow the installed package.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import math
import os
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Optional

import torch


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MEASURES = ("train", "train_accum4", "step_accum4", "infer", "prefill", "generate", "decode_per_token")
ACCUM_STEPS = 4


# ---------------------------------------------------------------------------------------------------------------
# The package under test.
# ---------------------------------------------------------------------------------------------------------------


def check_peft(impl: dict) -> dict:
    """Import ``peft`` and fail unless it is the install this implementation names (and the right DoRA)."""
    import peft
    from peft.tuners.lora import dora

    target = Path(impl["target"]).resolve()
    peft_file = Path(peft.__file__).resolve()
    print(f"[{impl['name']}] peft {peft.__version__} from {peft_file}", flush=True)
    if target not in peft_file.parents:
        raise RuntimeError(f"{impl['name']}: imported peft from {peft_file}, expected it under {target}")
    ours = hasattr(dora, "factored_row_norm")
    if ours != impl["ours"]:
        raise RuntimeError(
            f"{impl['name']}: peft.tuners.lora.dora {'has' if ours else 'lacks'} factored_row_norm, "
            f"so this is {'our' if ours else 'upstream'} DoRA, not what was asked for"
        )
    dists = list(importlib.metadata.distributions(name="peft", path=[str(target)]))
    env = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "triton"):
        try:
            env[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            env[name] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return {
        "peft_version": dists[0].version if dists else peft.__version__,
        "ours": ours,
        "peft_dora_env": {k: v for k, v in os.environ.items() if k.startswith("PEFT_DORA_")},
        "env": env,
    }


def _delta(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def tier_counts() -> dict:
    """Our dispatch tiers and norm computations/reuses so far (empty for upstream, which has neither counter), and
    the graphs torch.compile has compiled (``compiled_graphs``; 0 without compile)."""
    from torch._dynamo.utils import counters

    from peft.tuners.lora import dora

    counts = dict(getattr(dora, "tier_counts", {}))
    counts.update(getattr(dora, "norm_counts", {}))
    counts["compiled_graphs"] = counters["stats"]["unique_graphs"]
    return counts


# ---------------------------------------------------------------------------------------------------------------
# Model, adapters and data.
# ---------------------------------------------------------------------------------------------------------------


def build_base(cfg: dict, device: torch.device, dtype: torch.dtype):
    """A randomly initialised causal LM of the preset's architecture, seeded, built directly on ``device``."""
    import transformers

    config_cls = getattr(transformers, cfg["config_class"])
    model_cls = getattr(transformers, cfg["model_class"])
    config = config_cls(**cfg["config_kwargs"])
    torch.manual_seed(cfg["seed"])
    with torch.device(device):
        model = model_cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def _gen(device: torch.device, *key) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(zlib.crc32(repr(key).encode()))


def dequantized(layer) -> torch.Tensor:
    """The weight a layer computes with. Through ``dequantize_bnb_weight``: ``dequantize_module_weight``'s CPU branch
    re-wraps an ``Int8Params`` and loses its row scales (bitsandbytes 0.50); on a GPU the two are the same."""
    from peft.utils.integrations import dequantize_bnb_weight

    if type(layer.weight).__name__ in ("Params4bit", "Int8Params"):
        return dequantize_bnb_weight(layer.weight, state=getattr(layer, "state", None))
    return layer.weight


@torch.no_grad()
def seed_adapters(model, seed: int, init_range: float, zero_b: bool = False, adapter: str = "default") -> None:
    """Overwrite A, B and the magnitudes with values drawn per module name, identical in every implementation (and
    in every adapter of one model: a plain-LoRA twin gets the DoRA adapter's A and B).

    A ~ N(0, 1/d_in); B sized so that ``s·B·A·x`` is about a tenth of ``W·x`` (never zeros: they time faster and
    hide errors); the magnitude is the fp32 row norm of W times (1 + 0.1·N(0, 1)), so ``g`` differs from 1. Also on
    an FSDP2-sharded model (``multi_gpu_worker.build_sharded``): each process writes its own rows of the same values.
    """
    from peft.utils.integrations import gather_params_ctx

    for name, module in sorted(model.named_modules()):
        if not hasattr(module, "lora_A") or adapter not in module.lora_A:
            continue
        a = module.lora_A[adapter].weight
        b = module.lora_B[adapter].weight
        dev = a.device
        r, d_in = a.shape
        a.copy_(
            _laid_out_as(a, torch.randn(a.shape, generator=_gen(dev, seed, name, "A"), device=dev) / math.sqrt(d_in))
        )
        if zero_b:
            b.zero_()
        else:
            std = 0.2 * init_range * math.sqrt(d_in) / r
            b.copy_(_laid_out_as(b, torch.randn(b.shape, generator=_gen(dev, seed, name, "B"), device=dev) * std))
        mags = getattr(module, "lora_magnitude_vector", None)
        if mags is not None and adapter in mags and not zero_b:
            m = mags[adapter].weight
            base = module.get_base_layer()
            noise = _laid_out_as(m, torch.randn(m.shape, generator=_gen(dev, seed, name, "m"), device=dev))
            # a ZeRO-3 partition built under zero.Init is whole only gathered (read only: no modifier rank)
            with gather_params_ctx(base.weight, modifier_rank=None):
                w = dequantized(base)
                m.copy_(torch.linalg.vector_norm(w.float(), dim=1) * (1 + 0.1 * noise))


def _laid_out_as(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` as ``param`` holds it: for an FSDP2-sharded parameter (a DTensor) this process's rows of it, every
    process having drawn the same ``full`` (no communication); else ``full`` itself."""
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(param.dtype), mesh, param.placements, src_data_rank=None)


@torch.no_grad()
def nudge_magnitudes(model) -> None:
    """Move every DoRA magnitude entry up by one ulp of its dtype: a run that differs from the unperturbed one by
    about what two correct norm computations differ by, to measure how far the training task amplifies that."""
    for name, p in model.named_parameters():
        if "lora_magnitude_vector" in name:
            p.copy_(torch.nextafter(p, torch.full_like(p, math.inf)))


FP32_ADAPTER_MODES = ("autocast", "mixed")  # PEFT's default fp32 adapters beside the bf16 base


def lora_config(rank: int, dora: bool, targets=TARGETS, dropout: float = 0.0):
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=rank / 2,
        use_rslora=True,
        use_dora=dora,
        target_modules=list(targets),
        lora_dropout=dropout,
    )


def wrap(base, cfg: dict, rank: int, impl: dict, mode: str, targets=TARGETS, dropout: float = 0.0):
    """``get_peft_model`` in the precision mode: autocast = fp32 adapters on a bf16 base under bf16 autocast; mixed =
    the same model without autocast (PEFT's default fp32 adapters beside a bf16 base, as a training loop of its own
    runs them); bf16/fp32 = one dtype."""
    from peft import get_peft_model

    config = lora_config(rank, impl["dora"], targets, dropout)
    with torch.device(base.device):  # adapters initialised where they live (on the CPU, r 768 takes seconds)
        model = get_peft_model(base, config, autocast_adapter_dtype=(mode in FP32_ADAPTER_MODES))
    if mode == "bf16":
        model = model.to(torch.bfloat16)
    elif mode == "fp32":
        model = model.to(torch.float32)
    return model


def precision_ctx(mode: str, device: torch.device):
    if mode == "autocast":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_inputs(cfg: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [batch, seq] and labels with the loss on the last ``loss_tokens`` positions only."""
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    ids = torch.randint(0, cfg["config_kwargs"]["vocab_size"], (cfg["batch"], cfg["seq"]), generator=g)
    labels = ids.clone()
    labels[:, : cfg["seq"] - cfg["loss_tokens"]] = -100
    return ids.to(device), labels.to(device)


def release(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# Gradient proof: a timed training step must have trained.
# ---------------------------------------------------------------------------------------------------------------


def param_kind(name: str) -> str:
    if "lora_magnitude_vector" in name:
        return "magnitude"
    return "lora_A" if "lora_A" in name else "lora_B" if "lora_B" in name else "other"


def _finite(x: float):
    return x if math.isfinite(x) else None


def grad_check(named_params: list) -> dict:
    """The gradients of ``named_params`` (the trainable tensors) after a step: the names of those missing, zero or
    non-finite, the global norm and the norm per kind (lora_A, lora_B, magnitude). One host sync."""
    present = [(n, p.grad) for n, p in named_params if p.grad is not None]
    bad = [n for n, p in named_params if p.grad is None]
    norms = []
    if present:
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for _, g in present]).tolist()
    squares: dict = {}
    for (name, _), norm in zip(present, norms):
        if not math.isfinite(norm) or norm == 0.0:
            bad.append(name)
        squares[param_kind(name)] = squares.get(param_kind(name), 0.0) + norm * norm
    return {
        "bad": bad,
        "norm": _finite(math.sqrt(sum(squares.values()))),
        "norm_by_kind": {k: _finite(math.sqrt(v)) for k, v in sorted(squares.items())},
    }


class GradProof:
    """Run after every training step (warm-up included): each trainable tensor's gradient must be present, finite and
    non-zero. A published throughput record was once a run whose gradients were all zero; a record that fails here
    says ``ok: false`` and the parent leaves it out of every headline."""

    def __init__(self, model):
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.steps, self.bad, self.last = 0, [], None

    def __call__(self) -> None:
        self.last = grad_check(self.params)
        self.steps += 1
        self.bad += [n for n in self.last["bad"] if n not in self.bad]

    def result(self) -> dict:
        """The proof of the steps since the last result: ``ok``, the steps and tensors checked, the bad tensors (count,
        first names) and the last step's global and per-kind gradient norms."""
        last = self.last or {"norm": None, "norm_by_kind": {}}
        out = {
            "ok": bool(self.steps and self.params and not self.bad),
            "steps": self.steps,
            "tensors": len(self.params),
            "bad_tensors": len(self.bad),
            "bad_names": self.bad[:8],
            "grad_norm": last["norm"],
            "grad_norm_by_kind": last["norm_by_kind"],
        }
        self.steps, self.bad, self.last = 0, [], None
        return out


# ---------------------------------------------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------------------------------------------


class Timer:
    """Milliseconds of a region: CUDA events on a GPU, ``perf_counter`` after a barrier elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def region(self, out: list):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            yield
            out.append((time.perf_counter() - t0) * 1e3)


def summary(samples: list) -> dict:
    return {
        "median_ms": statistics.median(samples),
        "min_ms": min(samples),
        "max_ms": max(samples),
        "samples_ms": [round(s, 4) for s in samples],
    }


def measure(fn, device, warmup: int, repeats: int, before=None, after=None) -> dict:
    """Run ``fn`` ``warmup`` times, then time it ``repeats`` times; peak memory over the static allocation, and the
    host's issue time of each timed call (``perf_counter`` around ``fn`` alone, no sync: where its median reaches the
    step time, the step waits on the host, and a host's speed moves the step's ratios).

    ``before`` (untimed) runs ahead of every call, e.g. to drop gradients so each step allocates them afresh;
    ``after`` (untimed) after every call, e.g. to check the gradients the step produced.
    """
    for _ in range(warmup):
        if before:
            before()
        fn()
        if after:
            after()
    if before:
        before()
    gc.collect()
    static = peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        static = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    timer, samples, issue = Timer(device), [], []
    counts0 = tier_counts()
    alloc0 = allocator_counts(device)
    for _ in range(repeats):
        if before:
            before()
        with timer.region(samples):
            t0 = time.perf_counter()
            fn()
            issue.append((time.perf_counter() - t0) * 1e3)
        if after:
            after()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - static
    tiers = _delta(counts0, tier_counts())
    out = summary(samples)
    out["peak_delta_mb"] = None if peak is None else peak / 2**20
    out["static_mb"] = None if static is None else static / 2**20
    out["tiers"] = tiers
    out["host_issue_median_ms"] = statistics.median(issue) if issue else None
    alloc1 = allocator_counts(device)
    out["allocator_per_call"] = (
        None if alloc0 is None or not repeats else {k: (alloc1[k] - v) / repeats for k, v in alloc0.items()}
    )
    return out


ALLOCATOR_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def allocator_counts(device) -> Optional[dict]:
    """The CUDA caching allocator's cumulative counts of ``cudaMalloc`` and ``cudaFree`` calls, retries after a failed
    allocation (each frees cached blocks and synchronizes) and whole-device syncs: host stalls a step's issue time can
    hide; None off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {k: stats.get(k, 0) for k in ALLOCATOR_KEYS}


def compiled_call(model, compile_mode):
    """``model``'s forward, through ``torch.compile(model, mode=compile_mode)`` unless that is None. A new step is
    marked before every call, so CUDA-graph trees (``reduce-overhead``) may reuse the previous step's memory."""
    if compile_mode is None:
        return model
    compiled = torch.compile(model, mode=compile_mode)

    def call(*args, **kwargs):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return call


def speed_rank(model, cfg, mode, device, measures, warmup, repeats, compile_mode=None) -> dict:
    """Every requested measure for one wrapped model (compiled with ``compile_mode`` unless None: train and infer
    only; ``tiers`` of each record then counts the graphs compiled while it was timed, which must be none)."""
    forward = compiled_call(model, compile_mode)
    ids, labels = make_inputs(cfg, device)
    ctx = lambda: precision_ctx(mode, device)  # noqa: E731
    zero = lambda: model.zero_grad(set_to_none=True)  # noqa: E731
    results = {}

    # A training step as users run it ends with the optimizer step: AdamW changes A, B and m in place, so every
    # step pays what DoRA pays per optimizer step (a fresh norm, the magnitude's zero test). The gradients stay for
    # the proof (``after``); ``before`` drops them, untimed.
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, foreach=True)

    def train_step():
        with ctx():
            loss = forward(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        optimizer.step()

    def train_accum():
        for _ in range(ACCUM_STEPS):
            with ctx():
                loss = forward(input_ids=ids, labels=labels, use_cache=False).loss / ACCUM_STEPS
            loss.backward()
        optimizer.step()

    model.train()
    proof = GradProof(model)
    if "train" in measures:
        results["train"] = measure(train_step, device, warmup, repeats, before=zero, after=proof)
        results["train"]["grad_proof"] = proof.result()
    if "train_accum4" in measures:
        results["train_accum4"] = measure(train_accum, device, max(1, warmup - 1), repeats, before=zero, after=proof)
        results["train_accum4"]["grad_proof"] = proof.result()
    zero()
    if "step_accum4" in measures:
        # train_accum4 with the gradients dropped inside the step; the norm computations it counts are the ones an
        # optimizer step really costs.
        def optimizer_step():
            train_accum()
            optimizer.zero_grad(set_to_none=True)

        res = measure(optimizer_step, device, max(1, warmup - 1), repeats)
        res["dora_modules"] = sum(1 for m in model.modules() if getattr(m, "lora_magnitude_vector", None))
        computed = res["tiers"].get("norm_computed")
        res["norm_calls_per_optimizer_step"] = (
            None if computed is None or not res["dora_modules"] else computed / (repeats * res["dora_modules"])
        )
        results["step_accum4"] = res
        zero()
    optimizer.state.clear()  # AdamW's moments, freed before the inference measures
    del trainable
    release()

    model.eval()
    if "infer" in measures:

        @torch.no_grad()
        def infer():
            with ctx():
                forward(input_ids=ids, use_cache=False)

        results["infer"] = measure(infer, device, warmup, repeats)
    for name, suffix in (("decode", ""), ("decode_cached", "_cached")):
        if name in measures:
            results.update(decode(model, ids, cfg, ctx, device, warmup, repeats, suffix))
    model.train()
    return results


def generate_exactly(model, prompt: torch.Tensor, new: int) -> None:
    """Greedy KV-cached generation of ``new`` tokens after ``prompt``; fails if it stopped early."""
    out = model.generate(input_ids=prompt, max_new_tokens=new, do_sample=False, use_cache=True)
    if out.shape[1] != prompt.shape[1] + new:
        raise RuntimeError(f"generate returned {out.shape[1] - prompt.shape[1]} new tokens, not {new}")


def decode_paired(model, cfg, rank, mode, device, pairs: int) -> dict:
    """Per-token decode of this DoRA model and of a plain-LoRA twin built in the same process (same base weights and
    seeded A, B; this package's LoRA path, which the overlay leaves as upstream's), alternated ``pairs`` times in
    ABBA order. Separate subprocesses minutes apart see different host speeds, and decode is host-bound; a pair
    measured back to back shares them, so the median of the per-pair ratios is the tighter DoRA/LoRA figure."""
    twin = lora_twin_model(model, cfg, rank, mode, device)
    models = {"dora": model.eval(), "lora": twin.eval()}
    ids, _ = make_inputs(cfg, device)
    prompt, new = ids[:, : cfg["prompt_tokens"]], cfg["new_tokens"]
    timer = Timer(device)

    @torch.no_grad()
    def per_token(m) -> float:
        pre, gen = [], []
        with precision_ctx(mode, device):
            with timer.region(pre):
                m(input_ids=prompt, use_cache=True)
            with timer.region(gen):
                generate_exactly(m, prompt, new)
        return (gen[0] - pre[0]) / new

    out = alternate("decode_per_token_paired", {name: lambda m=m: per_token(m) for name, m in models.items()}, pairs)
    model.train()
    del models, twin
    release()
    return out


class GcWatch:
    """The garbage collector's pauses while installed (``gc.callbacks``): their total ms and how many were full
    (generation 2) collections. Observation only: the collector runs as it would in training."""

    def __init__(self) -> None:
        self.ms, self.full, self._t0 = 0.0, 0, None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.full += info.get("generation") == 2
            self._t0 = None

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def alternate(measure_name: str, timings: dict, pairs: int, warmup: int = 1) -> dict:
    """A paired record: ``timings["dora"]()`` and ``timings["lora"]()`` (each returns ms) after ``warmup`` calls
    each, then ``pairs`` times in ABBA order; DoRA's samples, LoRA's, every pair's DoRA/LoRA ratio, and per sample
    the garbage collector's pause time and full collections during the call (``gc_ms``, ``gc_full``: a step's
    outlier can be the collector walking the whole heap rather than DoRA or LoRA). Any further side (e.g.
    ``"cached"``: DoRA under ``DoraCaching``) takes its turn in every round too (the order reversed every other
    round) and adds ``{side}_samples_ms``, ``{side}_median_ms``, its ratio to LoRA of the same round
    (``{side}_ratios``, ``{side}_ratio_median``) and to DoRA's (``{side}_over_dora_ratios``, ``..._median``)."""
    names = ["dora", "lora", *(n for n in timings if n not in ("dora", "lora"))]
    for _ in range(warmup):  # compile, plans, caches, the norm graphs (captured on a layer's second training norm)
        for name in names:
            timings[name]()
    times = {name: [] for name in names}
    gc_ms, gc_full = {name: [] for name in names}, {name: [] for name in names}
    counts0 = tier_counts()
    with GcWatch() as watch:
        for k in range(pairs):
            for name in names if k % 2 == 0 else names[::-1]:
                ms0, full0 = watch.ms, watch.full
                times[name].append(timings[name]())
                gc_ms[name].append(round(watch.ms - ms0, 3))
                gc_full[name].append(watch.full - full0)
    ratios = [d / lo for d, lo in zip(times["dora"], times["lora"])]
    out = {"measure": measure_name, **summary(times["dora"])}
    out.update(
        lora_median_ms=statistics.median(times["lora"]),
        lora_samples_ms=[round(t, 4) for t in times["lora"]],
        pair_ratios=[round(r, 4) for r in ratios],
        ratio_median=statistics.median(ratios),
        tiers=_delta(counts0, tier_counts()),
        gc_ms=gc_ms,
        gc_full=gc_full,
    )
    for name in names[2:]:
        out[f"{name}_samples_ms"] = [round(t, 4) for t in times[name]]
        out[f"{name}_median_ms"] = statistics.median(times[name])
        for against in ("lora", "dora"):
            ratios = [round(t / o, 4) for t, o in zip(times[name], times[against])]
            key = f"{name}_ratios" if against == "lora" else f"{name}_over_dora_ratios"
            out[key], out[key[:-1] + "_median"] = ratios, statistics.median(ratios)
    return out


def decode(model, ids, cfg, ctx, device, warmup, repeats, suffix: str) -> dict:
    """Prefill and KV-cached greedy generation; per-token decode = (generate - median prefill) / new tokens.

    ``suffix`` "_cached" runs both under ``peft.helpers.DoraCaching`` (the norm is computed once, then reused).
    """
    from peft.helpers import DoraCaching

    caching = DoraCaching if suffix else contextlib.nullcontext
    prompt = ids[:, : cfg["prompt_tokens"]]
    new = cfg["new_tokens"]

    @torch.no_grad()
    def prefill():
        with ctx(), caching():
            model(input_ids=prompt, use_cache=True)

    @torch.no_grad()
    def generate():
        with ctx(), caching():
            generate_exactly(model, prompt, new)

    pre = measure(prefill, device, warmup, repeats)
    gen = measure(generate, device, 1, repeats)
    per_tok = summary([(g - pre["median_ms"]) / new for g in gen["samples_ms"]])
    per_tok.update(peak_delta_mb=gen["peak_delta_mb"], static_mb=gen["static_mb"], tiers=gen["tiers"])
    return {f"prefill{suffix}": pre, f"generate{suffix}": gen, f"decode_per_token{suffix}": per_tok}


# ---------------------------------------------------------------------------------------------------------------
# Tasks.
# ---------------------------------------------------------------------------------------------------------------


def task_speed(spec, impl, cfg, device, records: list, flush) -> list:
    """Every measure at every rank; ``records`` grows and is flushed after each rank (a timeout keeps them)."""
    for mode in spec["modes"]:
        base = build_base(cfg, device, torch.bfloat16)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for rank in spec["ranks"]:
            t0 = time.perf_counter()
            model = wrap(base, cfg, rank, impl, mode)
            seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
            compile_mode = spec.get("compile")
            res = speed_rank(model, cfg, mode, device, spec["measures"], spec["warmup"], spec["repeats"], compile_mode)
            for measure_name, r in res.items():
                records.append({"impl": impl["name"], "mode": mode, "rank": rank, "measure": measure_name, **r})
                if compile_mode is not None:
                    records[-1]["compile"] = compile_mode
            flush()
            line = ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in res.items())
            print(f"[{impl['name']}] {mode} r={rank}: {line} ms ({time.perf_counter() - t0:.0f} s)", flush=True)
            if compile_mode is not None and impl["name"] in spec["decode_paired"]["impls"]:
                compiled_pairs(model, cfg, rank, mode, device, spec, records, impl["name"])
                flush()
            if "decode_paired" in spec["measures"] and impl["name"] in spec["decode_paired"]["impls"]:
                paired = decode_paired(model, cfg, rank, mode, device, spec["decode_paired"]["pairs"])
                records.append({"impl": impl["name"], "mode": mode, "rank": rank, **paired})
                flush()
                print(
                    f"[{impl['name']}] {mode} r={rank}: decode paired with LoRA {paired['median_ms']:.2f} vs "
                    f"{paired['lora_median_ms']:.2f} ms/token, ratio {paired['ratio_median']:.3f}",
                    flush=True,
                )
            base = model.unload()  # the base model without adapter layers, for the next rank
            torch._dynamo.reset()  # the next rank's graphs start from nothing (and this rank's are freed)
            release(model)
        release(base)
    return records


TWIN = "lora_twin"  # the plain-LoRA adapter beside a grid point's DoRA adapter, for paired decode


def compiled_pairs(model, cfg, rank: int, mode: str, device, spec: dict, records: list, impl_name: str) -> None:
    """With ``--compile``: the compiled training step and inference forward of this DoRA model against a compiled
    plain-LoRA twin model (:func:`lora_twin_model`), back to back in ABBA pairs (:func:`twin_pairs`), each model
    compiled on its own; the timed pairs' ``tiers`` count any graph compiled after the warm-up. A twin adapter on the
    same model (the grid's pairing) made one compiled model hold both adapters' graphs, and a call after the other
    adapter's checked that graph's guards first: on the H200 LoRA's paired inference at 512 tokens took 12.6 ms
    against 7.5 in its own process."""
    twin = lora_twin_model(model, cfg, rank, mode, device)
    models = {"dora": model, "lora": twin}
    forwards = {side: compiled_call(m, spec["compile"]) for side, m in models.items()}
    pairs = spec["decode_paired"]["pairs"]
    for measure in ("train_step_paired", "infer_step_paired"):
        if measure in spec["measures"]:
            r = twin_pairs(measure, models, forwards, cfg, mode, device, pairs)
            records.append({"impl": impl_name, "mode": mode, "rank": rank, "measure": measure, **r,
                            "compile": spec["compile"], "pairing": "twin model"})  # fmt: skip
            print(f"[{impl_name}] {mode} r={rank}: compiled {measure} DoRA/LoRA twin model {r['ratio_median']:.3f} "
                  f"({r['median_ms']:.2f} vs {r['lora_median_ms']:.2f} ms)", flush=True)  # fmt: skip
    model.train()
    del models, forwards, twin
    release()


def lora_twin_model(model, cfg, rank: int, mode: str, device):
    """A plain-LoRA model beside ``model``: its own base (the same seeded weights, gradient checkpointing as the
    benchmark's models have it) and the same seeded A and B, in the same precision mode."""
    base = build_base(cfg, device, torch.bfloat16)
    if model.get_base_model().is_gradient_checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    twin = wrap(base, cfg, rank, {"dora": False}, mode)
    seed_adapters(twin, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
    return twin


def twin_pairs(measure: str, models: dict, forwards: dict, cfg, mode: str, device, pairs: int) -> dict:
    """``train_step_paired`` (forward, backward, AdamW step; every step's gradients proved per side) or
    ``infer_step_paired`` (eval forward without autograd) of two models (``models``/``forwards``: side -> model / its
    compiled call), in ABBA pairs (:func:`alternate`, two warm-up calls per side)."""
    ids, labels = make_inputs(cfg, device)
    timer = Timer(device)
    train = measure == "train_step_paired"
    sides, proofs = {}, {}
    for side, m in models.items():
        m.train(train)
        if train:
            params = [p for p in m.parameters() if p.requires_grad]
            proofs[side] = GradProof(m)
            sides[side] = torch.optim.AdamW(params, lr=1e-6, foreach=True)

    def step_ms(side: str) -> float:
        forward, times = forwards[side], []
        if not train:
            with torch.no_grad(), timer.region(times), precision_ctx(mode, device):
                forward(input_ids=ids, use_cache=False)
            return times[0]

        def loss():
            with precision_ctx(mode, device):
                return forward(input_ids=ids, labels=labels, use_cache=False).loss

        return timed_step(timer, models[side], sides[side], proofs[side], loss)

    out = alternate(measure, {side: lambda side=side: step_ms(side) for side in models}, pairs, warmup=2)
    if train:
        out["grad_proof"], out["lora_grad_proof"] = proofs["dora"].result(), proofs["lora"].result()
        if not out["lora_grad_proof"]["ok"]:  # a LoRA side that did not train makes no ratio either
            out["grad_proof"] = dict(out["grad_proof"], ok=False)
        for m in models.values():
            m.zero_grad(set_to_none=True)
    sides.clear()
    return out


def decode_step_paired(model, cfg, point: dict, device, pairs: int, steps: int, cached: bool = False) -> dict:
    """1-token decode of the DoRA adapter against a plain-LoRA twin adapter on the same base model (same seeded A and
    B; this package's LoRA path, which the overlay leaves as upstream's), in ABBA pairs (:func:`alternate`). Each
    side prefills the point's batch and sequence into a fresh KV cache (untimed), then times ``steps`` forwards of one
    token that extend it; a pair's ratio is that of the two medians. Every call decodes at the same cache lengths:
    the first forward at a length the process has not seen costs ~20-45 ms more (H100 and H200, either adapter), so
    a cache grown across calls made whichever side ran first in a pair the slow one. Decode is host-bound, and
    subprocesses minutes apart see different host speeds; two adapters timed back to back see the same. ``cached``:
    a third side, the DoRA adapter under ``peft.helpers.DoraCaching`` (its prefill computes the norm, the steps
    reuse it), in every round (:func:`alternate`'s ``cached_*`` fields)."""
    mode = point["mode"]
    add_lora_twin(model, cfg, point)
    model.eval()
    ids, _ = make_inputs(cfg, device)
    token, timer, kv = ids[:, :1], Timer(device), cache_kwarg(model)

    @torch.no_grad()
    def step_ms(adapter: str, caching=contextlib.nullcontext) -> float:
        from transformers import DynamicCache

        model.set_adapter(adapter)
        cache, times = DynamicCache(config=model.config), []
        with precision_ctx(mode, device), caching():
            model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kv: cache})
            for _ in range(steps):
                with timer.region(times):
                    model(input_ids=token, use_cache=True, **{kv: cache})
        return statistics.median(times)

    sides = {"dora": lambda: step_ms("default"), "lora": lambda: step_ms(TWIN)}
    if cached:
        from peft.helpers import DoraCaching

        sides["cached"] = lambda: step_ms("default", DoraCaching)
    out = alternate("decode_step_paired", sides, pairs)
    model.set_adapter("default")
    model.train()
    return out


def add_lora_twin(model, cfg, point: dict) -> None:
    """The plain-LoRA adapter ``TWIN`` beside the point's DoRA adapter (same rank, targets, dropout and seeded A and
    B), once per wrapped model; the DoRA adapter stays the active one."""
    if TWIN in model.peft_config:
        return
    twin = lora_config(point["rank"], False, point["modules"], point["dropout"])
    with torch.device(model.device):
        model.add_adapter(TWIN, twin, autocast_adapter_dtype=(point["mode"] in FP32_ADAPTER_MODES))
    if point["mode"] == "bf16":
        model.to(torch.bfloat16)
    seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"], adapter=TWIN)


def train_step_paired(model, cfg, point: dict, device, pairs: int) -> dict:
    """The training step (forward with the model's gradient checkpointing, backward, AdamW step) of the DoRA adapter
    against a plain-LoRA twin adapter on the same base model (:func:`add_lora_twin`), in ABBA pairs
    (:func:`alternate`), each side with its own optimizer over its own adapter's tensors. At small ranks and few
    tokens a step is host-bound, and a host's speed drifts by up to 2x within a minute: the ``train`` records of the
    DoRA and LoRA subprocesses can land in different phases, two steps back to back share one. Every step's
    gradients are proved (:class:`GradProof`, per side) and the record keeps both proofs."""
    add_lora_twin(model, cfg, point)
    ids, labels = make_inputs(cfg, device)

    def loss():
        with precision_ctx(point["mode"], device):
            return model(input_ids=ids, labels=labels, use_cache=False).loss

    # two warm-up steps per side, as the ``train`` measure takes: with one, the first timed DoRA step captured the
    # norm graphs (H200, llama1b grid: every point's first pair ratio 1.2-1.5x its others)
    out, proofs = train_pairs(model, {"dora": "default", "lora": TWIN}, loss, device, pairs, 2, 1e-6,
                              "train_step_paired")  # fmt: skip
    out["grad_proof"], out["lora_grad_proof"] = proofs["dora"], proofs["lora"]
    if not out["lora_grad_proof"]["ok"]:  # a LoRA side that did not train makes no ratio either
        out["grad_proof"] = dict(out["grad_proof"], ok=False)
    return out


def timed_step(timer, model, optimizer, proof, loss) -> float:
    """One training step's ms for the paired measures: ``model``'s gradients dropped untimed, then ``loss()``, its
    backward and the optimizer step timed (``timer.region``), the step's gradients proved (``proof``)."""
    model.zero_grad(set_to_none=True)
    times: list = []
    with timer.region(times):
        loss().backward()
        optimizer.step()
    proof()
    return times[0]


def train_pairs(model, adapters: dict, loss, device, pairs: int, warmup: int, lr: float, name: str):
    """Training steps of two adapters of ``model`` (``adapters``: side name -> adapter name, the first the one left
    active afterwards) in ABBA pairs (:func:`alternate`), each side with its own AdamW over its own adapter's tensors
    (``set_adapter`` makes only the active adapter's tensors require gradients): ``loss()`` under the active adapter,
    its backward and the optimizer step are timed, gradients dropped untimed before; every step's gradients proved
    per side (:class:`GradProof`). Returns the paired record and ``{side: proof}``."""
    model.train()
    timer, sides = Timer(device), {}
    for side, adapter in adapters.items():
        model.set_adapter(adapter)
        params = [p for p in model.parameters() if p.requires_grad]
        sides[side] = (adapter, torch.optim.AdamW(params, lr=lr, foreach=True), GradProof(model))

    def step_ms(side: str) -> float:
        adapter, optimizer, proof = sides[side]
        model.set_adapter(adapter)
        return timed_step(timer, model, optimizer, proof, loss)

    out = alternate(name, {side: lambda side=side: step_ms(side) for side in sides}, pairs, warmup=warmup)
    proofs = {side: proof.result() for side, (_, _, proof) in sides.items()}
    model.set_adapter(next(iter(adapters.values())))
    model.zero_grad(set_to_none=True)
    sides.clear()  # the optimizers and their state
    release()
    return out, proofs


def infer_step_paired(model, cfg, point: dict, device, pairs: int, cached: bool = False) -> dict:
    """The inference forward (eval, no autograd, the point's batch and sequence) of the DoRA adapter against a
    plain-LoRA twin adapter on the same base model (:func:`add_lora_twin`), in ABBA pairs (:func:`alternate`, two
    warm-up calls per side). At the grid's small points the forward is host-bound: the ``infer`` records of the DoRA
    and LoRA subprocesses land in different phases of a host whose speed drifts by up to 2x within a minute (one
    profiled LoRA forward took 9.6 and 13.1 ms seconds apart, qwen1.5b r8 seq 512, H100 machine), two forwards back
    to back share one. ``cached``: a third side, the DoRA adapter under
    ``peft.helpers.DoraCaching`` (the norm of its first cached forward kept until ``train()``)."""
    add_lora_twin(model, cfg, point)
    model.eval()
    ids, _ = make_inputs(cfg, device)
    timer = Timer(device)

    @torch.no_grad()
    def forward_ms(adapter: str, caching=contextlib.nullcontext) -> float:
        model.set_adapter(adapter)
        times: list = []
        with timer.region(times), precision_ctx(point["mode"], device), caching():
            model(input_ids=ids, use_cache=False)
        return times[0]

    sides = {"dora": lambda: forward_ms("default"), "lora": lambda: forward_ms(TWIN)}
    if cached:
        from peft.helpers import DoraCaching

        sides["cached"] = lambda: forward_ms("default", DoraCaching)
    out = alternate("infer_step_paired", sides, pairs, warmup=2)
    model.set_adapter("default")
    model.train()
    return out


def cache_kwarg(model) -> str:
    """The causal LM forward's name for its KV cache: ``cache`` from transformers 5.24 on, ``past_key_values`` before
    (that name is removed in 5.40)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.get_base_model().forward).parameters else "past_key_values"


def task_grid(spec, impl, device, records: list, errors: list, flush) -> list:
    """The grid's points, one model shape after the other (:func:`grid_shape`)."""
    for shape, cfg in spec["grid"]["models"].items():
        points = [p for p in spec["grid"]["points"] if p["shape"] == shape]
        grid_shape(spec, impl, device, cfg, points, records, errors, flush)
        release()  # the shape's base model is gone with grid_shape's frame
    return records


def grid_shape(spec, impl, device, cfg: dict, points: list, records: list, errors: list, flush) -> None:
    """One model shape's grid points. Its base model is built once; each point wraps it with fresh adapters
    (targets, rank, dropout, precision mode), takes its measures and unloads them again, so that no adapter, hook or
    cached norm of one point reaches the next. A point that fails is reported and the next one runs."""
    grid = spec["grid"]
    base = build_base(cfg, device, torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for point in points:
        t0, model = time.perf_counter(), None
        pcfg = dict(cfg, seq=point["seq"], batch=point["batch"], loss_tokens=point["seq"] // 4)
        measures = [m for m in spec["measures"] if m != "train_accum4" or point["accum4"]]
        try:
            model = wrap(base, pcfg, point["rank"], impl, point["mode"], point["modules"], point["dropout"])
            seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
            res = speed_rank(model, pcfg, point["mode"], device, measures, spec["warmup"], spec["repeats"])
            if "train_step_paired" in measures:
                res["train_step_paired"] = train_step_paired(model, pcfg, point, device, grid["train_pairs"])
            if "infer_step_paired" in measures:
                res["infer_step_paired"] = infer_step_paired(
                    model, pcfg, point, device, grid["train_pairs"], cached=grid.get("cached", False)
                )
            if "decode_step_paired" in measures:
                res["decode_step_paired"] = decode_step_paired(
                    model, pcfg, point, device, **grid["decode"], cached=grid.get("cached", False)
                )
            where = {k: point[k] for k in ("mode", "rank", "shape", "seq", "batch", "targets", "dropout")}
            for name, r in res.items():
                records.append({"impl": impl["name"], "point": point["label"], **where, **r, "measure": name})
            line = ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in res.items())
            print(f"[{impl['name']}] {point['label']}: {line} ms ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception:
            err = traceback.format_exc()
            print(err, file=sys.stderr, flush=True)
            errors.append({"task": "speed", "point": point["label"], "error": err[-3000:]})
        finally:
            if model is not None:
                base = model.unload()
                base.disable_input_require_grads()  # PEFT hooks the input embeddings at every wrap
                del model
            release()
            flush()
        if any(hasattr(m, "lora_A") for m in base.modules()):
            raise RuntimeError(f"adapter layers left on the base model after {point['label']}")


def _sample(t: torch.Tensor, k: int) -> torch.Tensor:
    """``k`` evenly spaced elements of the flattened tensor (all of it when smaller or ``k`` is 0), fp32, CPU."""
    flat = t.detach().reshape(-1)
    if 0 < k < flat.numel():
        flat = flat[torch.linspace(0, flat.numel() - 1, k, device=flat.device).long()]
    return flat.float().cpu()


def task_fidelity(spec, impl, cfg, device, workdir: Path) -> dict:
    """Logits (a subsample of rows of the loss window) and sampled gradients, one ``.pt`` per mode."""
    fid = spec["fidelity"]
    ids, labels = make_inputs(cfg, device)
    rows = torch.linspace(cfg["seq"] - cfg["loss_tokens"], cfg["seq"] - 1, fid["rows"]).long()
    files = {}
    # fp32 is the reference: ours eager, with upstream in fp32 as a cross-check of the reference itself
    modes = [m for m in fid["modes"] if m != "fp32" or impl["name"] in ("ours_eager", "upstream")]
    for mode in modes:
        dtype = torch.float32 if mode == "fp32" else torch.bfloat16
        base = build_base(cfg, device, torch.bfloat16)
        if mode == "fp32":
            base = base.float()  # the same bf16-initialised weights, exactly, in fp32
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = wrap(base, cfg, fid["rank"], impl, mode)
        seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
        model.train()
        with precision_ctx(mode, device):
            out = model(input_ids=ids, labels=labels, use_cache=False)
        out.loss.backward()
        grads = {"lora_A": [], "lora_B": [], "magnitude": []}
        for name, p in sorted(model.named_parameters()):
            if p.grad is None:
                continue
            kind = param_kind(name)
            full = kind == "magnitude"  # [d_out] per module: small enough to keep whole
            grads[kind].append(p.grad.float().reshape(-1).cpu() if full else _sample(p.grad, fid["grad_sample"]))
        payload = {
            "logits": out.logits[0, rows.to(device)].detach().float().cpu(),
            "loss": out.loss.item(),
            "grads": {k: torch.cat(v) if v else torch.empty(0) for k, v in grads.items()},
            "dtype": str(dtype),
        }
        path = workdir / f"fidelity_{impl['name']}_{mode}.pt"
        torch.save(payload, path)
        files[mode] = str(path)
        print(f"[{impl['name']}] fidelity {mode}: loss {payload['loss']:.6f}", flush=True)
        release(model, base, out)
    return files


def task_convergence(spec, impl, cfg, device) -> dict:
    """Train a small model on the quickstart's counting task; per-step losses for each seed."""
    conv = spec["convergence"]
    ccfg = dict(cfg, config_kwargs=conv["config_kwargs"])
    vocab = conv["config_kwargs"]["vocab_size"]
    mode = conv["mode"]
    runs, counts0 = {}, tier_counts()
    for seed in conv["seeds"]:
        ccfg["seed"] = seed
        base = build_base(ccfg, device, torch.float32 if mode == "fp32" else torch.bfloat16)
        model = wrap(base, ccfg, conv["rank"], impl, mode)
        seed_adapters(model, seed, conv["config_kwargs"]["initializer_range"], zero_b=True)
        if impl.get("perturb_ulp"):
            nudge_magnitudes(model)
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=conv["lr"])
        gen = torch.Generator().manual_seed(seed)
        losses = []
        t0 = time.perf_counter()
        for _ in range(conv["steps"]):
            start = torch.randint(0, vocab, (conv["batch"], 1), generator=gen)
            stride = torch.randint(1, 4, (conv["batch"], 1), generator=gen)
            batch = ((start + stride * torch.arange(conv["seq"])) % vocab).to(device)
            with precision_ctx(mode, device):
                loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        print(
            f"[{impl['name']}] convergence seed {seed}: loss {losses[0]:.4f} -> {losses[-1]:.4f} "
            f"in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        runs[str(seed)] = losses
        release(model, base, opt)
    return {"losses": runs, "tiers": _delta(counts0, tier_counts())}


# Names of the profiler ranges put around the DoRA pieces; the rest of a step is the base model.
COMPONENTS = {"dora.norm": "norm", "dora.compose": "compose", "lora.A": "lora_A", "lora.B": "lora_B"}
# Kernel (or, on CPU, op) name patterns for a coarse split of the step's time; first match wins.
KERNEL_CLASSES = (
    ("nccl", r"nccl"),  # collectives (profile_multi_gpu.py): before "reduction", which ReduceScatter would match
    ("attention", r"flash|fmha|attention|sdpa"),
    ("triton", r"triton"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|aten::mm|aten::addmm|aten::bmm|aten::linear"),
    ("reduction", r"reduce|norm|sum"),
    ("copy_cast", r"copy|memcpy|memset|cast|fill"),
    ("elementwise", r"elementwise|vectorized|aten::(mul|add|sub|div)"),
)


def kernel_class(name: str) -> str:
    import re

    for label, pattern in KERNEL_CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def _annotate(model) -> None:
    """Put ``record_function`` ranges around our norm (computed, replayed or reused) and composition (the output
    nodes and kernels, the compose tiers), or around upstream's LoRA matmuls. For ours only class and module
    attributes are wrapped: a wrapper on a module instance (``lora_A.forward``) would make it a non-plain Linear and
    change the dispatch being profiled (the LoRA matmuls then run inside the composition's range)."""
    from torch.profiler import record_function

    def ranged(label, fn):
        def inner(*a, **k):
            with record_function(label):
                return fn(*a, **k)

        return inner

    from peft.tuners.lora import dora

    if not hasattr(dora, "factored_row_norm"):  # upstream's PEFT (its DoRA or plain LoRA): the LoRA matmuls
        for module in model.modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                for key, label in (("lora_A", "lora.A"), ("lora_B", "lora.B")):
                    sub = getattr(module, key)["default"]
                    sub.forward = ranged(label, sub.forward)
        return
    from peft.tuners.lora import dora_fused

    cls = dora.DoraLinearLayer
    if getattr(cls, "_bench_ranged", False):
        return
    cls._forward_norm = ranged("dora.norm", cls._forward_norm)
    cls._compose = ranged("dora.compose", cls._compose)
    dora_fused.run_fused_output = ranged("dora.compose", dora_fused.run_fused_output)
    node = dora_fused.FusedDoRALinearFunction
    node.apply = ranged("dora.compose", node.apply)  # lora_B's matmul and the output, one node
    cls._bench_ranged = True


def task_profile(spec, impl, cfg, device) -> dict:
    """torch.profiler over one training step and one inference forward: the kernels' time by class, the top kernels
    and the time inside each annotated DoRA component."""
    prof_spec = spec["profile"]
    mode = prof_spec["mode"]
    base = build_base(cfg, device, torch.bfloat16)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = wrap(base, cfg, prof_spec["rank"], impl, mode)
    seed_adapters(model, cfg["seed"], cfg["config_kwargs"]["initializer_range"])
    _annotate(model)
    ids, labels = make_inputs(cfg, device)

    def step():
        model.zero_grad(set_to_none=True)
        with precision_ctx(mode, device):
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()

    @torch.no_grad()
    def infer():
        with precision_ctx(mode, device):
            model(input_ids=ids, use_cache=False)

    out = {"mode": mode, "rank": prof_spec["rank"]}
    model.train()
    out["train"] = _profile(step, device, prof_spec["top"])
    model.zero_grad(set_to_none=True)
    model.eval()
    out["infer"] = _profile(infer, device, prof_spec["top"])
    return out


def _profile(fn, device, top: int) -> dict:
    """Two warm-up calls of ``fn``, then one under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    counts0 = tier_counts()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()

    def dev_time(evt) -> float:  # microseconds of device work launched inside this CPU event (children included)
        if not cuda:
            return evt.cpu_time_total
        return getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)

    events = prof.events()
    components = {v: 0.0 for v in COMPONENTS.values()}
    calls = {v: 0 for v in COMPONENTS.values()}
    for evt in events:
        if evt.name in COMPONENTS and evt.device_type == torch.autograd.DeviceType.CPU:
            components[COMPONENTS[evt.name]] += dev_time(evt) / 1e3
            calls[COMPONENTS[evt.name]] += 1
    # Per name: (ms, count). On a GPU, the kernels themselves (user-annotation ranges on the device timeline are
    # not kernels); on a CPU, each op's self time.
    per_name: dict = {}
    if cuda:
        for evt in events:
            if evt.device_type != torch.autograd.DeviceType.CUDA or getattr(evt, "is_user_annotation", False):
                continue
            if evt.name in COMPONENTS:
                continue
            ms, n = per_name.get(evt.name, (0.0, 0))
            per_name[evt.name] = (ms + evt.time_range.elapsed_us() / 1e3, n + 1)
    else:
        for row in prof.key_averages():
            if row.key not in COMPONENTS:
                per_name[row.key] = (row.self_cpu_time_total / 1e3, row.count)
    kernels = [{"name": k[:160], "ms": ms, "count": n} for k, (ms, n) in per_name.items()]
    total_ms = sum(k["ms"] for k in kernels)
    if cuda and not kernels:
        raise RuntimeError("the profiler recorded no CUDA kernels")
    kernels.sort(key=lambda k: -k["ms"])
    classes = {}
    for k in kernels:
        classes[kernel_class(k["name"])] = classes.get(kernel_class(k["name"]), 0.0) + k["ms"]
    return {
        "time_basis": "cuda kernel time" if cuda else "cpu op time (cpu smoke run)",
        "total_ms": total_ms,
        "components_forward_ms": components,
        "component_calls": calls,
        "by_kernel_class_ms": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "top_kernels": kernels[:top],
        "tiers": _delta(counts0, tier_counts()),
    }


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    impl, cfg = spec["impl"], spec["model"]
    device = torch.device(spec["device"])
    result = {"impl": impl["name"], "errors": []}
    try:
        result["info"] = check_peft(impl)
    except Exception:
        result["errors"].append({"task": "import", "error": traceback.format_exc()[-3000:]})
        Path(spec["result"]).write_text(json.dumps(result))
        print(result["errors"][-1]["error"], file=sys.stderr)
        return 2
    workdir = Path(spec["workdir"])

    def flush():
        Path(spec["result"]).write_text(json.dumps(result))

    def speed():
        records = result.setdefault("speed", [])
        if "grid" in spec:
            return task_grid(spec, impl, device, records, result["errors"], flush)
        return task_speed(spec, impl, cfg, device, records, flush)

    tasks = {
        "speed": speed,
        "fidelity": lambda: task_fidelity(spec, impl, cfg, device, workdir),
        "convergence": lambda: task_convergence(spec, impl, cfg, device),
        "profile": lambda: task_profile(spec, impl, cfg, device),
    }
    for task in spec["tasks"]:
        try:
            result[task] = tasks[task]()
        except Exception:
            err = traceback.format_exc()
            print(err, file=sys.stderr, flush=True)
            result["errors"].append({"task": task, "error": err[-3000:]})
            release()
        flush()  # after every task, so a timeout keeps what ran
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
