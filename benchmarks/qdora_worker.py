"""One implementation's share of the QDoRA benchmark, run in its own process by ``bench_qdora.py``.

Started as ``python qdora_worker.py SPEC.json``. ``task: build`` saves the seeded random bf16 model; ``task: bench``
loads each quantization once, then per rank, precision mode and adapter kind wraps it, measures and unloads, and at
the end (round 0) runs the fidelity forward/backward (in upstream's process also the fp32 reference). The parent puts
the implementation's ``--target`` install first on ``PYTHONPATH``; :func:`model_worker.check_peft` refuses any other.
Results go to ``spec["result"]`` after every configuration, so a process killed by the time limit keeps what ran.

Nothing here imports from the repository root: the script directory is ``sys.path[0]``, so the overlay tree there
cannot shadow the installed package.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import sys
import time
import traceback
from pathlib import Path

import model_worker as mw
import torch


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUANTIZED_LAYERS = ("Linear4bit", "Linear8bitLt")
MEASURES = ("train", "infer", "decode")
GRAD_KINDS = ("lora_A", "lora_B", "magnitude")


# ---------------------------------------------------------------------------------------------------------------
# Model, quantization, adapters.
# ---------------------------------------------------------------------------------------------------------------


def build_model(spec: dict) -> None:
    """The seeded random bf16 model, built on the benchmark's device (seconds on a GPU, a minute for the 8B shape
    on two CPU cores) and saved for every worker to quantize."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_dict(spec["model"])  # as a config.json would be read: rope_scaling converted
    torch.manual_seed(spec["seed"])
    with torch.device(spec["device"]):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(spec["dir"])


def load_quantized(model_dir: str, quant: str, device: torch.device):
    """nf4/fp4: 4-bit with double quantization and bf16 compute; int8: LLM.int8. Then PEFT's QLoRA preparation:
    everything frozen, the non-quantized weights upcast to fp32, gradient checkpointing (its defaults)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from peft import prepare_model_for_kbit_training

    if quant == "int8":
        bnb = BitsAndBytesConfig(load_in_8bit=True)
    else:
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.bfloat16)  # fmt: skip
    device_map = {"": 0 if device.type == "cuda" else "cpu"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=bnb, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa", device_map=device_map)  # fmt: skip
    for module in model.modules():  # the CPU smoke: no in-place CPU repacking (AVX512-BF16 CPUs; it needs 32 | d_out)
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    return prepare_model_for_kbit_training(model)


def quantized_layers(model) -> int:
    return sum(type(m).__name__ in QUANTIZED_LAYERS for m in model.modules())


def to_fp32_reference(model):
    """Every bnb layer replaced by an fp32 ``nn.Linear`` holding its dequantized weight: the reference computes with
    the very weights the quantized runs use and differs from them only in arithmetic precision."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__ in QUANTIZED_LAYERS:
                w = mw.dequantized(child).float()
                dense = torch.nn.Linear(w.shape[1], w.shape[0], bias=child.bias is not None, device=w.device)
                dense.weight.data.copy_(w)
                if child.bias is not None:
                    dense.bias.data.copy_(child.bias.float())
                setattr(parent, name, dense.requires_grad_(False))
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:  # prepare_model_for_kbit_training upcast everything else already
        raise RuntimeError(f"the fp32 reference still holds {dtypes}")
    return model


def lora_config(rank: int, dora: bool):
    """LoRA (lora_alpha = 2r) on the seven projections; adapters in fp32 (PEFT's default autocast_adapter_dtype)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(PROJECTIONS),
                      use_dora=dora, task_type="CAUSAL_LM")  # fmt: skip


def wrap(base, rank: int, dora: bool):
    from peft import get_peft_model

    return get_peft_model(base, lora_config(rank, dora))


@torch.no_grad()
def seed_adapters(model, seed: int, init_range: float, adapter: str = "default") -> None:
    """A, B and the magnitudes of ``adapter`` drawn per LoRA layer's name, the same in every implementation, in the
    fp32 reference and in a twin adapter on the same layers. A ~ N(0, 1/d_in); B sized so that s·B·A·x is about a
    tenth of W·x (PEFT's B = 0 would leave A's gradient zero); magnitude = row norm of the dequantized W times
    (1 + 0.1·N(0, 1)), so that DoRA's rescaling is not the identity."""
    for name, module in sorted(model.named_modules()):
        if not hasattr(module, "lora_A") or adapter not in module.lora_A:
            continue
        a, b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        dev, (r, d_in) = a.device, a.shape
        a.copy_(torch.randn(a.shape, generator=mw._gen(dev, seed, name, "A"), device=dev) / math.sqrt(d_in))
        std = 0.1 * init_range * math.sqrt(d_in) / (module.scaling[adapter] * math.sqrt(r))
        b.copy_(torch.randn(b.shape, generator=mw._gen(dev, seed, name, "B"), device=dev) * std)
        mags = getattr(module, "lora_magnitude_vector", None)
        if mags is not None and adapter in mags:
            w = mw.dequantized(module.get_base_layer()).float()
            noise = torch.randn(w.shape[0], generator=mw._gen(dev, seed, name, "m"), device=dev)
            mags[adapter].weight.copy_(torch.linalg.vector_norm(w, dim=1) * (1 + 0.1 * noise))


def token_batch(cfg: dict, seq: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    return torch.randint(0, cfg["model"]["vocab_size"], (cfg["batch"], seq), generator=g).to(device)


# ---------------------------------------------------------------------------------------------------------------
# Measures.
# ---------------------------------------------------------------------------------------------------------------


def time_training(model, ids, cfg: dict, ctx, device) -> dict:
    """Training step, timed: forward, backward, AdamW step. Untimed after each step the gradient proof (every trainable
    tensor's gradient present, finite, non-zero), untimed before it ``zero_grad``. Peak memory over the static
    allocation (model, adapters and AdamW's state, measured after the warm-up steps); the loss of step 0."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg["lr"])
    losses = []

    def step():
        with ctx():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        if not losses:  # step 0: the seeded adapters, before any optimizer step
            losses.append(loss.detach())

    model.train()
    proof = mw.GradProof(model)
    out = mw.measure(step, device, cfg["warmup"], cfg["repeats"], lambda: opt.zero_grad(set_to_none=True), proof)
    opt.zero_grad(set_to_none=True)
    return dict(out, grad_proof=proof.result(), step0_loss=losses[0].item())


def decode_pass(model, ids, cfg: dict, timer) -> list:
    """One decode pass: ``prompt_tokens`` prefilled into a fresh KV cache, then ``decode_tokens`` one-token forwards,
    each timed (ms)."""
    from transformers import DynamicCache

    kv, cache, times = mw.cache_kwarg(model), DynamicCache(config=model.config), []
    model(input_ids=ids[:, : cfg["prompt_tokens"]], use_cache=True, **{kv: cache})
    for _ in range(cfg["decode_tokens"]):
        with timer.region(times):
            model(input_ids=ids[:, -1:], use_cache=True, **{kv: cache})
    return times


@torch.no_grad()
def time_decode(model, ids, cfg: dict, ctx, device) -> dict:
    """Per token of a one-token decode: ``decode_warmup`` untimed passes, then one timed pass (:func:`decode_pass`),
    so the timed tokens run at cache lengths the process has already seen. The first forward at a new length costs
    ~20-45 ms more (``model_worker.decode_step_paired``): with the timed tokens at new lengths, the first decode
    measured in each worker process (QDoRA's in one round, QLoRA's in the other, nf4 r = 16, H200, 2026-11-25) ran
    4-7x slower than every later one. The last warm-up pass's token times are kept (``warmup_ms``)."""
    timer, before = mw.Timer(device), mw.tier_counts()
    with ctx():
        passes = [decode_pass(model, ids, cfg, timer) for _ in range(cfg["decode_warmup"] + 1)]
    tiers = {k: v - before.get(k, 0) for k, v in mw.tier_counts().items() if v != before.get(k, 0)}
    return dict(mw.summary(passes[-1]), tiers=tiers, warmup_ms=[round(t, 3) for t in passes[-2]])


PAIRED = ("train", "infer", "decode")  # measures also timed in QDoRA/QLoRA-twin pairs (record key "<measure>_paired")


def paired_measures(model, ids, cfg: dict, ctx, device, rank: int) -> dict:
    """The training step, inference forward and per-token decode of this QDoRA model and of a QLoRA twin, each
    alternated ``cfg["pairs"]`` times in ABBA order (``model_worker.alternate``, after warm-up pairs). The twin is a
    second adapter on the same quantized layers with the same seeded A and B (no magnitude); ``set_adapter`` switches
    between them (and which of them trains), so both run on one base, in one process, seconds apart. At 1024 tokens
    a step is host-bound, and decode always is, and the host's speed drifts within a minute (QLoRA's own per-token
    time read 9.6 and 69.7 ms in two rounds of one run, nf4 r = 16, H200, 2026-11-25): the separately timed measures
    of :func:`measure_config` compare QDoRA and QLoRA a minute apart, a pair compares them back to back. A training
    side is one forward, backward and AdamW step of its adapter (its own optimizer; gradients dropped untimed
    before) and must leave every trainable gradient finite and non-zero; a decode side is the mean per token of one
    :func:`decode_pass`. The twin is deleted afterwards."""
    twin = "qlora_twin"
    model.add_adapter(twin, lora_config(rank, dora=False))
    seed_adapters(model, cfg["seed"], cfg["model"]["initializer_range"], adapter=twin)
    timer, pairs, sides = mw.Timer(device), cfg["pairs"], {"dora": "default", "lora": twin}

    def loss():
        with ctx():
            return model(input_ids=ids, labels=ids, use_cache=False).loss

    def forward_ms() -> float:
        times = []
        with timer.region(times):
            model(input_ids=ids, use_cache=False)
        return times[0]

    def per_token_ms() -> float:
        times = decode_pass(model, ids, cfg, timer)
        return sum(times) / len(times)

    def evaluation(measure, side: str):  # an eval-mode side: the adapter set, no autograd, the precision mode
        @torch.no_grad()
        def run() -> float:
            model.set_adapter(sides[side])
            model.eval()
            with ctx():
                return measure()

        return run

    out = {}
    try:
        # three warm-up pairs for training (QDoRA's first steps capture the norm graphs: with one warm-up pair the
        # first two timed QDoRA steps took 107-171 ms against 63-83 ms for the later ones, NF4 seq 1024, H100,
        # 2026-11-26), one for the forwards
        out["train_paired"], proofs = mw.train_pairs(model, sides, loss, device, pairs, 3, cfg["lr"], "train_paired")
        out["train_paired"]["grad_proof"] = proofs
        for measure, run in (("infer", forward_ms), ("decode", per_token_ms)):
            out[f"{measure}_paired"] = mw.alternate(f"{measure}_paired", {s: evaluation(run, s) for s in sides}, pairs)
    finally:
        model.set_adapter("default")
        model.delete_adapter(twin)
        mw.release()
    return out


def measure_config(model, cfg: dict, mode: str, device, paired_rank=None) -> dict:
    """Training step, inference forward (eval, no_grad, the full sequence) and one-token decode of a wrapped model;
    with ``paired_rank`` (a QDoRA model of that rank) also the three in pairs with a QLoRA twin (paired_measures)."""
    ctx = lambda: mw.precision_ctx(mode, device)  # noqa: E731
    ids = token_batch(cfg, cfg["seq"], device)
    train = time_training(model, ids, cfg, ctx, device)
    mw.release()
    model.eval()

    @torch.no_grad()
    def infer():
        with ctx():
            model(input_ids=ids, use_cache=False)

    out = {"train": train, "step0_loss": train.pop("step0_loss")}
    out["infer"] = mw.measure(infer, device, cfg["warmup"], cfg["repeats"])
    out["decode"] = time_decode(model, ids, cfg, ctx, device)
    if paired_rank is not None and cfg.get("pairs"):
        out.update(paired_measures(model, ids, cfg, ctx, device, paired_rank))
    model.train()
    return out


def fidelity_run(spec: dict, run: str, device) -> dict:
    """Logits (evenly spaced rows) and every adapter gradient of one forward/backward at the fidelity setting: this
    impl's QDoRA under autocast, or (``run == "reference"``) upstream's DoRA in fp32 on the dequantized weights."""
    cfg, fid = spec["cfg"], spec["fidelity"]
    base = load_quantized(spec["model_dir"], fid["quant"], device)
    if run == "reference":
        base = to_fp32_reference(base)
        torch.set_float32_matmul_precision("highest")  # no TF32 in the reference
    model = wrap(base, fid["rank"], True)
    seed_adapters(model, cfg["seed"], cfg["model"]["initializer_range"])
    ids = token_batch(cfg, fid["seq"], device)
    model.train()
    with mw.precision_ctx(fid["mode"] if run != "reference" else "fp32", device):
        out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {k: [] for k in GRAD_KINDS}
    for name, p in sorted(model.named_parameters()):
        if p.requires_grad:
            grads[mw.param_kind(name)].append(p.grad.float().reshape(-1).cpu())
    rows = torch.linspace(0, fid["seq"] - 1, fid["rows"]).long().to(device)
    payload = {"logits": out.logits[0, rows].detach().float().cpu(), "loss": out.loss.item(),
               "grads": {k: torch.cat(v) for k, v in grads.items()}}  # fmt: skip
    path = Path(spec["workdir"]) / f"fidelity_{run}.pt"
    torch.save(payload, path)
    print(f"[{spec['impl']['name']}] fidelity {run}: loss {payload['loss']:.6f}", flush=True)
    mw.release(model, base, out)
    return {run: str(path)}


# ---------------------------------------------------------------------------------------------------------------
# The process.
# ---------------------------------------------------------------------------------------------------------------


def bench_quant(spec: dict, quant: str, device, result: dict, fail, flush) -> None:
    """One quantization: load it once, then per rank, mode and kind wrap, measure and unload. A configuration that
    fails is reported and the next one runs; a base that unloading did not restore ends the quantization."""
    from peft.tuners.lora import dora

    impl, cfg = spec["impl"], spec["cfg"]
    if time.time() > spec["deadline"]:
        result["skipped"].append({"impl": impl["name"], "round": spec["round"], "quant": quant, "why": "budget"})
        return
    base = load_quantized(spec["model_dir"], quant, device)
    n_quantized = quantized_layers(base)
    for i, rank in enumerate(cfg["ranks"]):
        for mode in cfg["modes"]:
            for kind in spec["kinds"][:: 1 if (i + spec["round"]) % 2 == 0 else -1]:  # first kind alternates (ABBA)
                where = dict(impl=impl["name"], round=spec["round"], quant=quant, mode=mode, rank=rank, kind=kind)
                if time.time() > spec["deadline"]:
                    result["skipped"].append(dict(where, why="budget"))
                    continue
                model, t0 = None, time.perf_counter()
                try:
                    model = wrap(base, rank, kind == "qdora")
                    seed_adapters(model, cfg["seed"], cfg["model"]["initializer_range"])
                    paired_rank = rank if kind == "qdora" else None
                    rec = dict(measure_config(model, cfg, mode, device, paired_rank), **where)
                    if kind == "qdora" and hasattr(dora, "summary"):  # ours only
                        rec["dora_summary"] = dora.summary(model)
                    rec["wall_s"] = round(time.perf_counter() - t0, 2)
                    result["records"].append(rec)
                    line = ", ".join(f"{m} {rec[m]['median_ms']:.2f}" for m in MEASURES)
                    if "decode_paired" in rec:
                        line += "; paired /QLoRA twin " + ", ".join(
                            f"{m} {rec[m + '_paired']['ratio_median']:.3f}" for m in PAIRED
                        )
                    print(f"[{impl['name']}] {quant} {mode} r={rank} {kind}: {line} ms", flush=True)
                except Exception:
                    fail("measure", **where)
                finally:
                    if model is not None:
                        base = model.unload()
                    del model
                    mw.release()
                    flush()
                if any(hasattr(m, "lora_A") for m in base.modules()) or quantized_layers(base) != n_quantized:
                    raise RuntimeError(f"unload did not restore the quantized base after {where}")


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if spec["task"] == "build":
        build_model(spec)
        return 0
    impl, device = spec["impl"], torch.device(spec["device"])
    result = {"impl": impl["name"], "round": spec["round"], "records": [], "errors": [], "skipped": []}

    def flush():
        Path(spec["result"]).write_text(json.dumps(result))

    def fail(task: str, **where):  # inside an except block
        err = traceback.format_exc()
        print(err, file=sys.stderr, flush=True)
        result["errors"].append(
            dict({"impl": impl["name"], "round": spec["round"]}, **where, task=task, error=err[-3000:])
        )
        flush()

    try:
        import peft

        info = mw.check_peft(impl)
        info["peft_file"] = peft.__file__
        info["env"].update({n: importlib.metadata.version(n) for n in ("bitsandbytes", "accelerate")})
        result["info"] = info
    except Exception:
        fail("import")
        return 2
    for quant in spec["cfg"]["quants"]:
        try:
            bench_quant(spec, quant, device, result, fail, flush)
        except Exception:
            fail("quant", quant=quant)
        mw.release()
    if spec["fidelity"] and time.time() > spec["deadline"]:
        result["skipped"].append({"impl": impl["name"], "round": spec["round"], "task": "fidelity", "why": "budget"})
    elif spec["fidelity"]:
        result["fidelity"] = {}
        for run in [impl["name"]] + ([] if impl["ours"] else ["reference"]):
            try:
                result["fidelity"].update(fidelity_run(spec, run, device))
            except Exception:
                fail("fidelity", run=run)
    flush()
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
