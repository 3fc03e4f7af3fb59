"""torch.compile of DoRA models on a CUDA GPU, with Inductor: one graph per mode (``fullgraph=True``), none after
warm-up, in the ``default``, ``reduce-overhead`` (CUDA graphs) and ``max-autotune-no-cudagraphs`` modes, in bf16
and under autocast, with the fused tiers available; outputs and gradients equal the eager model's.

Run on the GPU machine with ``pytest -m gpu``.
"""

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from peft import LoraConfig, get_peft_model


pytestmark = pytest.mark.gpu

CALLS = 10


class Block(nn.Module):
    """Two projections; compiled, the norm is the opaque ``peft::dora_weight_norm`` (run by the Triton norms) and
    the composition Inductor's."""

    def __init__(self, d: int = 512, f: int = 1024):
        super().__init__()
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.up(x)))


def _model(precision: str, dropout: float):
    torch.manual_seed(0)
    config = LoraConfig(r=16, lora_alpha=32, use_dora=True, target_modules=["up", "down"], lora_dropout=dropout)
    model = get_peft_model(Block().cuda().to(torch.bfloat16), config, autocast_adapter_dtype=precision == "autocast")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def _frames() -> int:
    return counters["stats"]["unique_graphs"]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# autotuning takes minutes: max-autotune runs without dropout only (the dropout path is the same graph code as in the
# other modes)
CASES = [
    (mode, precision, dropout)
    for mode in ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
    for precision in ("bf16", "autocast")
    for dropout in ((0.0,) if mode.startswith("max-autotune") else (0.0, 0.05))
]


@pytest.mark.parametrize("mode, precision, dropout", CASES)
def test_compiled_dora_compiles_once_per_mode(mode, precision, dropout):
    model = _model(precision, dropout)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast")
    frames0 = _frames()
    for step in range(CALLS):
        # gradients start from None every step: under CUDA graphs they are the backward graph's outputs, which the
        # next replay overwrites (accumulating into them would read a stale buffer, for LoRA as well)
        model.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            out = compiled(x)
        out.float().square().mean().backward()
        if step == 0:
            frames_train = _frames()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out = out.detach().clone()
    assert frames_train - frames0 == 1
    assert _frames() == frames_train, "recompiled during training"
    # eager on the same weights and dropout masks is not reproducible under Inductor's RNG: compare without dropout
    if not dropout:
        with autocast:
            ref = eager(x)
        ref.float().square().mean().backward()
        assert _rel_err(out, ref) < 2e-2
        grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
        assert grads.keys() == got.keys() and any("magnitude" in n for n in got)
        for n in grads:
            assert _rel_err(got[n], grads[n]) < 3e-2, n

    model.eval()
    eager.eval()
    with torch.no_grad(), autocast:
        for step in range(CALLS):
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x).clone()
            if step == 0:
                frames_eval = _frames()
        ref = eager(x)
    assert frames_eval - frames_train == 1
    assert _frames() == frames_eval, "recompiled during eval"
    assert _rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("precision", ("bf16", "autocast"))
def test_compiled_training_replays_norm_graphs_that_follow_updates(precision):
    """A compiled training forward computes its modules' norms by replaying CUDA graphs (first each module's, keyed by
    the parameters' storage, then one for the forward's batch of them, ``dora_norm._BatchGraph``), and the graphs read
    what is written into the parameters in place: after every AdamW step, and after B is scaled by 1.5 in place (a
    norm change far above bf16 noise), the compiled training forward equals the same model's eager one. A graph that
    replayed stale inputs, or a norm kept across steps, would not."""
    from peft.tuners.lora import dora

    steps = 6
    model = _model(precision, 0.0)
    compiled = torch.compile(model, fullgraph=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast")
    launches, batches = [], []
    for step in range(steps):
        before = dict(dora.graph_counts)
        with autocast:
            out = compiled(x)
        launches.append(dora.graph_counts["replayed"] - before.get("replayed", 0))
        batches.append(dora.graph_counts["batch_replayed"] - before.get("batch_replayed", 0))
        with autocast:
            ref = model(x)  # eager, same parameters
        err = _rel_err(out, ref)
        assert err < 2e-2, (step, err)
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(1.5)
    # two DoRA modules: both compute eagerly in the first forward; each captures (and replays once) its own graph in
    # the second; the third captures the batch's graph, which every later forward launches once for both
    assert launches == [0, 2] + [1] * (steps - 2), launches
    assert batches == [0, 0] + [1] * (steps - 2), batches


def test_compiled_training_batch_graph_captures_again_for_a_new_storage():
    """The batch's one graph reads the addresses it was captured with: after ``p.data = ...`` gives one lora_A a new
    storage with new values (the old one stays allocated, pinned by its record, so a stale replay would read the old
    values rather than fail), the forwards answer module by module until that module's graph is captured again, then
    capture the batch anew, and every compiled forward equals the eager one."""
    from peft.tuners.lora import dora

    model = _model("bf16", 0.0)
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    lora_A = next(p for name, p in model.named_parameters() if "up.lora_A" in name)
    batches = []
    for step in range(7):
        if step == 4:
            with torch.no_grad():
                lora_A.data = lora_A.data * 4.0  # the up projection's norm moves far above bf16 noise
        before = dora.graph_counts["batch_replayed"]
        out = compiled(x)
        batches.append(dora.graph_counts["batch_replayed"] - before)
        err = _rel_err(out, model(x))
        assert err < 2e-2, (step, err)
    # steps 0-1 per module, 2-3 the batch; the new storage: the module computes eagerly (4), captures (5), then the
    # batch captures again (6)
    assert batches == [0, 0, 1, 1, 0, 0, 1], batches


class _Checkpointed(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.block = model

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


@pytest.mark.parametrize("mode", ("default", "reduce-overhead"))
def test_checkpointed_compiled_training_saves_the_norm_and_follows_updates(mode):
    """Under activation checkpointing Inductor saves the norm op's output for the backward instead of recomputing it
    there (``dora_norm.save_norm_in_checkpoints``): under ``default`` the forward's one op call for both DoRA Linears
    (``dora_norm.batch_norm_ops``) and none in the backward.
    Over AdamW steps that change A, B and m, the compiled step's output and gradients equal the eager step's on the
    same weights, under ``reduce-overhead``'s CUDA graphs too (a saved norm from another step, or a recomputed one
    from stale inputs, would not)."""
    from torch._inductor import config as inductor_config

    from peft.tuners.lora.dora_norm import _SAVE_NORM_PASS_ID

    model = _model("autocast", 0.0)  # making a DoRA layer sets the pass, where none is set
    assert getattr(inductor_config.joint_custom_pre_pass, "uuid", lambda: None)() == _SAVE_NORM_PASS_ID
    model.base_model.model = _Checkpointed(model.base_model.model)
    model.train()
    compiled = torch.compile(model, mode=mode, fullgraph=True)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([p for p in params.values() if p.requires_grad], lr=1e-3)
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    for step in range(6):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = model(x)  # eager first, on the same weights
        ref.float().square().mean().backward()
        eager_grads = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = compiled(x)
            out.float().square().mean().backward()
        calls = {e.key: e.count for e in prof.key_averages() if e.key.startswith("peft::dora_weight_norm")}
        if mode == "default" and step >= 2:
            # the forward's one call for both modules (``batch_norm_ops``), none in the backward's recompute
            assert calls == {"peft::dora_weight_norms": 1}, calls
        assert _rel_err(out.detach(), ref.detach()) < 2e-2, step
        for n, g in eager_grads.items():
            assert _rel_err(params[n].grad, g) < 3e-2, (step, n)
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_reduce_overhead_eval_takes_kept_norms_outside_the_cuda_graph():
    """Under ``mode="reduce-overhead"`` the graph's norms come from ``dora_weight_norms_uncaptured``, which Inductor
    runs ahead of the graph's CUDA graph: every eval forward, CUDA-graph replays included, calls the op, which
    answers both modules from the norms it keeps (inside the CUDA graph every replay recomputed them, reading every
    W); an in-place edit of B between calls is seen (that module's norm computed again), and every output equals
    the eager model's."""
    from torch._inductor import config as inductor_config

    from peft.tuners.lora import dora

    if not inductor_config.graph_partition:
        pytest.skip("this Inductor does not cut CUDA graphs around tagged ops (graph_partition is off)")
    model = _model("bf16", 0.0).eval()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    x = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    lora_B = next(p for name, p in model.named_parameters() if "down.lora_B" in name)
    reused, computed = [], []
    with torch.no_grad():
        for step in range(7):
            if step == 5:
                lora_B.mul_(1.5)
            before = dict(dora.norm_counts)
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(x).clone()
            reused.append(dora.norm_counts["norm_reused"] - before.get("norm_reused", 0))
            computed.append(dora.norm_counts["norm_computed"] - before.get("norm_computed", 0))
            err = _rel_err(out, model(x))
            assert err < 2e-2, (step, err)
    # the first call computes both (and keeps them); every later one reuses both, but for the edited module's once
    assert computed == [2, 0, 0, 0, 0, 1, 0], computed
    assert reused == [0, 2, 2, 2, 2, 1, 2], reused
