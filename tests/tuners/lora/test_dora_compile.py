"""torch.compile of DoRA models: one graph per input shape and mode, never a recompile per call, and the compiled
model computes what the eager one does (outputs and gradients).

Dynamo guards on every value a traced function reads; per-call module state (tier counters, ``last_tier``, norm
memos, decode plans) read inside the traced forward invalidates the graph on the next call. The counting backend
below compiles with ``aot_eager`` (the autograd graph without Inductor's code generation) and counts the frames
Dynamo compiles, so a recompile shows as a second frame."""

import copy
import gc
import subprocess
import sys

import pytest
import torch
from dora_testing import assert_close
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora


CALLS = 10


class TwoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(32, 48)
        self.l2 = nn.Linear(48, 24, bias=False)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x)))


def _dora_model(model: nn.Module, targets, dora_on: bool = True, dropout: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=16, use_dora=dora_on, target_modules=targets, lora_dropout=dropout)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # B = 0 at init would leave the norm's cross and Gram terms untested
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return peft_model


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _grads(model: nn.Module) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dropout", (0.0, 0.05))
def test_compiled_model_compiles_once_per_mode(fresh_dynamo, dropout):
    """10 training calls (forward + backward), then 10 eval calls under no_grad: one frame for each mode, outputs and
    gradients equal to eager (dropout draws the same mask from the same seed in both)."""
    model = _dora_model(TwoLinear(), ["l1", "l2"], dropout=dropout)
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(4, 7, 32)
    for step in range(CALLS):
        tiers = dict(dora.tier_counts)
        torch.manual_seed(step)
        out = compiled(x)
        out.square().sum().backward()
        assert dict(dora.tier_counts) == tiers  # compiled forwards leave the counters alone (they are guarded on)
        torch.manual_seed(step)
        ref = eager(x)
        ref.square().sum().backward()
        assert_close(out, ref)
    assert counter.frame_count == 1
    expected = _grads(eager)
    got = _grads(model)
    assert expected.keys() == got.keys() and any("lora_magnitude_vector" in n for n in got)
    for name in expected:
        assert_close(got[name], expected[name], scale=CALLS)

    model.eval()
    eager.eval()
    with torch.no_grad():
        for _ in range(CALLS):
            assert_close(compiled(x), eager(x))
    assert counter.frame_count == 2


def test_compiled_model_follows_parameter_updates(fresh_dynamo):
    """Optimizer steps change A, B and m in place between calls: the compiled graph reads their current values (no
    norm is baked in as a constant) and still does not recompile."""
    model = _dora_model(TwoLinear(), ["l1", "l2"])
    eager = copy.deepcopy(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5) for m in (model, eager)]
    x = torch.randn(3, 32)
    for _ in range(CALLS):
        losses = [compiled(x).square().mean(), eager(x).square().mean()]
        assert_close(losses[0], losses[1], scale=CALLS)
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert counter.frame_count == 1
    model.eval()
    eager.eval()
    with torch.no_grad():
        assert_close(compiled(x), eager(x), scale=CALLS)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _train_frames(dora_on: bool):
    """Frames compiled over 10 checkpointed training steps of a tiny Llama, the losses and the gradients, compiled
    and eager."""
    runs = {}
    for compiled_run in (True, False):
        model = _dora_model(_tiny_llama(), LLAMA_TARGETS, dora_on=dora_on)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        forward = torch.compile(model, backend=counter) if compiled_run else model
        ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
        losses = []
        for _ in range(CALLS):
            loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
        runs[compiled_run] = (counter.frame_count, torch.stack(losses), _grads(model))
    return runs


def test_compiled_llama_with_checkpointing_compiles_as_lora_does(fresh_dynamo):
    """A checkpointed decoder: DoRA compiles exactly as many frames as LoRA on the same model (whatever transformers'
    own code costs), none after the first call, and its losses and gradients equal eager's."""
    dora_runs = _train_frames(True)
    lora_frames = _train_frames(False)[True][0]
    frames, losses, grads = dora_runs[True]
    _, eager_losses, eager_grads = dora_runs[False]
    assert frames == lora_frames
    assert_close(losses, eager_losses)
    assert grads.keys() == eager_grads.keys() and any("lora_magnitude_vector" in n for n in grads)
    for name in grads:
        assert_close(grads[name], eager_grads[name], scale=CALLS)


def _generate(dora_on: bool):
    model = _dora_model(_tiny_llama(), LLAMA_TARGETS, dora_on=dora_on).eval()
    prompt = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    eager = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    decoder = model.get_base_model()  # what generate() calls for every step
    decoder.forward = torch.compile(decoder.forward, backend=counter)
    outputs = [model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False) for _ in range(3)]
    return counter.frame_count, eager, outputs


def test_compiled_generate_compiles_as_lora_does(fresh_dynamo):
    """Greedy generation through a compiled forward: the prompt and the growing KV cache are new shapes (Dynamo
    marks them dynamic), so LoRA compiles a few frames too; DoRA compiles the same number and repeated generations
    add none. Tokens equal eager generation's."""
    frames, eager, outputs = _generate(True)
    lora_frames = _generate(False)[0]
    assert frames == lora_frames
    for out in outputs:
        assert torch.equal(out, eager)


@pytest.mark.parametrize("reuse", (0, 2))
def test_norm_op_opcheck(reuse):
    """``peft::dora_weight_norm``: fake tensor, schema and no aliasing of its inputs, also when it returns a value
    it keeps (``reuse`` 2: a copy of it)."""
    weight, lora_A, lora_B = torch.randn(24, 40), torch.randn(6, 40), torch.randn(24, 6)
    for frozen in (False, True):
        torch.library.opcheck(torch.ops.peft.dora_weight_norm.default, (weight, lora_A, lora_B, 0.7, reuse, frozen))
    expected = dora.factored_row_norm(weight, lora_A, lora_B, 0.7)
    assert_close(torch.ops.peft.dora_weight_norm(weight, lora_A, lora_B, 0.7, reuse, True), expected)


def test_norms_op_opcheck_and_values():
    """``peft::dora_weight_norms``: fake tensor, schema and no aliasing of its inputs, also where the norms it
    concatenates are kept values (``reuse`` 2); its result is each triple's norm, in order."""
    gen = torch.Generator().manual_seed(5)
    triples = [(torch.randn(d, 40, generator=gen), torch.randn(6, 40, generator=gen), torch.randn(d, 6, generator=gen))
               for d in (24, 8, 16)]  # fmt: skip
    weights, lora_As, lora_Bs = (list(column) for column in zip(*triples))
    args = (weights, lora_As, lora_Bs, [0.7, 1.0, 0.25], [2, 0, 2], [True, False, True])
    torch.library.opcheck(torch.ops.peft.dora_weight_norms.default, args)
    expected = torch.cat([dora.factored_row_norm(*t, s) for t, s in zip(triples, args[3])])
    for _ in range(2):  # computed, then the kept norms of the reuse-2 triples
        assert_close(torch.ops.peft.dora_weight_norms.default(*args), expected)
    with pytest.raises(ValueError, match="at least one"):
        torch.ops.peft.dora_weight_norms.default([], [], [], [], [], [])
    # its twin for outside CUDA graphs: the same op, tagged
    uncaptured = torch.ops.peft.dora_weight_norms_uncaptured.default
    assert torch.Tag.cudagraph_unsafe in uncaptured.tags
    assert torch.Tag.cudagraph_unsafe not in torch.ops.peft.dora_weight_norms.default.tags
    torch.library.opcheck(uncaptured, args)
    assert_close(uncaptured(*args), expected)


class ThreeLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(32, 48), nn.Linear(48, 24, bias=False), nn.Linear(24, 16)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))))


def _norm_op_calls(prof) -> dict:
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith("peft::dora_weight_norm")}


def test_compiled_graph_computes_its_norms_in_one_call(fresh_dynamo):
    """Under Inductor (``batch_norm_ops``, the post-grad pass a DoRA layer sets) the norms of a compiled graph's DoRA
    Linears come from one ``dora_weight_norms`` call per forward, in training and in eval, none from the
    per-module op; over optimizer steps that change A, B and m, outputs and gradients equal eager ones on the same
    weights, and eval forwards after an in-place edit of a B see it."""
    from torch._inductor import config as inductor_config

    from peft.tuners.lora.dora_norm import _BATCH_NORMS_PASS_ID

    model = _dora_model(ThreeLinear(), ["l1", "l2", "l3"])
    assert inductor_config.post_grad_custom_post_pass.uuid() == _BATCH_NORMS_PASS_ID
    twin = copy.deepcopy(model)
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(4))
    compiled = torch.compile(model, fullgraph=True)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    twin_opt = torch.optim.AdamW([p for p in twin.parameters() if p.requires_grad], lr=1e-2)
    model.train(), twin.train()
    for step in range(4):
        with torch.profiler.profile() as prof:
            out = compiled(x)
            out.square().mean().backward()
        ref = twin(x)
        ref.square().mean().backward()
        if step:  # the first call compiles, tracing the ops too
            assert _norm_op_calls(prof) == {"peft::dora_weight_norms": 1}, step
        assert_close(out, ref)
        grads, expected = _grads(model), _grads(twin)
        assert grads.keys() == expected.keys() and any("lora_magnitude_vector" in n for n in grads)
        for name in grads:
            assert_close(grads[name], expected[name])
        opt.step(), twin_opt.step()
        opt.zero_grad(set_to_none=True), twin_opt.zero_grad(set_to_none=True)
    model.eval(), twin.eval()
    with torch.no_grad():
        for step in range(3):
            if step == 2:
                for m in (model, twin):
                    m.base_model.model.l2.lora_B["default"].weight.mul_(1.5)
            with torch.profiler.profile() as prof:
                out = compiled(x)
            if step:
                assert _norm_op_calls(prof) == {"peft::dora_weight_norms": 1}, step
            assert_close(out, twin(x))


def test_compiled_eval_forward_has_loras_kernels(fresh_dynamo):
    """Without autograd the compiled DoRA forward runs LoRA's kernels and matmuls, one for one, plus the graph's one
    norm-op call: ``g`` scales the LoRA output's columns in the pointwise kernel the output takes anyway (``s·g·B``
    was one more kernel per module). Outputs equal the eager forward's."""
    import re

    from torch._inductor.utils import run_and_get_code

    def calls(dora_on: bool):
        torch._dynamo.reset()
        model = _dora_model(ThreeLinear(), ["l1", "l2", "l3"], dora_on=dora_on).eval().to(torch.bfloat16)
        x = torch.randn(6, 32, generator=torch.Generator().manual_seed(8), dtype=torch.bfloat16)
        with torch.no_grad():
            out, code = run_and_get_code(torch.compile(model, fullgraph=True), x)
            assert_close(out, model(x))
        return re.findall(
            r"^\s+(?:\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+\.\w+)\(", "\n".join(code), re.M
        )

    lora, dora_calls = calls(False), calls(True)
    assert dora_calls.count("torch.ops.peft.dora_weight_norms.default") == 1
    kernels = [c for c in dora_calls if not c.startswith("torch.ops.peft.")]
    # no more kernels than LoRA's (Inductor may fuse one more of DoRA's), as many matmuls (``mm`` or ``addmm``: where
    # a bias is added may differ)
    assert len(kernels) <= len(lora)
    assert sum(c.startswith("extern") for c in kernels) == sum(c.startswith("extern") for c in lora)


def test_batch_norm_ops_groups_by_dtype_and_leaves_computed_weights_alone():
    """The pass batches the op calls whose W, A, B are graph inputs, one batch per output dtype (a single call is
    left as it is), and leaves a call on a weight computed inside the graph (as a gathered or dequantized one would
    be) alone; the graph computes what it computed before."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from peft.tuners.lora.dora_norm import batch_norm_ops

    def fn(w1, a1, b1, w2, a2, b2, w3, a3, b3, w4, a4, b4):
        op = torch.ops.peft.dora_weight_norm.default
        return (
            op(w1, a1, b1, 0.5, 0, True),
            op(w2, a2, b2, 1.0, 0, True),
            op(w3 * 2, a3, b3, 1.0, 0, True),  # a weight computed in the graph
            op(w4, a4, b4, 0.5, 0, True),  # float64: a batch of its own, of one
        )

    gen = torch.Generator().manual_seed(6)
    args = []
    for d, dtype in ((24, torch.float32), (8, torch.float32), (16, torch.float32), (12, torch.float64)):
        args += [torch.randn(d, 40, generator=gen, dtype=dtype), torch.randn(4, 40, generator=gen, dtype=dtype),
                 torch.randn(d, 4, generator=gen, dtype=dtype)]  # fmt: skip
    gm = make_fx(fn, tracing_mode="fake")(*args)
    expected = gm(*args)
    batch_norm_ops(gm.graph)
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.peft.dora_weight_norms.default) == 1
    assert targets.count(torch.ops.peft.dora_weight_norm.default) == 2  # the computed weight's and the float64 one
    batched = next(n for n in gm.graph.nodes if n.target is torch.ops.peft.dora_weight_norms.default)
    assert batched.meta["val"].shape == (32,)
    for got, want in zip(gm(*args), expected):
        assert got.dtype == want.dtype
        assert_close(got, want)


def test_batch_norm_ops_puts_the_batch_ahead_of_cuda_graphs():
    """Where Inductor compiles CUDA graphs and cuts them around tagged ops (``mode="reduce-overhead"`` with
    ``graph_partition``), the batch is the tagged twin, also for a single call, placed right after the graph's inputs
    (ahead of the rest of the graph, which then makes one CUDA graph); without CUDA graphs, or where Inductor does not
    partition (a tagged op would take CUDA graphs off the whole graph), the plain batched op at the same place. The
    graph computes what it computed before."""
    from torch._inductor import config as inductor_config
    from torch.fx.experimental.proxy_tensor import make_fx

    from peft.tuners.lora.dora_norm import batch_norm_ops

    def fn(x, w1, a1, b1, w2, a2, b2, w3, a3, b3):
        op = torch.ops.peft.dora_weight_norm.default
        h = torch.relu(x @ w1.T) * op(w1, a1, b1, 0.5, 2, True)
        h = torch.relu(h @ w2.T) * op(w2, a2, b2, 1.0, 2, True)
        return h, op(w3, a3, b3, 1.0, 2, True)  # float64: a group of one

    gen = torch.Generator().manual_seed(9)
    args = [torch.randn(5, 40, generator=gen)]
    for d_out, d_in, dtype in ((24, 40, torch.float32), (8, 24, torch.float32), (12, 40, torch.float64)):
        args += [torch.randn(d_out, d_in, generator=gen, dtype=dtype), torch.randn(4, d_in, generator=gen, dtype=dtype),
                 torch.randn(d_out, 4, generator=gen, dtype=dtype)]  # fmt: skip
    plain, uncaptured = torch.ops.peft.dora_weight_norms.default, torch.ops.peft.dora_weight_norms_uncaptured.default
    cases = (
        ({"triton.cudagraphs": True, "graph_partition": True}, [uncaptured, uncaptured]),
        ({"triton.cudagraphs": True, "graph_partition": False}, [plain]),
        ({"triton.cudagraphs": False, "graph_partition": True}, [plain]),
    )
    for settings, batches in cases:
        gm = make_fx(fn, tracing_mode="fake")(*args)
        expected = gm(*args)
        with inductor_config.patch(settings):
            batch_norm_ops(gm.graph)
        gm.recompile()
        nodes = [n for n in gm.graph.nodes if n.op != "placeholder"]
        found = [n.target for n in nodes if n.target in (plain, uncaptured)]
        assert found == batches, settings
        # the batches (and their slices) first, right after the inputs; no per-module call left but the single
        # float64 one's where a batch of one is not worth it
        last = max(i for i, n in enumerate(nodes) if n.target in (plain, uncaptured))
        assert all(n.target in (plain, uncaptured, torch.ops.aten.slice.Tensor) for n in nodes[: last + 1]), settings
        left = [n for n in nodes if n.target is torch.ops.peft.dora_weight_norm.default]
        assert len(left) == (0 if len(batches) == 2 else 1), settings
        for got, want in zip(gm(*args), expected):
            assert_close(got, want)


def _op(weight, lora_A, lora_B, scale, reuse):
    with torch.no_grad():  # as inside a compiled graph's forward (and no autograd node holding A and B)
        return torch.ops.peft.dora_weight_norm.default(weight, lora_A, lora_B, scale, reuse, True)


def _in_backward(fn):
    """``fn()``'s result, called inside an autograd backward (where a checkpoint's recompute runs)."""
    seen = []

    class InBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(fn())
            return grad

    InBackward.apply(torch.ones(1, requires_grad=True)).sum().backward()
    return seen[0]


def test_norm_op_record_answers_only_what_the_memos_would():
    """Inductor hands the norm op the parameters themselves, the same objects every call: a call with the very same
    objects is answered from the op's record (no memo keys, no weak references to storages). Its answers are the
    memos': the kept norm while W, A, B keep their versions and no optimizer step, merge or
    ``invalidate_norm_caches`` came between (an in-place edit of B, a ``.data`` write announced by the call, a new
    tensor behind the same parameter object, another scaling: each computes afresh, equal to the exact norm); with
    ``reuse`` 1 only in a backward."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(24, 40), requires_grad=False)
    lora_A, lora_B = nn.Parameter(torch.randn(6, 40)), nn.Parameter(torch.randn(24, 6))

    def exact(scale=0.7):
        return torch.linalg.vector_norm(weight.detach() + scale * lora_B.detach() @ lora_A.detach(), dim=1)

    def call(reuse=2, scale=0.7):
        dora.norm_counts.clear()
        out = _op(weight, lora_A, lora_B, scale, reuse)
        assert_close(out, exact(scale))
        return out, dora.norm_counts["norm_reused"] == 1

    assert not call()[1]
    first, hit = call()
    assert hit
    first.mul_(0)  # the op hands out copies: scribbling on one (as a compiled graph may) leaves the kept norm alone
    assert call()[1]
    with torch.no_grad():
        lora_B.add_(0.5)  # in place: B's version counter moves
    assert not call()[1] and call()[1]
    optimizer = torch.optim.SGD([lora_A, lora_B], lr=0.1)
    (lora_A.sum() + lora_B.sum()).backward()
    optimizer.step()  # the epoch moves
    assert not call()[1] and call()[1]
    lora_A.data.mul_(2)  # through .data: no version counter sees it ...
    dora.invalidate_norm_caches()  # ... which the call to this announces
    assert not call()[1] and call()[1]
    lora_B.data = torch.randn(24, 6)  # another tensor behind the same parameter object (a new data pointer)
    assert not call()[1] and call()[1]
    # another storage at the same address, the version counter unchanged (``p.data = ...`` where the allocator put
    # the new storage where a freed one was): the record keeps its storages pinned and sees a new one
    memory = lora_B.detach().numpy()
    lora_B.data = torch.from_numpy(memory)
    memory *= 0.5
    assert not call()[1] and call()[1]
    assert not call(scale=0.3)[1] and not call()[1]  # the record keeps the last scaling it computed for

    # reuse 1 (a training forward): the kept norm only in a backward, the checkpoint's recompute
    assert not call(reuse=1)[1] and not call(reuse=1)[1]

    def recompute():
        dora.norm_counts.clear()
        return _op(weight, lora_A, lora_B, 0.7, 1), dora.norm_counts["norm_reused"]

    norm, reused = _in_backward(recompute)
    assert reused == 1
    assert_close(norm, exact())


def test_norms_op_keeps_a_reusable_batch_under_the_records_rules(monkeypatch):
    """``peft::dora_weight_norms`` where every triple may be reused across forwards (eval): the next call with the
    very same objects is answered from the batch it kept (``_KeptBatch``), without a per-triple record's answer.
    It answers only what the triples would: each change below (an in-place edit, an optimizer step, a ``.data``
    write announced by ``invalidate_norm_caches``, a new tensor or another storage at the same address behind the
    same parameter object, a transposed view at the same address, another object, scaling or ``frozen`` flag, a
    value kept in inference mode asked for outside it) computes through the triples, equal to the exact norms, and
    is kept again for the call after."""
    from peft.tuners.lora import dora_norm

    gen = torch.Generator().manual_seed(3)
    weights = [nn.Parameter(torch.randn(d, 24, generator=gen), requires_grad=False) for d in (24, 16, 8)]
    lora_As = [nn.Parameter(torch.randn(4, 24, generator=gen)) for _ in weights]
    lora_Bs = [nn.Parameter(torch.randn(w.shape[0], 4, generator=gen)) for w in weights]
    scales, frozen = [0.7, 1.0, 0.25], [True, True, True]
    answers = []  # per-triple record answers (the path the kept batch skips)
    real_answer = dora_norm._OpRecord.answer

    def counting_answer(self, *args, **kwargs):
        answers.append(1)
        return real_answer(self, *args, **kwargs)

    monkeypatch.setattr(dora_norm._OpRecord, "answer", counting_answer)

    def exact():
        return torch.cat(
            [torch.linalg.vector_norm(w.detach() + s * b.detach() @ a.detach(), dim=1)
             for w, a, b, s in zip(weights, lora_As, lora_Bs, scales)]
        )  # fmt: skip

    def call(scales_now=None, frozen_now=None):
        """Whether the kept batch answered (no triple's record was asked, every norm counted as reused)."""
        answers.clear()
        dora.norm_counts.clear()
        now = scales if scales_now is None else scales_now
        with torch.no_grad():
            out = torch.ops.peft.dora_weight_norms.default(
                weights, lora_As, lora_Bs, now, [2, 2, 2], frozen if frozen_now is None else frozen_now
            )
        expected = torch.cat(
            [torch.linalg.vector_norm(w.detach() + s * b.detach() @ a.detach(), dim=1)
             for w, a, b, s in zip(weights, lora_As, lora_Bs, now)]
        )  # fmt: skip
        assert_close(out, expected)
        kept = not answers and dora.norm_counts["norm_reused"] == 3 and not dora.norm_counts["norm_computed"]
        return out, kept

    def changed_then_kept():
        return not call()[1] and call()[1]

    assert not call()[1]
    first, kept = call()
    assert kept
    first.mul_(0)  # callers get copies: scribbling on one leaves the kept batch alone
    assert call()[1]
    with torch.no_grad():
        lora_Bs[1].add_(0.5)
    assert changed_then_kept()
    optimizer = torch.optim.SGD(lora_As + lora_Bs, lr=0.1)
    sum(t.sum() for t in lora_As + lora_Bs).backward()
    optimizer.step()
    assert changed_then_kept()
    lora_As[2].data.mul_(2)
    dora.invalidate_norm_caches()
    assert changed_then_kept()
    lora_Bs[0].data = torch.randn(24, 4, generator=gen)
    assert changed_then_kept()
    memory = lora_Bs[2].detach().numpy()
    lora_Bs[2].data = torch.from_numpy(memory)  # another storage at the same address, the version counter unchanged
    memory *= 0.5
    assert changed_then_kept()
    weights[0].data = weights[0].data.t()  # square: the same storage, address, shape and version, other strides
    assert changed_then_kept()
    lora_As[1] = nn.Parameter(lora_As[1].detach().clone())  # another object, equal values
    assert changed_then_kept()
    assert not call(scales_now=[0.7, 1.0, 0.5])[1] and call(scales_now=[0.7, 1.0, 0.5])[1]
    assert not call(frozen_now=[True, False, True])[1]
    assert not call()[1] and call()[1]
    with torch.inference_mode():
        assert call()[1]  # kept outside inference mode: handed out inside it too
    with torch.no_grad():
        lora_Bs[0].mul_(0.5)
    with torch.inference_mode():
        assert not call()[1] and call()[1]
    assert not call()[1]  # kept in inference mode: not handed out outside it
    assert call()[1]
    assert_close(call()[0], exact())
    key = (id(weights[0]), id(lora_Bs[-1]), 3)
    assert key in dora_norm._kept_batches
    del lora_As[0], optimizer  # the optimizer holds A too
    gc.collect()
    assert key not in dora_norm._kept_batches  # dropped with one of its objects


def test_norm_op_record_goes_with_its_objects():
    """A record is dropped when one of the objects it was made for dies (its id may be taken by a new object)."""
    from peft.tuners.lora import dora_norm

    weight, lora_A, lora_B = torch.randn(24, 40), torch.randn(6, 40), torch.randn(24, 6)
    key = (id(weight), id(lora_A), id(lora_B))
    _op(weight, lora_A, lora_B, 0.7, 2)
    assert key in dora_norm._op_records
    del lora_A
    gc.collect()
    assert key not in dora_norm._op_records


_EXIT_SCRIPT = """
import torch
from torch import nn
from peft.tuners.lora import dora_norm

weight = nn.Parameter(torch.randn(8, 16), requires_grad=False)
lora_A, lora_B = nn.Parameter(torch.randn(2, 16)), nn.Parameter(torch.randn(8, 2))
with torch.no_grad():
    torch.ops.peft.dora_weight_norm.default(weight, lora_A, lora_B, 1.0, 2, True)
record = next(iter(dora_norm._op_records.values()))  # held by __main__: alive when the three objects die at exit
print("records", len(dora_norm._op_records))
"""


def test_norm_op_record_dies_quietly_at_interpreter_exit():
    """At interpreter exit a record's objects may die after ``dora_norm``'s globals were cleared (a record still
    held elsewhere, as a compiled model's objects are): its drop callback then raised "'NoneType' object has no
    attribute 'get'" into the exit's output, three times per module."""
    run = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "records 1" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
    assert "Exception ignored" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-4000:]


def test_compiled_norm_reuse_is_eager_reuse(fresh_dynamo):
    """Under torch.compile the norm is reused where eager forwards reuse it, and only there: in the checkpoint
    recompute (one norm per module and step), ``||W||²`` of the frozen base weight across optimizer steps, across
    eval forwards; an in-place edit of B (same storage, new version) recomputes that module's norm, and a new B
    tensor (new storage) too, so outputs equal eager ones."""
    model = _dora_model(_tiny_llama(), LLAMA_TARGETS)
    modules = sum(1 for name, _ in model.named_modules() if name.endswith("lora_magnitude_vector"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    compiled = torch.compile(model, backend=CompileCounterWithBackend("aot_eager"))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    for step in range(3):
        dora.norm_counts.clear()
        compiled(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        counts = dict(dora.norm_counts)
        assert counts["norm_computed"] == counts["norm_reused"] == modules  # forward, then its recompute
        assert counts["w_sq_computed" if step == 0 else "w_sq_reused"] == modules

    model.eval()
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        compiled(input_ids=ids)
        dora.norm_counts.clear()
        out = compiled(input_ids=ids).logits
        assert dict(dora.norm_counts) == {"norm_reused": modules}
        assert_close(out, model(input_ids=ids).logits)
        q_proj.lora_B["default"].weight.add_(0.5)  # in place: the version counter moves
        dora.norm_counts.clear()
        out = compiled(input_ids=ids).logits
        assert dora.norm_counts["norm_computed"] == 1 and dora.norm_counts["norm_reused"] == modules - 1
        assert_close(out, model(input_ids=ids).logits)
    new_b = q_proj.lora_B["default"].weight.detach() * 2  # a new tensor: Dynamo's guards and the memo both see it
    q_proj.lora_B["default"].weight = nn.Parameter(new_b)
    with torch.no_grad():
        dora.norm_counts.clear()
        out = compiled(input_ids=ids).logits
        assert dora.norm_counts["norm_computed"] >= 1
        assert_close(out, model(input_ids=ids).logits)


def _gpt2(dora_on: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=97, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, use_dora=dora_on, target_modules=["c_attn", "c_proj", "c_fc"],
                      fan_in_fan_out=True)  # fmt: skip
    model = get_peft_model(GPT2LMHeadModel(config), lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.randn_like(p))
    return model


def _gpt2_frames(model, ids, eager=None) -> list:
    """Frames after each of three training calls; with ``eager``, each call's loss against eager's."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter)
    frames = []
    for _ in range(3):
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        frames.append(counter.frame_count)
        if eager is not None:
            ref = eager(input_ids=ids, labels=ids).loss
            ref.backward()
            assert_close(loss, ref)
    return frames


def test_compiled_gpt2_conv1d_compiles_as_lora_does(fresh_dynamo):
    """GPT-2's ``Conv1D`` projections (``fan_in_fan_out``: the base weight stored transposed, with a bias) compile
    into as many frames as LoRA's, none after the first call: upstream's ``transpose`` wrapped the weight in a new
    ``nn.Parameter`` per call, a graph break per module (30 frames against LoRA's 2). Losses and every gradient
    equal eager's."""
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    lora_frames = _gpt2_frames(_gpt2(False), ids)
    torch._dynamo.reset()
    model = _gpt2(True)
    eager = copy.deepcopy(model)
    frames = _gpt2_frames(model, ids, eager)
    assert frames == lora_frames and len(set(frames)) == 1
    expected = _grads(eager)
    grads = _grads(model)
    assert expected.keys() == grads.keys() and any("lora_magnitude_vector" in n for n in grads)
    for name in expected:
        assert_close(grads[name], expected[name], scale=3)


@pytest.mark.parametrize("kind", ("nf4", "int8"))
def test_compiled_qdora_compiles_as_qlora_does(fresh_dynamo, kind):
    """QDoRA on bitsandbytes layers (CPU backend): as many frames as QLoRA on the same base (LLM.int8 recompiles
    once after its first call in both, bitsandbytes' own state), none after that; 4-bit outputs and gradients equal
    eager's within bf16 rounding (the 4-bit layers compute in bf16: the compiled output's fp32 rounding differs from
    eager's in the last bits, which flips a few bf16 roundings of the second layer's input; bitsandbytes' 8-bit CPU
    matmul is not reproducible across calls: frames only)."""
    bnb_net = pytest.importorskip("dora_testing").BnbNet
    pytest.importorskip("bitsandbytes")

    def frames(dora_on: bool):
        torch._dynamo.reset()
        torch.manual_seed(3)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=["up", "down"], use_dora=dora_on,
                            init_lora_weights=False)  # fmt: skip
        model = get_peft_model(bnb_net(kind), config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_magnitude_vector" in name:
                    p.mul_(1 + 0.1 * torch.randn_like(p))
        eager = copy.deepcopy(model) if kind != "int8" else None
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(model, backend=counter)
        x = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(0))
        counts = []
        for _ in range(3):
            out = compiled(x)
            out.float().square().mean().backward()
            counts.append(counter.frame_count)
            if eager is not None:
                ref = eager(x)
                ref.float().square().mean().backward()
                assert_close(out, ref, dtype=torch.bfloat16)
        if eager is not None:
            expected, got = _grads(eager), _grads(model)
            assert expected.keys() == got.keys() and any("lora_magnitude_vector" in n for n in got) == dora_on
            for name in expected:
                assert_close(got[name], expected[name], dtype=torch.bfloat16)
        return counts

    qlora = frames(False)
    assert frames(True) == qlora and qlora[-1] == qlora[-2]


class _Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = TwoLinear()

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def _norm_calls_per_step(model: nn.Module, backend, x) -> tuple:
    """(norm op calls in one training step after two warm-up steps, the gradients of that step)."""
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    for _ in range(2):
        compiled(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile() as prof:
        compiled(x).square().mean().backward()
    calls = sum(e.count for e in prof.key_averages() if e.key == "peft::dora_weight_norm")
    return calls, _grads(model)


@pytest.mark.parametrize("with_pass", (True, False))
def test_checkpointed_norm_is_saved_not_recomputed(fresh_dynamo, with_pass):
    """Under activation checkpointing the partitioner recomputes everything in the region in the backward, the norm
    op too (a second call per DoRA Linear and step). ``save_norm_in_checkpoints`` (Inductor's joint-graph pass,
    here run by the aot_eager backend's partitioner the same way) has it saved instead: one call per module and
    step, the gradients those of eager and of the recomputing graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from peft.tuners.lora.dora_norm import save_norm_in_checkpoints

    def partition(gm, joint_inputs, **kwargs):
        if with_pass:
            save_norm_in_checkpoints(gm.graph)
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)

    def nop(gm, _):
        return make_boxed_func(gm)

    backend = aot_autograd(fw_compiler=nop, bw_compiler=nop, partition_fn=partition)
    model = _dora_model(_Checkpointed(), ["inner.l1", "inner.l2"]).train()
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(3))
    eager = copy.deepcopy(model)
    eager(x).square().mean().backward()
    calls, grads = _norm_calls_per_step(model, backend, x)
    assert calls == (2 if with_pass else 4)  # two DoRA Linears: their forwards only, or forwards and recomputes
    expected = _grads(eager)
    assert grads.keys() == expected.keys() and any("lora_magnitude_vector" in n for n in grads)
    for name in grads:
        assert_close(grads[name], expected[name])


@pytest.mark.parametrize(
    "setting, uuid",
    (("joint_custom_pre_pass", "peft-dora-save-norm-v1"), ("post_grad_custom_post_pass", "peft-dora-batch-norms-v1")),
)
def test_norm_passes_are_set_once_and_leave_a_users_pass_alone(setting, uuid):
    """A DoRA layer made sets each pass where Inductor has none (once: the next layers find it), and leaves a pass
    the user set in place. (``config.patch`` restores the setting; pytest's monkeypatch would delete it on undo,
    which Inductor's config module takes as "hide this setting", breaking every later DoRA layer in the process.)"""
    from torch._inductor import config as inductor_config

    with inductor_config.patch({setting: None}):
        _dora_model(TwoLinear(), ["l1", "l2"])
        ours = getattr(inductor_config, setting)
        assert ours is not None and ours.uuid() == uuid
        _dora_model(TwoLinear(), ["l1", "l2"])
        assert getattr(inductor_config, setting) is ours

    def users_pass(graph):
        return None

    with inductor_config.patch({setting: users_pass}):
        _dora_model(TwoLinear(), ["l1", "l2"])
        assert getattr(inductor_config, setting) is users_pass
    _dora_model(TwoLinear(), ["l1", "l2"])  # and after the patches, the setting is there to read


def test_a_dora_layer_is_made_where_inductor_lacks_the_setting(monkeypatch):
    """The pass is a speed-up: where Inductor's config has no ``joint_custom_pre_pass`` (an older or stripped-down
    Inductor), making a DoRA layer goes on without it."""
    from peft.tuners.lora import dora_norm

    class NoSetting:
        def __getattr__(self, name):
            raise AttributeError(name)

    import torch._inductor

    monkeypatch.setattr(torch._inductor, "config", NoSetting())
    monkeypatch.setitem(sys.modules, "torch._inductor.config", NoSetting())
    dora_norm.set_norm_passes()  # no error
    model = _dora_model(TwoLinear(), ["l1", "l2"])
    assert any("lora_magnitude_vector" in n for n, _ in model.named_parameters())


class _HostGraph:
    """A captured graph's stand-in on a CPU (CUDA graphs need a GPU): each replay runs the captured computation
    again, into the buffer a real graph writes."""

    def __init__(self, out, compute):
        self.out, self.compute = out, compute

    def replay(self) -> None:
        self.out.copy_(self.compute())


def test_batch_graph_bookkeeping_on_a_cpu(monkeypatch):
    """``dora_norm._BatchGraph`` decides on the host which graph a compiled training forward launches: with the norm
    graphs run on a CPU by a stand-in that recomputes on every replay (the GPU tests run the real ones), a batch
    whose every record would replay its own graph is captured once and then launched once per call, its norms those
    of the current values (after in-place edits too), each record keeping its slice for a checkpoint's recompute; a
    record made anew (``p.data = ...`` gave one A another storage) sends the calls module by module until every
    record replays again, then the batch captures again; no batch for eval reuse, in a backward or for one triple;
    the table drops a batch once its records die."""
    from peft.tuners.lora import dora_graph, dora_norm

    def capture(self, device, compute):
        out = compute().clone()
        self.graph, self.out = _HostGraph(out, compute), out
        dora_graph.graph_counts["captured"] += 1
        dora_graph.graph_counts["replayed"] += 1
        return out

    monkeypatch.setattr(dora_norm, "norm_graph_applies", lambda weight, lora_A, lora_B: True)
    monkeypatch.setattr(dora_graph.NormGraph, "_capture", capture)
    torch.manual_seed(0)
    triples = [
        (nn.Parameter(torch.randn(d, 40), requires_grad=False), nn.Parameter(torch.randn(6, 40)),
         nn.Parameter(torch.randn(d, 6)))
        for d in (24, 8, 16)
    ]  # fmt: skip
    scales = [0.7, 1.0, 0.25]

    def columns(reuse=1):
        weights, lora_As, lora_Bs = (list(c) for c in zip(*triples))
        return weights, lora_As, lora_Bs, scales, [reuse] * 3, [True] * 3

    def exact():
        return torch.cat([dora.factored_row_norm(w, a, b, s) for (w, a, b), s in zip(triples, scales)])

    def per_module():  # the op's own path (on a CPU it never takes the batch)
        with torch.no_grad():
            return torch.ops.peft.dora_weight_norms.default(*columns())

    def batched(reuse=1):
        dora.graph_counts.clear()
        with torch.no_grad():
            out = dora_norm._BatchGraph.replay_for(*columns(reuse))
        return out, dora.graph_counts["batch_replayed"], dora.graph_counts["captured"]

    assert_close(per_module(), exact())  # computed: records without a graph
    assert batched() == (None, 0, 0)
    assert_close(per_module(), exact())  # each module's graph captured
    out, launches, captured = batched()
    assert (launches, captured) == (1, 1)  # the batch captured, launched once
    assert_close(out, exact())
    out.mul_(0)  # a copy: the kept slices stay
    for _ in range(2):
        with torch.no_grad():
            triples[1][2].mul_(1.5)  # in place: the graph reads it
        out, launches, captured = batched()
        assert (launches, captured) == (1, 0)
        assert_close(out, exact())
    # each record keeps its slice of the last launch, at the versions it was computed from
    for (weight, lora_A, lora_B), piece in zip(triples, exact().split([24, 8, 16])):
        record = dora_norm._op_records[(id(weight), id(lora_A), id(lora_B))]
        assert_close(record.value, piece)
        assert record.state[:3] == (weight._version, lora_A._version, lora_B._version)
    assert batched(reuse=2)[0] is None  # eval: the kept norms, nothing to launch
    assert dora_norm._BatchGraph.replay_for(*(c[:1] for c in columns())) is None  # one triple: its own graph

    assert _in_backward(batched) == (None, 0, 0)  # in a backward: the kept norms, module by module

    triples[0][1].data = triples[0][1].data * 2  # a new storage behind the same A
    assert batched() == (None, 0, 0)
    assert_close(per_module(), exact())  # that module computes (a new record), the others replay
    assert batched() == (None, 0, 0)
    assert_close(per_module(), exact())  # its graph captured
    out, launches, captured = batched()
    assert (launches, captured) == (1, 1)  # the batch captured again, from the new record
    assert_close(out, exact())

    # the table holds a batch only while its records live (a record dies with any of its parameters; here the
    # stand-in's replay function holds the parameters, so the records are dropped from their own table instead)
    del record
    assert len(dora_norm._batch_graphs) == 1  # the first batch went with its record for the old A
    dora_norm._op_records.clear()
    gc.collect()
    assert not dora_norm._batch_graphs


def test_compiled_forwards_never_read_the_training_record(fresh_dynamo):
    """A layer's training record (``dora_cache.TrainRecord``, made by eager training forwards) is state that changes
    between calls: compiled forwards must not read it, or Dynamo guards on it and a record made or replaced by an
    eager forward in between recompiles the compiled model."""
    model = _dora_model(TwoLinear(), ["l1", "l2"])
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(4, 7, 32)
    layers = [m for m in model.modules() if isinstance(m, dora.DoraLinearLayer)]
    assert len(layers) == 2
    for step in range(3):
        for layer in layers:  # stand-ins for records that eager forwards would leave, a new object each time
            layer._reuse.train = None if step == 0 else object()
        compiled(x).square().sum().backward()
    assert counter.frame_count == 1
