"""Worker for the sharded-training tests (``test_dora_fsdp2_cpu.py``, ``test_dora_deepspeed_cpu.py``,
``test_dora_fsdp2_gpu.py``): DoRA training under FSDP2 (``fully_shard``), FSDP1 or DeepSpeed ZeRO-2/3, started by
``torchrun`` (the tests fork it from ``fork_launcher.py`` with torchrun's variables, on CUDA where a forked process
can use it); on CPU with gloo
(DeepSpeed's CPU accelerator), with ``--device cuda`` on GPUs with NCCL. With one
process it trains the same model unsharded (the reference), unless ``--fsdp 1``.

    torchrun --standalone --nproc_per_node 2 sharded_training_worker.py OUT [--engine fsdp2|fsdp1|zero2|zero3] \
        [--reshard 0|1] [--checkpointing 0|1] [--optim adamw|sgd] [--dora 0|1] [--zero-test 0|1]

Every rank trains a tiny Llama with DoRA on all linear layers (fp32, AdamW or SGD, 20 steps) on its share of a fixed
global batch (rank r takes rows r, r + N, ...; every token has a label, so the mean of the ranks' losses is the global
batch's loss, and the engines average the gradients), then runs eval forwards around in-place edits of B and m.
Rank 0 saves to OUT the losses, the norm counters per step, the trained adapter (gathered, loaded into an unsharded
model, ``get_peft_model_state_dict``), the eval logits and counters, under FSDP2 each norm against the whole norm,
and on CUDA the host syncs per step. It runs under upstream PEFT too (no counters there).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import os
import sys
import warnings
from typing import Optional

import torch
import torch.distributed as dist


STEPS, GLOBAL_BATCH, SEQ, VOCAB = 20, 4, 16, 128


def build(dora: bool = True, quant: Optional[str] = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=99, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
        vocab_size=VOCAB, max_position_embeddings=64,
    )  # fmt: skip
    base = LlamaForCausalLM(config)
    if quant is not None:
        quantize(base, quant)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=dora, init_lora_weights=False)
    return get_peft_model(base, lora)


def _bench_worker():
    """``benchmarks/multi_gpu_worker``, whose QDoRA model and sharded-norm check these tests share."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    try:
        import multi_gpu_worker
    finally:
        sys.path.pop(0)
    return multi_gpu_worker


def quantize(base, kind: str) -> None:
    """Every projection of the decoder layers a bitsandbytes 4-bit Linear in fp32 storage and compute (fp32 keeps the
    comparison with one process tight): the multi-GPU benchmark's ``multi_gpu_worker.quantize``."""
    _bench_worker().quantize(base, kind, "cpu", torch.float32)


def arguments() -> argparse.ArgumentParser:
    """The worker's options (the tests drop flags given at their defaults, so equal runs share one launch)."""
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--reshard", type=int, default=1)
    p.add_argument("--checkpointing", type=int, default=0)
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--dora", type=int, default=1, help="0: plain LoRA, the same engine's baseline")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per process")
    p.add_argument("--fsdp", type=int, default=-1, help="1: shard even in one process (-1: with > 1)")
    p.add_argument("--engine", choices=("fsdp2", "fsdp1", "zero2", "zero3"), default="fsdp2",
                   help="fsdp2: fully_shard per decoder layer and the root; fsdp1: FullyShardedDataParallel per "
                        "decoder layer (use_orig_params, FULL_SHARD or with --reshard 0 SHARD_GRAD_OP); zero2/zero3: "
                        "DeepSpeed (on CPU its CPU accelerator)")  # fmt: skip
    p.add_argument("--zero-test", type=int, default=0, help="1: check the sharded magnitudes' zero-test prefetch")
    p.add_argument("--resume", type=int, default=0, help="1: a sharded checkpoint, a detour and a resume mid-run")
    p.add_argument("--edit-partitions", type=int, default=0,
                   help="1 (ZeRO-3): every odd step scales each rank's partition of every lora_A in place between the "
                        "forward and the backward, so that the checkpoint's recompute reads other A than its forward "
                        "did")  # fmt: skip
    p.add_argument("--b-columns", type=int, default=0, help="1: FSDP2 shards every lora_B over its columns")
    p.add_argument(
        "--fsdp1-policy",
        choices=("layers", "peft"),
        default="layers",
        help="peft: PEFT's fsdp_auto_wrap_policy, as accelerate and the Trainer apply it to a PEFT model "
        "(every lora_A, lora_B and magnitude module its own FSDP unit, besides the decoder layers)",
    )
    p.add_argument(
        "--fsdp1-orig-params",
        type=int,
        default=1,
        help="FSDP1's use_orig_params (0: flat parameters, PEFT's documented FSDP recipe)",
    )
    p.add_argument("--quant", choices=("nf4", "fp4"), help="QDoRA: the projections 4-bit (bitsandbytes, fp32 storage)")
    p.add_argument("--mp", type=int, default=0, help="1: FSDP2 MixedPrecisionPolicy(param bf16, reduce fp32)")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps (the equality tests take 20)")
    p.add_argument(
        "--emulate-graphs", type=int, default=0, help="1 (CPU): norm graphs as on CUDA (_emulate_norm_graphs)"
    )
    return p


def main() -> int:
    args = arguments().parse_args()
    if args.emulate_graphs:
        _emulate_norm_graphs()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    fsdp = world > 1 if args.fsdp < 0 else bool(args.fsdp)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    zero = args.engine.startswith("zero") and (fsdp or world > 1)
    if zero:
        if args.device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        if args.device == "cpu":
            # DeepSpeed's CPU backend would build its shared-memory all-reduce op (a C++ build, ~1 min on CI's two
            # cores) before falling back to gloo's collectives anyway for these tensors; the op is a speed-up only
            import deepspeed.comm.torch  # noqa: F401  (the package's own ``torch`` name is the torch module)

            sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

        deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    elif fsdp or world > 1:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    model = build(bool(args.dora), args.quant)
    if args.device == "cuda":
        model = model.cuda()
    if args.checkpointing:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.base_model.model.enable_input_require_grads()
    if fsdp and args.engine == "fsdp1":
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        strategy = ShardingStrategy.FULL_SHARD if args.reshard else ShardingStrategy.SHARD_GRAD_OP
        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        if args.fsdp1_policy == "peft":
            from peft.utils.other import fsdp_auto_wrap_policy

            policy = fsdp_auto_wrap_policy(model)
        device_id = torch.cuda.current_device() if args.device == "cuda" else torch.device("cpu")
        model = FullyShardedDataParallel(model, auto_wrap_policy=policy, sharding_strategy=strategy,
                                         use_orig_params=bool(args.fsdp1_orig_params), device_id=device_id)  # fmt: skip
    elif fsdp and args.engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(args.device, (world,))
        kwargs = {"mesh": mesh, "reshard_after_forward": bool(args.reshard)}
        if args.mp:  # fp32 parameters, gathered and computed in bf16, gradients reduced in fp32
            from torch.distributed.fsdp import MixedPrecisionPolicy

            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.b_columns:  # B sharded over its columns (r): the norm's rows are no longer split like W's
            from torch.distributed.tensor import Shard

            b_ids = {id(p) for n, p in model.named_parameters() if "lora_B" in n}
            kwargs["shard_placement_fn"] = lambda p: Shard(1) if id(p) in b_ids else None
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    model.train()
    if args.zero_test:
        result = zero_test_check(model, rank)
        if rank == 0:
            torch.save({"zero_test": result, "world": world}, args.out)
        dist.destroy_process_group()
        return 0
    params = [q for q in model.parameters() if q.requires_grad]
    # AdamW as users run it; SGD, whose update is linear in the gradient, for a tight parameter comparison (Adam's
    # normalisation turns reduction-order noise in near-zero gradients into ~1e-3 parameter differences)
    opt = torch.optim.AdamW(params, lr=1e-3) if args.optim == "adamw" else torch.optim.SGD(params, lr=0.05)
    if zero:
        config = {
            "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": int(args.engine[-1])},
            "zero_allow_untested_optimizer": True,
        }
        model, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    norm_counts = _norm_counts()
    zero_tests = _count_zero_tests()
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=gen)[rank::world] for _ in range(args.steps)]
    losses, counts = [], []
    syncs = []  # host syncs in each step's forward and backward (CUDA only): counted by the sync debug mode

    def train_step(ids: torch.Tensor, count_syncs: bool, edit: bool = False) -> float:
        ids = ids.to(args.device)
        with _counting_syncs(count_syncs, syncs):
            loss = model(input_ids=ids, labels=ids).loss
            if edit:
                _edit_partitions(model)
            model.backward(loss) if zero else loss.backward()
        if zero:
            model.step()  # the optimizer step and zeroing the gradients
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        return loss.cpu().item()

    for step in range(args.steps):
        if args.resume and step == args.steps // 2:
            # save (torch.distributed.checkpoint, sharded), train on other data, load into the live model and
            # optimizer, go on: the next losses must be those of the run without the detour
            _checkpoint(model, opt, args.out + ".ckpt", save=True)
            for ids in data[:3]:
                train_step(ids.flip(1), False)
            _checkpoint(model, opt, args.out + ".ckpt", save=False)
        norm_counts.clear()
        zero_tests["calls"] = 0
        edit = bool(args.edit_partitions and step % 2)
        count_syncs = args.device == "cuda" and step > 0  # step 0 sets up caches, kernels
        losses.append(train_step(data[step], count_syncs, edit))
        counts.append(dict(norm_counts, zero_tests=zero_tests["calls"], **_tiers(), **_unit_rows()))
    from peft import get_peft_model_state_dict

    with _gathered(list(model.parameters())):  # ZeRO-3's partitions gathered (FSDP's DTensors: full_tensor)
        full = {name.removeprefix("module."): (t.full_tensor() if hasattr(t, "full_tensor") else t).cpu().clone()
                for name, t in model.state_dict().items()}  # fmt: skip
    if args.quant is None:
        unsharded = build(bool(args.dora))  # the gathered state in an unsharded model (FSDP1 renames modules)
        unsharded.load_state_dict(full)
        adapter = get_peft_model_state_dict(unsharded)
    else:  # the quantized base's state holds bitsandbytes' packed storage and statistics: the adapter's tensors only
        adapter = {k: v for k, v in full.items() if "lora_" in k}
    # edits the adapter: after the trained one is saved; an edit inside the forward where the engine's gathered copy
    # is what the forward reads (unsharded, FSDP2), not FSDP1's or ZeRO-3's shards
    evaluated = evaluate(model, world, edit_in_forward=not (fsdp or zero) or args.engine == "fsdp2")
    ours = importlib.util.find_spec("peft.tuners.lora.dora_dist") is not None  # upstream has no sharded norm
    norm_check = check_norms(model) if ours and fsdp and args.engine == "fsdp2" and args.quant is None else None
    if rank == 0:
        torch.save({"losses": losses, "adapter": adapter, "world": world, "fsdp": fsdp and args.engine,
                    "counts": counts, "eval": evaluated, "norm_check": norm_check, "syncs": syncs},
                   args.out)  # fmt: skip
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


@torch.no_grad()
def evaluate(model, world: int, edit_in_forward: bool) -> dict:
    """Eval forwards before and after in-place edits of every B, then of every magnitude (no optimizer step between,
    so only version counters can tell a kept norm or scale that it is stale), and once more (reused). With
    ``edit_in_forward``, one more (``edit_in_forward``) whose every value projection scales its B on entering its
    forward: under FSDP2 after the first DoRA Linear of its layer computed the norms of all of them
    (``dora_dist.UnitNorms``), so the norm waiting for it is stale."""
    norm_counts = _norm_counts()
    model.eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    ids = ids.to(next(model.parameters()).device)
    logits, counts = [model(input_ids=ids).logits.float().cpu()], []
    for edited, factor in (("lora_B", 1.5), ("lora_magnitude_vector", 0.75), (None, 1.0)):
        for name, param in model.named_parameters():
            if edited is not None and edited in name:
                with _gathered([param], modifier_rank=0):
                    param.mul_(factor)
        norm_counts.clear()
        logits.append(model(input_ids=ids).logits.float().cpu())
        counts.append(dict(norm_counts))
    out = {"logits": logits, "counts": counts}
    if edit_in_forward:

        def edit(module, args):
            module.lora_B["default"].weight.mul_(1.25)

        for name, param in model.named_parameters():
            if "lora_B" in name:  # every norm stale: the layers' first DoRA Linears compute all of them again
                param.mul_(0.8)
        hooks = [m.register_forward_pre_hook(edit) for n, m in model.named_modules() if n.endswith("attn.v_proj")]
        norm_counts.clear()
        out["edit_in_forward"] = {"logits": model(input_ids=ids).logits.float().cpu(), "counts": dict(norm_counts),
                                  "hooks": len(hooks)}  # fmt: skip
        for hook in hooks:
            hook.remove()
    return out


def _checkpoint(model, opt, path: str, save: bool) -> None:
    """Save or load the sharded model and optimizer state, every rank its own shards, loading into the live model and
    optimizer as a resumed run does: ``torch.distributed.checkpoint`` under FSDP2 and FSDP1, DeepSpeed's own
    ``save_checkpoint``/``load_checkpoint`` under ZeRO."""
    if hasattr(model, "save_checkpoint"):  # a DeepSpeed engine (ZeRO partitions and optimizer state)
        if save:
            model.save_checkpoint(path, tag="mid")
        else:
            model.load_checkpoint(path, tag="mid")
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    state = {"model": model_state, "optim": optim_state}
    if save:
        dcp.save(state, checkpoint_id=path)
        return
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _count_zero_tests() -> dict:
    """Count the magnitudes' zero tests (ours: ``dora_cache._has_zero``, looked up at each call), whether run by the
    optimizer-step hook or on the host by a training node that found no answer."""
    counter = {"calls": 0}
    try:
        from peft.tuners.lora import dora_cache
    except ImportError:  # upstream
        return counter
    has_zero = dora_cache._has_zero

    def counted(*magnitudes):
        counter["calls"] += 1
        return has_zero(*magnitudes)

    dora_cache._has_zero = counted
    return counter


def _tiers() -> dict:
    """Our DoRA's compositions per tier since the last call (none under upstream)."""
    from peft.tuners.lora import dora

    tiers = getattr(dora, "tier_counts", None)
    if tiers is None:
        return {}
    out = {f"tier_{k}": v for k, v in tiers.items()}
    tiers.clear()
    return out


def _emulate_norm_graphs(patch=setattr) -> None:
    """``--emulate-graphs 1``: our norm graphs on a CPU, where ``dora_norm.norm_graph_applies`` says no (CUDA only):
    it says yes, and a capture keeps the graph's computation, which each replay runs again into the captured output
    buffer, as a CUDA graph's replay computes from the current values at the same addresses (so layers also make
    their training norm records). Under FSDP2 that is the per-unit row graph (``DoraLinearLayer._unit_rows_graphed``):
    its shard-based rows, casts and padding run on gloo, against the launched rows of the gathered tensors.
    ``patch(obj, name, value)``: ``setattr`` here, a test's ``monkeypatch.setattr`` to undo it after the test."""
    from peft.tuners.lora import dora_graph, dora_norm

    class Replay:
        def __init__(self, compute, out):
            self.compute, self.out = compute, out

        def replay(self):
            self.out.copy_(self.compute())

    def capture(self, device, compute):
        out = compute().clone()
        self.graph, self.out = Replay(compute, out), out
        dora_graph.graph_counts["captured"] += 1
        self.graph.replay()
        dora_graph.graph_counts["replayed"] += 1
        return out

    patch(dora_norm, "norm_graph_applies", lambda weight, lora_A, lora_B: True)
    patch(dora_graph.NormGraph, "_capture", capture)


def _unit_rows() -> dict:
    """Our DoRA's FSDP2 unit-row graph calls and norm-graph replays since the last call (none under upstream)."""
    from peft.tuners.lora import dora

    graphs = getattr(dora, "graph_counts", None)
    if graphs is None:
        return {}
    out = {"unit_rows": graphs["unit_rows"], "graph_replayed": graphs["replayed"]}
    graphs.clear()
    return out


def _norm_counts() -> collections.Counter:
    """Our DoRA's norm counters (upstream's DoRA, which the DeepSpeed test runs too, has none: an empty stand-in)."""
    from peft.tuners.lora import dora

    return getattr(dora, "norm_counts", collections.Counter())


@torch.no_grad()
def _edit_partitions(model) -> None:
    """``--edit-partitions``: every rank scales its ZeRO-3 partition (``ds_tensor``) of every lora_A in place, the
    state the next gather reads; without a partition (another engine) the test has nothing to edit."""
    parts = [p.ds_tensor for name, p in model.named_parameters() if "lora_A" in name and hasattr(p, "ds_tensor")]
    if not parts:
        raise SystemExit("--edit-partitions needs ZeRO-3's partitioned parameters")
    for part in parts:
        part.mul_(1.05)


def _gathered(params: list, modifier_rank=None):
    """DeepSpeed ZeRO-3's partitioned parameters gathered whole inside (an edit by ``modifier_rank`` partitioned
    again on exit); nothing to do for others."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


@contextlib.contextmanager
def _counting_syncs(on: bool, counts: list):
    """Count the synchronizing CUDA calls inside (``torch.cuda.set_sync_debug_mode("warn")`` warns once per call; the
    "prototype feature" notice it gives the first time a process turns it on is not one of them)."""
    if not on:
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts.append(sum("called a synchronizing" in str(w.message) for w in caught))


class _ZeroingSGD(torch.optim.SGD):
    """SGD that also zeroes the first entry of one magnitude's local shard on one rank: a zero that only that rank's
    own shard test can see."""

    def __init__(self, params, target, zero_rank: int, rank: int):
        super().__init__(params, lr=0.01)
        self.target, self.zero_now, self.zero_rank, self.rank = target, False, zero_rank, rank

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        local = getattr(self.target, "_local_tensor", self.target)  # FSDP1: the original parameter's shard view
        if self.zero_now and self.rank == self.zero_rank and local.numel():
            local[0] = 0.0


def zero_test_check(model, rank: int) -> dict:
    """The magnitudes' zero test under FSDP2 and FSDP1 (``dora_cache.prefetch_shard_zero_tests``), asked as the fused
    training nodes ask it (their forwards are GPU-only): after each optimizer step the step hook tests every rank's
    shards and all-reduces the answer, so no forward reads a magnitude on the host; a zero on one rank's shard reaches
    every rank; an optimizer that does not hold the magnitudes starts nothing (no collective on one rank only)."""
    from peft.tuners.lora import dora_cache, dora_dist
    from peft.tuners.lora.layer import Linear

    reads = [0]
    has_zero = dora_cache._has_zero

    def counted(*magnitudes):
        reads[0] += 1
        return has_zero(*magnitudes)

    def answer(dora_layer, magnitude) -> bool:
        shard = dora_dist.magnitude_shard(magnitude) or dora_dist.flat_magnitude(magnitude)
        known = dora_cache.KeyedMemo(dora_layer._reuse.zero_free, shard.keys, shard.versions(), shard)
        dora_cache._has_zero = counted
        try:
            return dora_cache.output_saves_itself(magnitude, known)
        finally:
            dora_cache._has_zero = has_zero

    linears = [m for m in model.modules() if isinstance(m, Linear) and "default" in m.lora_magnitude_vector]

    def ask() -> list:
        """Every DoRA Linear's answer (True: no zero), with its magnitude gathered as in a forward."""
        answers = []
        if not hasattr(model, "unshard"):  # FSDP1: the view its forward hands the layer (a no-grad forward asks;
            # not an eval one: train()/eval() forget every kept value)

            def hook(module, args):
                dora_layer = module.lora_magnitude_vector["default"]
                answers.append(answer(dora_layer, dora_layer._parameters["weight"]))

            hooks = [m.register_forward_pre_hook(hook) for m in linears]
            try:
                with torch.no_grad():
                    model(input_ids=torch.zeros(1, SEQ, dtype=torch.long, device=next(model.parameters()).device))
            finally:
                for h in hooks:
                    h.remove()
            return answers
        for layer in model.base_model.model.model.layers:
            layer.unshard()
            for module in layer.modules():
                if module in linears:
                    dora_layer = module.lora_magnitude_vector["default"]
                    answers.append(answer(dora_layer, dora_layer.weight))
            layer.reshard()
        return answers

    def step(opt) -> None:
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    magnitudes = [p for n, p in model.named_parameters() if "lora_magnitude_vector" in n]
    params = [p for p in model.parameters() if p.requires_grad]
    # FSDP1 flattens a layer's parameters in order and rank 1 holds the second half: layer 0's last magnitude
    target = 3 if hasattr(model, "unshard") else 6
    opt = _ZeroingSGD(params, magnitudes[target], zero_rank=1, rank=rank)
    out = {"target": target, "target_on_zero_rank": bool(magnitudes[target].numel()) if rank == 1 else None}
    dist.broadcast_object_list(box := [out["target_on_zero_rank"]], src=1)
    out["target_on_zero_rank"] = box[0]
    out["first"] = (ask(), reads[0])  # nothing started yet: each answer read on the host
    reads[0] = 0
    step(opt)
    out["after_step"] = (ask(), reads[0])
    reads[0] = 0
    opt.zero_now = True
    step(opt)
    out["after_zeroing_step"] = (ask(), reads[0])
    reads[0] = 0
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    if rank == 0:  # steps on one rank only: the hook must not start a collective for it
        other.param_groups[0]["params"][0].grad = torch.ones(2)
        other.step()
    dist.barrier()
    out["after_other_optimizer"] = (ask(), reads[0])
    return out


def check_norms(model) -> dict:
    """Each DoRA Linear's norm under FSDP2 against the whole norm of the gathered tensors: the multi-GPU benchmark's
    check (``benchmarks/multi_gpu_worker.check_norms``), the worst over processes."""
    return _bench_worker().check_norms(model)


def exit_now(code: int) -> None:
    """End the process without the interpreter's finalization. Once in some dozens of gloo launches a native thread
    aborted ("terminate called without an active exception": a running ``std::thread`` destroyed) while the main
    thread had no Python frame left (faulthandler's dump), i.e. in finalization's teardown of what still holds the
    destroyed process group's state."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
