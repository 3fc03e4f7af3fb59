"""Norm reuse: one norm per change of W, A, B or s, never a stale one.

Default (``PEFT_DORA_NORM_CACHE`` unset): a gradient-checkpoint recompute reuses the norm of its own forward, and an
eval-mode forward that autograd does not record through W, A or B reuses it across forwards.
``PEFT_DORA_NORM_CACHE=1``: any forward reuses it while the tensors' identity, storage and version counters hold
and no optimizer step or merge happened. ``0``: never.
"""

import copy
import gc
import io
import warnings

import pytest
import torch
from dora_testing import StandInNormGraph, assert_close
from test_dora_parity import build
from torch import nn
from torch.utils.checkpoint import checkpoint

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora


@pytest.fixture
def norm_cache(dora_env):
    return lambda value: dora_env("PEFT_DORA_NORM_CACHE", value)


class Checkpointed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=False)


def checkpointed_model(seed=0):
    model = build("linear", bias=True, dropout=0.0, seed=seed)
    return model, Checkpointed(model)


def train_steps(wrapper, params, steps, micro_steps, seed=0):
    opt = torch.optim.AdamW(params, lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        for _ in range(micro_steps):
            x = torch.randn(4, 24, generator=gen)
            loss = wrapper(x).pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses)


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def test_default_reuses_only_in_checkpoint_recompute(norm_cache):
    norm_cache(None)
    model, wrapper = checkpointed_model()
    dora.norm_counts.clear()
    x = torch.randn(4, 24)
    wrapper(x).sum().backward()
    assert dora.norm_counts["norm_computed"] == 2  # one per DoRA layer, in the forward
    assert dora.norm_counts["norm_reused"] == 2  # the recompute in backward
    wrapper(x).sum().backward()
    assert dora.norm_counts["norm_computed"] == 4  # a new forward recomputes by default


@pytest.mark.parametrize("mode", [None, "1"])
def test_training_is_bitwise_identical_to_no_reuse(norm_cache, mode):
    norm_cache("0")
    model, wrapper = checkpointed_model()
    expected = train_steps(wrapper, trainable(model), steps=3, micro_steps=4)
    expected_params = [p.detach().clone() for p in trainable(model)]
    norm_cache(mode)
    model, wrapper = checkpointed_model()
    dora.norm_counts.clear()
    got = train_steps(wrapper, trainable(model), steps=3, micro_steps=4)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for p, q in zip(trainable(model), expected_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    if mode == "1":
        # ga=4 with checkpointing: one norm per layer per optimizer step, not 8
        assert dora.norm_counts["norm_computed"] == 3 * 2
        assert dora.norm_counts["norm_reused"] == 3 * 2 * 7


def fresh_output(model, x):
    """The output with reuse switched off: what any reused norm must reproduce."""
    import os

    old = os.environ.get("PEFT_DORA_NORM_CACHE")
    os.environ["PEFT_DORA_NORM_CACHE"] = "0"
    dora._invalidate_fused_cache()
    try:
        with torch.no_grad():
            return model(x)
    finally:
        if old is None:
            del os.environ["PEFT_DORA_NORM_CACHE"]
        else:
            os.environ["PEFT_DORA_NORM_CACHE"] = old
        dora._invalidate_fused_cache()


def lin0(model):
    return model.base_model.model.lin0


def optimizer_step(model):
    with torch.enable_grad():
        sum(p.sum() for p in trainable(model)).backward()
    torch.optim.SGD(trainable(model), lr=0.1).step()


CHANGES = {
    "in-place edit of A": lambda m: lin0(m).lora_A["default"].weight.mul_(1.5),
    "in-place edit of B": lambda m: lin0(m).lora_B["default"].weight.add_(0.1),
    "in-place edit of W": lambda m: lin0(m).base_layer.weight.mul_(0.9),
    "new parameter object for W": lambda m: setattr(
        lin0(m).base_layer, "weight", nn.Parameter(lin0(m).base_layer.weight * 1.1)
    ),
    "load_state_dict": lambda m: m.load_state_dict(
        {k: v * 1.2 for k, v in m.state_dict().items() if "lora_A" in k}, strict=False
    ),
    "optimizer step": lambda m: optimizer_step(m),
    "scaling change": lambda m: lin0(m).set_scale("default", 0.5),
    "merge and unmerge of another LoRA adapter": lambda m: (
        m.add_adapter("plain", LoraConfig(target_modules=["lin0"], init_lora_weights=False)),
        m.base_model.set_adapter(["default"]),
        lin0(m).merge(adapter_names=["plain"]),
        lin0(m).unmerge(),
    ),
    "DoRA merge and unmerge": lambda m: (lin0(m).merge(), lin0(m).unmerge()),
    "dtype move": lambda m: m.double(),
    "invalidate after a .data write": lambda m: (
        lin0(m).lora_B["default"].weight.data.mul_(2.0),
        dora.invalidate_norm_caches(),
    ),
    "a new storage for W at its old address": lambda m: new_storage_at_same_address(lin0(m).base_layer.weight),
    "a new storage for B at its old address": lambda m: new_storage_at_same_address(lin0(m).lora_B["default"].weight),
}


def new_storage_at_same_address(param):
    """``param.data = ...`` with a new storage that starts where the old one does and holds other values: what the
    allocator may do with ``p.data = p.data + 1`` twice (the second result where the first storage was freed). The
    data pointer and the version counter stay; only the storage is new."""
    memory = param.detach().numpy()
    param.data = torch.from_numpy(memory)  # a new storage over the same memory
    memory *= 0.5  # the values such a storage holds


@pytest.mark.parametrize("mode", ["eval default", "1"])
@pytest.mark.parametrize("change", list(CHANGES))
def test_never_stale_across_forwards(norm_cache, change, mode):
    norm_cache("1" if mode == "1" else None)
    model = build("linear", bias=True, dropout=0.0)
    if mode == "eval default":
        model.eval()
    x = torch.randn(3, 24)
    with torch.no_grad():
        model(x)
        dora.norm_counts.clear()
        model(x)
    assert dora.norm_counts["norm_reused"] == 2 and dora.norm_counts["norm_computed"] == 0
    assert_fresh_after(CHANGES[change], model, x)


def assert_fresh_after(change, model, x):
    """Apply ``change`` (quietly, without autograd), then the next forward must equal one with reuse off."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        change(model)
    x = x.to(next(model.parameters()).dtype)
    with torch.no_grad():
        got = model(x)
    assert_close(got, fresh_output(model, x), scale=0)


def test_adapter_switch_uses_each_adapters_own_norm(norm_cache):
    norm_cache("1")
    model = build("linear", bias=True, dropout=0.0)
    model.add_adapter("other", LoraConfig(target_modules=["lin0", "lin1"], use_dora=True, init_lora_weights=False))
    x = torch.randn(3, 24)
    with torch.no_grad():
        first = model(x)
        model.base_model.set_adapter("other")
        other = model(x)
        assert_close(other, fresh_output(model, x), scale=0)
        model.base_model.set_adapter("default")
        again = model(x)
    assert not torch.equal(first, other)
    assert_close(again, first, scale=0)


def two_eval_forwards(x):
    """An eval-mode model's second no-grad forward (counted from a cleared ``norm_counts``) equals its first."""
    model = build("linear", bias=True, dropout=0.0).eval()
    with torch.no_grad():
        expected = model(x)
        dora.norm_counts.clear()
        got = model(x)
    assert_close(got, expected, scale=0)
    return model


def test_inference_reuses_the_scale(norm_cache):
    norm_cache("1")
    x = torch.randn(3, 24)
    model = two_eval_forwards(x)
    assert dora.norm_counts["scale_reused"] == 2 and dora.norm_counts["scale_computed"] == 0
    # with autograd on the magnitude, g is rebuilt so that m gets its gradient
    dora.norm_counts.clear()
    model(x).sum().backward()
    assert dora.norm_counts["scale_computed"] == 0 and dora.norm_counts["scale_reused"] == 0
    assert lin0(model).lora_magnitude_vector["default"].weight.grad is not None


def test_off_never_reuses(norm_cache):
    norm_cache("0")
    model, wrapper = checkpointed_model()
    dora.norm_counts.clear()
    wrapper(torch.randn(4, 24)).sum().backward()
    assert dora.norm_counts["norm_reused"] == 0 and dora.norm_counts["norm_computed"] == 4


def test_untracked_weights_are_always_recomputed(norm_cache):
    # a dequantized weight is a fresh tensor every forward: nothing to identify, so nothing is reused
    from test_dora_layers import FakeQuantLinear

    norm_cache("1")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 12))
    peft_model = get_peft_model(model, LoraConfig(target_modules=["0"], use_dora=True, init_lora_weights=False))
    layer = peft_model.base_model.model[0]
    layer.base_layer = FakeQuantLinear(layer.base_layer)
    dora.norm_counts.clear()
    with torch.no_grad():
        peft_model(torch.randn(2, 16))
        peft_model(torch.randn(2, 16))
    assert dora.norm_counts["norm_reused"] == 0 and dora.norm_counts["norm_computed"] == 2


def test_copies_and_pickles_start_empty(norm_cache):
    norm_cache("1")
    model = build("linear", bias=True, dropout=0.0)
    x = torch.randn(3, 24)
    with torch.no_grad():
        expected = model(x)
    clone = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (clone, loaded):
        dora.norm_counts.clear()
        with torch.no_grad():
            assert_close(other(x), expected, scale=0)
        assert dora.norm_counts["norm_computed"] == 2


def test_invalid_norm_cache_value(norm_cache):
    norm_cache("sometimes")
    with pytest.raises(ValueError, match="PEFT_DORA_NORM_CACHE"):
        build("linear", bias=True, dropout=0.0)(torch.randn(1, 24))


@pytest.mark.parametrize("mode", [None, "1"])
def test_inference_mode_then_training(norm_cache, mode):
    norm_cache(mode)
    model, wrapper = checkpointed_model()
    x = torch.randn(4, 24)
    with torch.inference_mode():
        first = model(x)
        again = model(x)
    assert_close(again, first, scale=0)
    wrapper(x).sum().backward()  # no inference tensor may leak into the autograd graph
    assert lin0(model).lora_magnitude_vector["default"].weight.grad is not None


def test_default_reuses_in_eval_without_autograd(norm_cache):
    norm_cache(None)
    x = torch.randn(3, 24)
    model = two_eval_forwards(x)
    assert dora.norm_counts["norm_reused"] == 2 and dora.norm_counts["norm_computed"] == 0
    assert dora.norm_counts["scale_reused"] == 2 and dora.norm_counts["scale_computed"] == 0
    # eval with autograd through trainable A, B (fine-tuning with dropout off): recomputed, as in training
    dora.norm_counts.clear()
    model(x).sum().backward()
    assert dora.norm_counts["norm_reused"] == 0 and dora.norm_counts["norm_computed"] == 2
    # training mode without autograd (no model.eval()): recomputed
    model.train()
    dora.norm_counts.clear()
    with torch.no_grad():
        model(x)
    assert dora.norm_counts["norm_reused"] == 0 and dora.norm_counts["norm_computed"] == 2


def test_default_eval_reuse_with_frozen_adapters_and_autograd(norm_cache):
    # frozen W, A, B (an inference-only adapter) with autograd on for the input: the norm is reused
    norm_cache(None)
    model = build("linear", bias=True, dropout=0.0).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(3, 24, requires_grad=True)
    expected = fresh_output(model, x.detach())
    model(x)
    dora.norm_counts.clear()
    got = model(x)
    got.sum().backward()
    assert dora.norm_counts["norm_reused"] == 2 and dora.norm_counts["norm_computed"] == 0
    assert_close(got.detach(), expected, scale=0)
    assert x.grad is not None


def test_mode_switch_forgets_reused_norms(norm_cache):
    # a .data write is invisible to version counters; a train()/eval() switch in between still drops the norm
    for mode in (None, "1"):
        norm_cache(mode)
        model = build("linear", bias=True, dropout=0.0).eval()
        x = torch.randn(3, 24)
        with torch.no_grad():
            model(x)
        model.train()
        lin0(model).lora_B["default"].weight.data.mul_(2.0)
        model.eval()
        with torch.no_grad():
            got = model(x)
        assert_close(got, fresh_output(model, x), scale=0)


def test_inference_mode_reuses_only_inside_inference_mode(norm_cache):
    norm_cache(None)
    model, wrapper = checkpointed_model()
    model.eval()
    x = torch.randn(4, 24)
    with torch.inference_mode():
        first = model(x)
        dora.norm_counts.clear()
        again = model(x)
    assert dora.norm_counts["norm_reused"] == 2 and dora.norm_counts["norm_computed"] == 0
    assert_close(again, first, scale=0)
    with torch.no_grad():
        dora.norm_counts.clear()
        model(x)  # outside inference mode, an inference tensor is never handed out
        assert dora.norm_counts["norm_reused"] == 0 and dora.norm_counts["norm_computed"] == 2
    model(x).sum().backward()
    model.train()
    wrapper(x).sum().backward()
    assert lin0(model).lora_magnitude_vector["default"].weight.grad is not None


W_CHANGES = {k: CHANGES[k] for k in (
    "in-place edit of W", "new parameter object for W", "DoRA merge and unmerge", "dtype move",
    "merge and unmerge of another LoRA adapter",
)}  # fmt: skip
W_CHANGES["load_state_dict of W"] = lambda m: m.load_state_dict(
    {k: v * 1.2 for k, v in m.state_dict().items() if k.endswith("lin0.base_layer.weight")}, strict=False
)
W_CHANGES["invalidate after a .data write to W"] = lambda m: (
    lin0(m).base_layer.weight.data.mul_(0.5),
    dora.invalidate_norm_caches(),
)


def test_kept_norms_do_not_keep_replaced_storages_alive(norm_cache):
    """A memo pins the storages it was computed from (their ``StorageImpl``, so no new storage takes their address),
    not their data: a storage replaced behind a parameter is freed while the memo still holds its key."""
    from torch.multiprocessing.reductions import StorageWeakRef

    model = build("linear", bias=True, dropout=0.0)
    model.eval()
    weight = lin0(model).base_layer.weight
    with torch.no_grad():
        model(torch.randn(3, 24))
    old = StorageWeakRef(weight.untyped_storage())
    assert lin0(model).lora_magnitude_vector["default"]._reuse.norm.pins  # the memo holds pins ...
    weight.data = weight.data.clone()
    gc.collect()
    assert old.expired()  # ... and the old storage's data is gone


def test_frozen_weight_square_norm_outlives_optimizer_steps(norm_cache):
    # training by default: ||W||² of the frozen base weight is computed once; the norm itself every micro-step
    norm_cache(None)
    model, wrapper = checkpointed_model()
    dora.norm_counts.clear()
    got = train_steps(wrapper, trainable(model), steps=3, micro_steps=2)
    assert dora.norm_counts["w_sq_computed"] == 2 and dora.norm_counts["w_sq_reused"] == 3 * 2 * 2 - 2
    assert dora.norm_counts["norm_computed"] == 3 * 2 * 2
    norm_cache("0")
    model, wrapper = checkpointed_model()
    torch.testing.assert_close(got, train_steps(wrapper, trainable(model), steps=3, micro_steps=2), rtol=0, atol=0)


@pytest.mark.parametrize("change", list(W_CHANGES))
def test_frozen_weight_square_norm_never_stale(norm_cache, change):
    norm_cache(None)
    model = build("linear", bias=True, dropout=0.0)  # training mode: only ||W||² is kept across forwards
    x = torch.randn(3, 24)
    model(x)
    dora.norm_counts.clear()
    model(x)
    assert dora.norm_counts["w_sq_reused"] == 2 and dora.norm_counts["norm_computed"] == 2
    assert_fresh_after(W_CHANGES[change], model, x)


def test_norm_graph_switch_parsed_and_cpu_never_graphs(dora_env):
    dora_env("PEFT_DORA_NORM_GRAPH", "often")
    with pytest.raises(ValueError, match="PEFT_DORA_NORM_GRAPH"):
        build("linear", bias=True, dropout=0.0)(torch.randn(1, 24))
    dora_env("PEFT_DORA_NORM_GRAPH", "1")
    model = build("linear", bias=True, dropout=0.0)
    model.train()
    dora.graph_counts.clear()
    for _ in range(3):
        model(torch.randn(2, 24)).sum().backward()
    assert sum(dora.graph_counts.values()) == 0  # CUDA graphs need CUDA tensors: CPU norms stay eager
    layer = model.base_model.model.lin0
    assert layer.lora_magnitude_vector["default"]._reuse.graph.graph is None
    assert copy.deepcopy(layer).lora_magnitude_vector["default"]._reuse.graph.key is None


def test_zero3_partition_zero_test_once_per_step_and_never_stale(tmp_path):
    """``dora_dist.PartitionZeroTest`` on stand-ins for DeepSpeed ZeRO-3 magnitudes (``ds_tensor``: the rank's
    partition; ``ds_process_group``), in a one-process gloo group: the first asker after an optimizer step tests
    every magnitude of the group asked about so far, once; a new magnitude, an optimizer step, a merge, or an edit
    of the asking magnitude's partition (its version) tests again; a zero in any of them answers "keep the buffer"
    (False) for all until the next test."""
    import torch.distributed as dist

    from peft.tuners.lora import dora_cache, dora_dist

    if dist.is_initialized():
        pytest.skip("a process group exists in this process already")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    tests, has_zero = [0], dora_cache._has_zero

    def counted(*parts):
        tests[0] += 1
        return has_zero(*parts)

    def magnitude(values):
        m = nn.Parameter(torch.empty(0))
        m.ds_tensor, m.ds_process_group, m.ds_id = torch.tensor(values), dist.group.WORLD, 0
        return m

    dora_cache._has_zero = counted
    try:
        known = dora_dist.PartitionZeroTest()
        m1, m2 = magnitude([1.0, 2.0]), magnitude([3.0])
        assert known.get((m1,)) is True and tests[0] == 1
        assert known.get((m2,)) is True and tests[0] == 2  # a new member: both tested again
        assert known.get((m1,)) is True and known.get((m2,)) is True and tests[0] == 2  # the kept answer
        with torch.no_grad():
            m2.ds_tensor[0] = 0.0  # an edit of the partition: its version moves
        assert known.get((m2,)) is False and tests[0] == 3
        assert known.get((m1,)) is False and tests[0] == 3  # a zero anywhere keeps every node's buffer
        with torch.no_grad():
            m2.ds_tensor.data[0] = 5.0  # through .data (as DeepSpeed writes partitions): no version moves...
        dora_cache._after_optimizer_step()  # ...but the optimizer step that wrote it ends the answer
        assert known.get((m1,)) is True and tests[0] == 4
        dora_cache.invalidate_norm_caches()  # a merge too
        assert known.get((m2,)) is True and tests[0] == 5
        assert dora_cache.output_saves_itself(m1, known) is True and tests[0] == 5  # as the training nodes ask
        assert dora_dist.PartitionZeroTest.applies(m1)
        m1.ds_tensor = torch.tensor([1.0], device="meta")  # offloaded elsewhere: the node's own test instead
        assert not dora_dist.PartitionZeroTest.applies(m1)
    finally:
        dora_cache._has_zero = has_zero
        dora_dist.PartitionZeroTest._groups.clear()
        dist.destroy_process_group()


class _TorchFunctionCounting(torch.Tensor):
    """A parameter subclass with a Python ``__torch_function__`` (as bitsandbytes' ``Params4bit`` has), counting the
    calls that go through it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_memo_keys_a_torch_function_subclass_without_calling_it():
    """A memo's key reads data pointer, version, layout and device of each source; for a tensor subclass with a Python
    ``__torch_function__`` those reads must not go through it (a QDoRA forward paid ~4x a plain one's key for it), and
    the key must still see an in-place change."""
    from peft.tuners.lora.dora_cache import Memo, capturing

    weight = torch.randn(8, 4).as_subclass(_TorchFunctionCounting)
    plain = torch.randn(8)
    memo = Memo()
    value = torch.ones(8)
    memo.put((weight, plain), value)
    _TorchFunctionCounting.calls = 0
    assert memo.get((weight, plain)) is value
    assert not capturing((weight, plain))
    assert _TorchFunctionCounting.calls == 0
    with torch.no_grad():
        torch.Tensor.add_(weight.as_subclass(torch.Tensor), 1.0)  # shares the version counter
    assert memo.get((weight, plain)) is None


def test_memo_carried_over_an_optimizer_step_only_from_the_epoch_it_ended():
    """``Memo.carry(epoch)`` (the sharded magnitudes' zero-test answers across a step of an optimizer that does not
    hold them) keeps a value put at the epoch that step ended, as if put again now, and nothing else: not a value put
    before an earlier step, not a frozen memo's (keyed on merges, which steps do not end), and the carried value
    still misses once its tensors change."""
    from peft.tuners.lora import dora_cache

    m = torch.randn(8)
    other = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([other], lr=0.1)

    def step() -> int:  # the epoch the step ends
        before = dora_cache._epoch[0]
        other.grad = torch.ones(2)
        opt.step()
        return before

    kept, old, frozen = dora_cache.Memo(), dora_cache.Memo(), dora_cache.Memo(frozen=True)
    old.put((m,), True)
    step()
    kept.put((m,), True)
    frozen.put((m,), True)
    ended = step()
    assert kept.get((m,)) is None and old.get((m,)) is None  # the step ended both
    for memo in (kept, old, frozen):
        memo.carry(ended)
    assert kept.get((m,)) is True
    assert old.get((m,)) is None  # put before the step before: not carried
    assert frozen.get((m,)) is True and frozen.key[0] == dora_cache._merge_epoch[0]  # untouched
    m.add_(1.0)
    assert kept.get((m,)) is None


def test_base_layer_fast_path_matches_get_base_layer():
    """``dora._base_layer`` skips ``get_base_layer()``'s attribute probe where the wrapped layer has no ``base_layer``
    of its own, and defers to it where it has one (a module, an attribute or a property)."""

    class LinearSubclass(nn.Linear):
        pass

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.base_layer = inner

    class WithAttribute(nn.Linear):
        def __init__(self, *args):
            super().__init__(*args)
            self.__dict__["base_layer"] = nn.Linear(2, 2)

    class WithProperty(nn.Linear):
        @property
        def base_layer(self):
            return self._probe

        def __init__(self, *args):
            super().__init__(*args)
            self._probe = nn.Linear(2, 2)

    inners = (nn.Linear(2, 2), LinearSubclass(2, 2), Wrapper(nn.Linear(2, 2)), WithAttribute(2, 2), WithProperty(2, 2))
    for inner in inners:
        outer = Wrapper(inner)
        outer.get_base_layer = lambda outer=outer: _walk(outer)
        assert dora._base_layer(outer) is _walk(outer)


def _walk(module):
    while hasattr(module, "base_layer"):
        module = module.base_layer
    return module


def test_eager_training_record_replays_and_is_never_stale(norm_cache):
    """``dora_norm.eager_record`` (made on a GPU once a layer's norm graph is captured): training forwards replay
    the graph after its checks and the checkpoint recompute takes the forward's norm back; an optimizer step, an
    in-place edit of the frozen W, a new scaling or new settings never get a stale norm (the slow path answers),
    and train()/eval() drop it. Bitwise the gradients of a model without the record."""
    from peft.tuners.lora import dora_norm

    norm_cache(None)
    model, wrapper = checkpointed_model()
    ref_model, ref_wrapper = checkpointed_model()
    linear = model.base_model.model.lin0
    layer = linear.lora_magnitude_vector["default"]
    weight, lora_A, lora_B = linear.base_layer.weight, linear.lora_A["default"].weight, linear.lora_B["default"].weight
    scaling = linear.scaling["default"]
    w_sq = dora_norm.row_sq_norm(weight)
    graph = StandInNormGraph(weight, lora_A, lora_B, scaling, w_sq)
    graph.replay()
    record = dora_norm.eager_record(graph, weight, lora_A, lora_B, scaling, w_sq, graph.out.clone())
    assert record is not None
    layer._reuse.record = record
    opts = [torch.optim.AdamW(trainable(m), lr=1e-2) for m in (model, ref_model)]
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        if step == 3:
            with torch.no_grad():  # the frozen W edited in place: its kept ||W||² is stale, the record steps aside
                for m in (model, ref_model):
                    m.base_model.model.lin0.base_layer.weight.mul_(1.5)
        x = torch.randn(4, 24, generator=gen)
        replays = graph.replays
        dora.norm_counts.clear()
        grads = []
        for m, w, opt in zip((model, ref_model), (wrapper, ref_wrapper), opts):
            w(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in trainable(m)])
            opt.step()
            opt.zero_grad()
        for g, h in zip(*grads):
            assert torch.equal(g, h)
        # one replay in the forward and the forward's norm again in the recompute, until W changed behind ||W||²
        assert graph.replays == replays + (step < 3)
        assert dora.norm_counts["norm_reused"] == 4  # both layers of both models, in their recomputes
    linear.scaling["default"] = scaling * 2  # another scaling: the layout differs
    assert record.answer(weight, lora_A, lora_B, scaling * 2, 1, True, eager=True) is None
    linear.scaling["default"] = scaling
    dora._invalidate_fused_cache()  # new settings: the record answers under the ones it was made with only
    assert record.answer(weight, lora_A, lora_B, scaling, 1, True, eager=True) is None
    model.eval()
    assert layer._reuse.record is None
    norm_cache("1")  # the record does not follow PEFT_DORA_NORM_CACHE's reuse rules: none is made there
    assert dora_norm.eager_record(graph, weight, lora_A, lora_B, scaling, w_sq, graph.out) is None


def test_norm_graph_hands_out_its_buffer_and_copies_of_an_inference_one():
    """``dora_graph.NormGraph`` hands out its output buffer itself, bumping its version only when a replay was from
    other input versions than the last write; a buffer captured under torch.inference_mode (an inference tensor: no
    version counter) goes out as an ordinary copy; the compile op's ``StorageNormGraph`` always copies."""
    from peft.tuners.lora import dora_graph

    a, b = torch.randn(3, 4), torch.randn(5, 3)
    graph = dora_graph.NormGraph()
    graph.out = torch.randn(5)
    assert graph._handed_out((a, b)) is graph.out
    version = graph.out._version
    assert graph._handed_out((a, b)) is graph.out and graph.out._version == version  # same inputs: same values
    with torch.no_grad():
        a.mul_(2)
    graph._handed_out((a, b))
    assert graph.out._version == version + 1  # rewritten from an edited input
    with torch.inference_mode():
        graph.out = torch.randn(5)
    copy = graph._handed_out((a, b))
    assert copy is not graph.out and not copy.is_inference() and torch.equal(copy, graph.out)
    storage = dora_graph.StorageNormGraph()
    storage.out = torch.randn(5)
    assert storage._handed_out((a, b)) is not storage.out


def _flat_views(device="cpu"):
    """W, A and B as FSDP1 hands them to a forward: views of one flat parameter (``_is_flat_param``, FSDP1's mark)."""
    flat = nn.Parameter(torch.randn(8 * 6 + 2 * 6 + 8 * 2, device=device))
    flat._is_flat_param = True
    w, a, b = flat.split([48, 12, 16])
    return w.view(8, 6), a.view(2, 6), b.view(8, 2)


def test_fsdp1_views_count_as_regathered():
    """``dora_cache.regathered``: FSDP1's views of its flat parameter (new every forward, over storage gathered anew)
    are told from parameters and their own views, so no norm graph is keyed on them (``norm_graph_applies``)."""
    from peft.tuners.lora import dora_cache

    views = _flat_views()
    assert all(v._base is not None for v in views) and dora_cache.regathered(views)
    assert dora_cache.regathered((nn.Parameter(torch.ones(8, 6)), *views[1:]))
    plain = (nn.Parameter(torch.ones(8, 6)), nn.Parameter(torch.ones(2, 6)))
    assert not dora_cache.regathered((*plain, plain[0][:, :2]))  # a view of a plain parameter is tracked
