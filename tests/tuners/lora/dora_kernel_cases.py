"""Kernel-vs-twin cases for the Triton interpreter; `test_dora_fused_kernels.py` runs this file in a child process
with TRITON_INTERPRET=1 (Triton fixes interpretation when a kernel is decorated, i.e. when peft is first imported).

Run directly: TRITON_INTERPRET=1 python -m pytest tests/tuners/lora/dora_kernel_cases.py -q
"""

import contextlib

import pytest
import torch
from dora_testing import StandInNormGraph, assert_close
from dora_testing import relative_error as _rel_err

from peft.tuners.lora import dora_dispatch as dispatch
from peft.tuners.lora import dora_fused as F


if not F.kernels_available(torch.empty(0)):
    raise RuntimeError("dora_kernel_cases.py needs TRITON_INTERPRET=1 set before peft is imported")

TOKENS = (0, 1, 7, 33)
D_OUT = (1, 5, 123, 130)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE = 0.75


def _inputs(tokens, d_out, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed * 1000 + tokens * 131 + d_out)
    lora = torch.randn(tokens, d_out, generator=gen).to(dtype)
    base = torch.randn(tokens, d_out, generator=gen).to(dtype)
    g = 1.0 + 0.01 * torch.randn(d_out, generator=gen)  # fp32 magnitude scale close to 1, as in training
    return lora, base, g


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d_out", D_OUT)
@pytest.mark.parametrize("tokens", TOKENS)
def test_compose_and_forward_inner(tokens, d_out, dtype):
    lora, base, g = _inputs(tokens, d_out, dtype)
    expected = F.compose_torch(lora, base, g, SCALE)
    out = F.fused_dora_compose(lora, base, g, SCALE, inplace=False)
    assert out.dtype == dtype and out.shape == lora.shape
    assert_close(out, expected)
    out_ref, inner_ref = F._forward_and_inner_torch(lora, base, g, SCALE)
    out2, inner = F.fused_dora_forward_and_inner(lora, base, g, SCALE)
    assert_close(out2, out_ref)
    assert_close(inner, inner_ref)
    torch.testing.assert_close(out2, out, rtol=0, atol=0)  # one kernel body: both entry points agree bitwise
    in_place = F.fused_dora_compose(lora, base, g.view(1, -1), SCALE, inplace=True)
    assert in_place.data_ptr() == lora.data_ptr()
    torch.testing.assert_close(in_place, out, rtol=0, atol=0)


@pytest.fixture(params=("one_band", "two_stage"))
def d_mag_sum(request, monkeypatch):
    """The backward's d_m sums: finished in the backward kernel (one band, up to ``SINGLE_BAND_NUMEL`` gradient
    elements: every case here) or by the column-sum kernel over row bands (as above it)."""
    if request.param == "two_stage":
        monkeypatch.setattr(F, "SINGLE_BAND_NUMEL", 0)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d_out", D_OUT)
@pytest.mark.parametrize("tokens", TOKENS)
def test_backward(tokens, d_out, dtype, d_mag_sum):
    lora, base, g = _inputs(tokens, d_out, dtype, seed=1)
    d_out_t = torch.randn(tokens, d_out).to(dtype)
    inner = F._forward_and_inner_torch(lora, base, g, SCALE)[1]
    got = F._fused_backward(d_out_t, inner, g, SCALE, True, True, True)
    want = F._backward_torch(d_out_t, inner, g, SCALE, True, True, True)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_close(a, b, dtype=dtype)
    only_mag = F._fused_backward(d_out_t, inner, g, SCALE, False, False, True)
    assert only_mag[0] is None and only_mag[1] is None
    torch.testing.assert_close(only_mag[2], got[2], rtol=0, atol=0)


@pytest.mark.parametrize("tokens", (1, 300))
def test_d_mag_is_bitwise_repeatable(tokens, d_mag_sum):
    lora, base, g = _inputs(tokens, 130, torch.bfloat16, seed=2)
    d_out_t = torch.randn(tokens, 130).to(torch.bfloat16)
    runs = [F._fused_backward(d_out_t, base, g, SCALE, False, False, True)[2] for _ in range(3)]
    for r in runs[1:]:
        assert torch.equal(r.view(torch.int32), runs[0].view(torch.int32))


def test_strided_rows_and_3d():
    """A column slice (row stride > d_out) and a [batch, seq, d_out] activation run in the kernel, not the twin."""
    full = torch.randn(2, 9, 200)
    lora, base, g = full[..., 10:133], torch.randn(2, 9, 123), 1 + 0.01 * torch.randn(1, 123)
    assert dispatch.kernels_support(lora, base, g)
    assert_close(F.fused_dora_compose(lora, base, g, SCALE, inplace=False), F.compose_torch(lora, base, g, SCALE))
    expected = F.compose_torch(lora, base, g, SCALE)
    F.fused_dora_compose(lora, base, g, SCALE, inplace=True)
    assert_close(full[..., 10:133], expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", (1, 5, 123, 300))
def test_norm_assembly(n, dtype):
    gen = torch.Generator().manual_seed(n)
    w_sq = torch.rand(n, generator=gen).to(dtype)
    cross = torch.randn(n, generator=gen).to(dtype)
    ba_sq = torch.rand(n, generator=gen).to(dtype)
    cross[0] = -10.0  # negative total: clamped to 0
    if n > 2:
        cross[1], ba_sq[2] = float("nan"), float("inf")
    (got,) = F.fused_norm_assembly(w_sq, cross, ba_sq, 0.5)
    want = F._norm_assembly_torch(w_sq, cross, ba_sq, 0.5)
    assert got.dtype == dtype
    assert_close(got, want, dtype=dtype, equal_nan=True)  # NaN and Inf in the same places


def test_autograd_function_matches_twin_gradients():
    lora, base, g = _inputs(7, 130, torch.float32, seed=3)
    leaves = [t.clone().requires_grad_() for t in (lora, base, g)]
    ref_leaves = [t.clone().requires_grad_() for t in (lora, base, g)]
    F.fused_dora_compose_autograd(*leaves, SCALE).square().sum().backward()
    F.compose_torch(*ref_leaves, SCALE).square().sum().backward()
    for a, b in zip(leaves, ref_leaves):
        assert_close(a.grad, b.grad)


# ---------------------------------------------------------------------------------------------------------------
# The one-pass output kernel: y = result + ((g - 1)·base + g·(s·lora)), base = result - bias, g = m / max(n, eps).
# ---------------------------------------------------------------------------------------------------------------

EPS = 1e-6


def _output_inputs(tokens, d_out, dtype, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed * 1000 + tokens * 131 + d_out)
    result = torch.randn(tokens, d_out, generator=gen).to(dtype)
    lora = torch.randn(tokens, d_out, generator=gen).to(dtype)
    norm = 0.5 + torch.rand(d_out, generator=gen)
    magnitude = norm * (1.0 + 0.01 * torch.randn(d_out, generator=gen))  # g close to 1, as in training
    b = torch.randn(d_out, generator=gen).to(dtype) if bias else None
    return result, lora, b, magnitude, norm


def _output_fp64(result, lora, bias, magnitude, norm, d_y):
    """The output and the gradients of result, lora and m in fp64: the reference both paths are judged against."""
    r, lo, d = result.double(), lora.double(), d_y.double()
    g = magnitude.double() / norm.double().clamp_min(EPS)
    base = r if bias is None else r - bias.double()
    y = r + ((g - 1) * base + g * (SCALE * lo))
    d_m = ((SCALE * lo + base) * d).sum(0) / norm.double().clamp_min(EPS)
    return y, g * d, g * SCALE * d, d_m


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d_out", (1, 123, 130))
@pytest.mark.parametrize("tokens", TOKENS)
def test_output_kernel_forward_and_gradients(tokens, d_out, dtype, bias, d_mag_sum):
    result, lora, b, magnitude, norm = _output_inputs(tokens, d_out, dtype, seed=4, bias=bias)
    d_y = torch.randn(tokens, d_out).to(dtype)
    want = _output_fp64(result, lora, b, magnitude, norm, d_y)
    r, lo, m = result.clone().requires_grad_(), lora.clone().requires_grad_(), magnitude.clone().requires_grad_()
    r2, lo2 = r * 1, lo * 1  # non-leaf inputs, as a layer's outputs are
    y = F.fused_dora_output(r2, lo2, m, norm, SCALE, EPS, bias=b)
    assert y.data_ptr() == lo2.data_ptr() and y.dtype == dtype  # written once, into the LoRA output's buffer
    y.backward(d_y)
    for got, ref, what in ((y, want[0], "y"), (r.grad, want[1], "d_result"), (lo.grad, want[2], "d_lora")):
        assert got.shape == ref.shape, what
        assert_close(got, ref.to(dtype), dtype=dtype)
    assert m.grad.dtype == torch.float32
    assert_close(m.grad, want[3].float(), dtype=dtype, scale=max(1.0, tokens**0.5))
    # the eager twin agrees within the dtype's tolerance
    eager = F._output_torch(result, lora, b, magnitude, norm, SCALE, EPS)
    assert_close(y.detach(), eager, dtype=dtype)


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("half", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("tokens", (1, 33))
def test_output_kernel_beside_a_wider_fp32_branch(tokens, half, bias):
    """PEFT's default fp32 adapters beside a half-precision base without autocast (``dispatch.wider_branch``): the
    one-pass output reads the half ``result`` and the fp32 LoRA output and writes fp32 into the LoRA output's buffer,
    as PyTorch's promotion would; the gradients are the fp64 reference's, ``result``'s in its own dtype."""
    result, lora, b, magnitude, norm = _output_inputs(tokens, 130, torch.float32, seed=9, bias=bias)
    result = result.to(half)
    b = None if b is None else b.to(half)
    d_y = torch.randn(tokens, 130)
    want = _output_fp64(result, lora, b, magnitude, norm, d_y)
    r, lo, m = result.clone().requires_grad_(), lora.clone().requires_grad_(), magnitude.clone().requires_grad_()
    r2, lo2 = r * 1, lo * 1
    y = F.fused_dora_output(r2, lo2, m, norm, SCALE, EPS, bias=b)
    assert y.data_ptr() == lo2.data_ptr() and y.dtype == torch.float32
    y.backward(d_y)
    assert_close(y, want[0].float())
    assert r.grad.dtype == half and lo.grad.dtype == torch.float32
    assert_close(r.grad, want[1].to(half), dtype=half)
    assert_close(lo.grad, want[2].float())
    assert_close(m.grad, want[3].float(), scale=max(1.0, tokens**0.5))
    # the eager twin takes result - bias in the half dtype (as upstream does), the kernel in fp32
    eager = F._output_torch(result, lora, b, magnitude, norm, SCALE, EPS)
    assert eager.dtype == torch.float32
    assert_close(y.detach(), eager, dtype=half)
    with torch.no_grad():
        out = F.fused_dora_output(result, lora.clone(), magnitude, norm, SCALE, EPS, bias=b)
    assert out.dtype == torch.float32
    assert torch.equal(out, y.detach())


def test_output_kernel_without_grad_and_frozen_magnitude():
    result, lora, _, magnitude, norm = _output_inputs(9, 130, torch.bfloat16, seed=5)
    ref = F._output_torch(result, lora, None, magnitude, norm, SCALE, EPS)
    with torch.no_grad():
        out = F.fused_dora_output(result, lora.clone(), magnitude.requires_grad_(), norm, SCALE, EPS)
    assert_close(out, ref, dtype=torch.bfloat16)
    magnitude.requires_grad_(False)
    r = result.clone().requires_grad_()
    y = F.fused_dora_output(r * 1, lora.clone(), magnitude, norm, SCALE, EPS)
    y.sum().backward()
    assert_close(r.grad, (magnitude / norm).expand(9, 130).to(torch.bfloat16), dtype=torch.bfloat16)


def test_output_layout_rules():
    result, lora, b, magnitude, norm = _output_inputs(6, 8, torch.float32, bias=True)
    assert F.output_supported(result, lora, b, magnitude, norm)
    assert not F.output_supported(result, lora[:, :8], b, magnitude, norm)  # a view: the output goes into lora
    assert not F.output_supported(result, lora, b, magnitude, norm.double())  # the norm is fp32
    assert not F.output_supported(result, lora, b.requires_grad_(), magnitude, norm)  # a trained bias: eager
    assert F.output_supported(result.half(), lora, None, magnitude, norm)  # fp32 branch, half result: fp32 output
    assert not F.output_supported(result.half(), lora.bfloat16(), None, magnitude, norm)  # two half dtypes
    assert not F.output_supported(result, lora, None, magnitude.view(1, 8), norm)
    assert F.output_supported(torch.randn(6, 20)[:, 4:12], lora, None, magnitude, norm)  # a column slice of result


def test_output_gradient_falls_back_for_broadcast_grad():
    """A stride-0 incoming gradient (e.g. from ``y.sum()``) takes the PyTorch twin of the backward."""
    result, lora, _, magnitude, norm = _output_inputs(5, 123, torch.float32, seed=6)
    r, m = result.clone().requires_grad_(), magnitude.clone().requires_grad_()
    F.fused_dora_output(r * 1, lora.clone(), m, norm, SCALE, EPS).sum().backward()
    want = _output_fp64(result, lora, None, magnitude, norm, torch.ones(5, 123))
    assert_close(r.grad, want[1].float())
    assert_close(m.grad, want[3].float())


def test_output_nan_and_inf_propagate():
    result, lora, _, magnitude, norm = _output_inputs(4, 130, torch.float32, seed=7)
    result[0, 3], lora[1, 5], norm[7] = float("nan"), float("inf"), float("nan")
    want = F._output_torch(result, lora, None, magnitude, norm, SCALE, EPS)
    got = F.fused_dora_output(result, lora.clone(), magnitude, norm, SCALE, EPS)
    assert_close(got, want, equal_nan=True)


def test_output_d_mag_is_bitwise_repeatable():
    result, lora, _, magnitude, norm = _output_inputs(300, 130, torch.bfloat16, seed=8)
    d_y = torch.randn(300, 130).to(torch.bfloat16)
    grads = []
    for _ in range(3):
        m = magnitude.clone().requires_grad_()
        F.fused_dora_output(result.clone().requires_grad_() * 1, lora.clone(), m, norm, SCALE, EPS).backward(d_y)
        grads.append(m.grad)
    for gr in grads[1:]:
        assert torch.equal(gr.view(torch.int32), grads[0].view(torch.int32))


def test_model_takes_the_one_pass_output_in_both_tiers(dora_env):
    """A DoRA Linear model: training forwards record one fused autograd node per layer, inference runs the bare
    kernel, and both agree with the eager tier (PEFT_DORA_FUSED=0) within fp32 tolerance."""
    from torch import nn

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import dora

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 17, bias=False))
    config = LoraConfig(target_modules=["0", "2"], use_dora=True, init_lora_weights=False, r=4)
    peft_model = get_peft_model(model, config)
    x = torch.randn(3, 5, 24)

    def step():
        peft_model.zero_grad(set_to_none=True)
        out = peft_model(x)
        out.square().sum().backward()
        grads = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}
        with torch.no_grad():
            return out.detach(), grads, peft_model(x)

    dora.tier_counts.clear()
    out, grads, infer = step()
    assert dora.tier_counts == {dora.TIER_FUSED_BACKWARD: 2, dora.TIER_FUSED_FORWARD: 2}
    dora_env("PEFT_DORA_FUSED", "0")
    out_e, grads_e, infer_e = step()
    assert_close(out, out_e)
    assert_close(infer, infer_e)
    for name in grads:
        assert_close(grads[name], grads_e[name], scale=10)


def _saved_activation_ptrs(fn, shape):
    """data_ptrs of the activation-sized tensors autograd saves while ``fn`` runs."""
    ptrs = []

    def pack(t):
        if tuple(t.shape) == shape:
            ptrs.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, ptrs


@pytest.mark.parametrize("bias", (False, True))
def test_output_saves_itself_for_d_mag(bias):
    """With no zero in m the backward reads inner back from y (no second activation-sized buffer is saved) and d_m
    still matches fp64; an in-place edit of y afterwards is refused by autograd, not silently wrong."""
    result, lora, b, magnitude, norm = _output_inputs(37, 130, torch.bfloat16, seed=9, bias=bias)
    d_y = torch.randn(37, 130).to(torch.bfloat16)
    want = _output_fp64(result, lora, b, magnitude, norm, d_y)
    m = magnitude.clone().requires_grad_()
    r = result.clone().requires_grad_()
    y, saved = _saved_activation_ptrs(
        lambda: F.fused_dora_output(r * 1, lora.clone(), m, norm, SCALE, EPS, bias=b), (37, 130)
    )
    assert saved == [y.data_ptr()]
    y.backward(d_y)
    assert_close(m.grad, want[3].float(), dtype=torch.bfloat16, scale=37**0.5)
    assert_close(r.grad, want[1].to(torch.bfloat16), dtype=torch.bfloat16)
    y2 = F.fused_dora_output(r * 1, lora.clone(), m, norm, SCALE, EPS, bias=b)
    y2.mul_(2)
    with pytest.raises(RuntimeError, match="inplace operation"):
        y2.backward(d_y)


def test_layer_asks_for_zeros_in_m_once_per_value():
    """A DoRA layer keeps the answer of the zero test (a host sync) per value of m: the same m answers from the memo,
    an in-place zero in m is seen (version counter) and switches the node to a saved inner, with exact d_m."""
    from torch import nn

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import dora_settings

    torch.manual_seed(0)
    model = get_peft_model(
        nn.Sequential(nn.Linear(24, 40)), LoraConfig(target_modules=["0"], use_dora=True, init_lora_weights=False, r=4)
    )
    layer = model.base_model.model[0].lora_magnitude_vector["default"]
    x = torch.randn(5, 24)
    model(x).sum().backward()
    memo = layer._reuse.zero_free
    assert memo.value is True
    with torch.no_grad():
        layer.weight[3] = 0.0
    layer.weight.grad = None
    model(x).sum().backward()
    assert memo.value is False
    fused_grad = layer.weight.grad.clone()
    with dora_settings.override(fused=False):  # the eager tier's d_m for the same m
        layer.weight.grad = None
        model(x).sum().backward()
    assert_close(fused_grad, layer.weight.grad, dtype=torch.float32)


def test_cpu_zero_test_once_per_step_in_the_step_hook():
    """On a CPU the optimizer-step hook tests the magnitudes too (on a GPU it starts that test ahead of the forwards):
    after the first step no training node tests its own magnitude, the hook's one test of all of them per step is
    all. The step of an optimizer that does not hold them tests none (their own optimizer writes them). A zero that a
    step writes (through ``.data``, as optimizers write) is seen by the next forward's nodes, which then keep inner,
    with the eager tier's d_m."""
    from torch import nn

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import dora_cache, dora_settings

    torch.manual_seed(0)
    config = LoraConfig(target_modules=["0", "1"], use_dora=True, init_lora_weights=False, r=4)
    model = get_peft_model(nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 16)), config)
    layers = [model.base_model.model[i].lora_magnitude_vector["default"] for i in (0, 1)]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(5, 24)
    calls, has_zero = [0], dora_cache._has_zero

    def counted(*magnitudes):
        calls[0] += 1
        return has_zero(*magnitudes)

    class Zeroing(torch.optim.Optimizer):  # a step that writes an exact zero into the first magnitude
        @torch.no_grad()
        def step(self, closure=None):
            self.param_groups[0]["params"][0].data[3] = 0.0

    def step(optimizer) -> int:
        calls[0] = 0
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return calls[0]

    dora_cache._has_zero = counted
    try:
        assert [step(opt) for _ in range(4)] == [2 + 1, 1, 1, 1]  # step 1: each node asks, then the hook tests
        assert all(layer._reuse.zero_free.value is True for layer in layers)
        calls[0] = 0
        other = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1)  # holds none of the magnitudes
        other.param_groups[0]["params"][0].grad = torch.ones(3)
        other.step()
        assert calls[0] == 0  # the magnitudes' own optimizer writes them: their answers are kept, none tested
        assert all(layer._reuse.zero_free.get((layer.weight,)) is True for layer in layers)
        Zeroing([layers[0].weight], {}).step()
        assert calls[0] == 1  # the hook tests what the stepped optimizer holds, once for all of it
        assert layers[0]._reuse.zero_free.value is False  # the zero it wrote
        assert layers[1]._reuse.zero_free.get((layers[1].weight,)) is True  # not held by it: kept
        calls[0] = 0
        Zeroing([layers[0].weight, layers[1].weight], {}).step()  # holds both, the zero in the first
        assert calls[0] == 1
        assert all(layer._reuse.zero_free.value is False for layer in layers)  # a zero anywhere: every node keeps inner
        model.zero_grad()
        assert step(opt) == 1  # the nodes found the hook's answers; the hook tested again after this step
        layers[0].weight.grad = None
        with torch.no_grad():
            layers[0].weight[3] = 0.0  # in place (a new version): the node tests once more and keeps inner
        calls[0] = 0
        model(x).square().mean().backward()
        assert calls[0] == 1 and layers[0]._reuse.zero_free.value is False
        fused_grad = layers[0].weight.grad.clone()
        with dora_settings.override(fused=False):  # the eager tier's d_m for the same m
            model.zero_grad()
            model(x).square().mean().backward()
        assert_close(fused_grad, layers[0].weight.grad, dtype=torch.float32)
    finally:
        dora_cache._has_zero = has_zero


def test_two_adapters_trained_in_turn_test_only_their_own_magnitudes():
    """Two DoRA adapters of one model trained in turn, each with its own optimizer (``set_adapter`` freezes the
    other), as the grid's pairs run a DoRA adapter beside its twin: after each adapter's first step, its step hook
    tests its own magnitudes once and keeps the other adapter's answers (their optimizer did not step), and no
    training node tests on the host; a kept answer whose magnitude is then edited in place (a new version) is not
    taken: the node tests it afresh and finds the zero."""
    from torch import nn

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import dora_cache

    torch.manual_seed(0)
    config = dict(target_modules=["0", "1"], use_dora=True, init_lora_weights=False)
    model = get_peft_model(nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 16)), LoraConfig(r=4, **config))
    model.add_adapter("other", LoraConfig(r=2, **config))
    optimizers = {}
    for name in ("default", "other"):
        model.set_adapter(name)
        optimizers[name] = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(5, 24)
    tested, has_zero = [], dora_cache._has_zero

    def counted(*magnitudes):
        tested.append(len(magnitudes))
        return has_zero(*magnitudes)

    def step(name: str) -> list:
        tested.clear()
        model.set_adapter(name)
        model(x).square().mean().backward()
        optimizers[name].step()
        optimizers[name].zero_grad()
        return list(tested)

    dora_cache._has_zero = counted
    try:
        assert step("default") == [1, 1, 2]  # its two nodes ask once each, then its hook tests both
        assert step("other") == [1, 1, 2]  # likewise: its own two; the first adapter's, stepped by theirs, kept
        for _ in range(3):
            assert step("default") == [2]  # the hook's one test of its own two; "other"'s answers kept
            assert step("other") == [2]
        magnitude = model.base_model.model[1].lora_magnitude_vector["other"].weight
        with torch.no_grad():
            magnitude[0] = 0.0  # an edit outside any optimizer: a new version, so the node tests it afresh
        model.set_adapter("other")
        layer = model.base_model.model[1].lora_magnitude_vector["other"]
        tested.clear()
        model(x).square().mean().backward()
        assert tested == [1] and layer._reuse.zero_free.value is False
        model.zero_grad()
    finally:
        dora_cache._has_zero = has_zero


def test_zero_test_after_an_optimizer_that_steps_copies():
    """An optimizer that holds fp32 copies instead of the magnitudes and writes them afterwards (DeepSpeed ZeRO-1/2's
    way) never makes a magnitude "owned": the hook tests every such magnitude again after each of its steps, so the
    zero it writes is seen by the next forward's node (which then keeps inner), never a kept answer from before."""
    from torch import nn

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(target_modules=["0"], use_dora=True, init_lora_weights=False, r=4)
    model = get_peft_model(nn.Sequential(nn.Linear(24, 40)), config)
    magnitude = model.base_model.model[0].lora_magnitude_vector["default"]

    class Copies(torch.optim.Optimizer):  # steps fp32 copies, then writes them into the model's tensors
        def __init__(self, params):
            self.targets = list(params)
            super().__init__([t.detach().clone() for t in self.targets], {})

        @torch.no_grad()
        def step(self, closure=None):
            copies = self.param_groups[0]["params"]
            copies[-1][5] = 0.0  # the magnitude is the last trainable tensor
            for target, copy in zip(self.targets, copies):
                target.data.copy_(copy)

    opt = Copies([p for p in model.parameters() if p.requires_grad])
    assert opt.targets[-1] is magnitude.weight
    x = torch.randn(5, 24)
    model(x).square().mean().backward()  # the node asks: no zero yet
    assert magnitude._reuse.zero_free.value is True
    opt.step()
    assert magnitude.weight[5] == 0
    assert magnitude._reuse.zero_free.get((magnitude.weight,)) is False  # tested again after the step
    assert magnitude._reuse.zero_free.owner is None  # no optimizer holding the magnitude has stepped it


def test_output_with_a_zero_magnitude_keeps_inner():
    """m_j = 0 makes y_j = bias_j, so inner cannot be read back: a separate buffer is saved and d_m_j is exact. The
    zero test reruns when m changes (its version counter), so zeroing m in place switches the path."""
    result, lora, b, magnitude, norm = _output_inputs(23, 130, torch.float32, seed=10, bias=True)
    d_y = torch.randn(23, 130)
    m = magnitude.clone().requires_grad_()
    y, saved = _saved_activation_ptrs(
        lambda: F.fused_dora_output(result, lora.clone(), m, norm, SCALE, EPS, bias=b), (23, 130)
    )
    assert saved == [y.data_ptr()]
    with torch.no_grad():
        m[3] = 0.0
    zeroed = m.detach().clone()
    y, saved = _saved_activation_ptrs(
        lambda: F.fused_dora_output(result, lora.clone(), m, norm, SCALE, EPS, bias=b), (23, 130)
    )
    assert len(saved) == 1 and saved[0] != y.data_ptr()
    m.grad = None
    y.backward(d_y)
    want = _output_fp64(result, lora, b, zeroed, norm, d_y)
    assert want[3][3].abs() > 1e-3  # the zeroed row still has a gradient, and it is found
    assert_close(m.grad, want[3].float(), scale=23**0.5)


@pytest.mark.parametrize("value", (float("inf"), 1e-39), ids=("inf", "tiny"))
def test_output_with_a_magnitude_that_cannot_be_divided_by_keeps_inner(value):
    """An infinite m_j (g_j = inf) or one whose reciprocal overflows cannot be divided back out of y_j either: the
    zero test counts them with the zeros, so the node keeps inner and d_m is the fp64 one (read back from y it was
    NaN for an infinite m_j)."""
    result, lora, b, magnitude, norm = _output_inputs(23, 130, torch.float32, seed=11, bias=True)
    d_y = torch.randn(23, 130)
    m = magnitude.clone()
    m[5] = value
    m.requires_grad_()
    y, saved = _saved_activation_ptrs(
        lambda: F.fused_dora_output(result, lora.clone(), m, norm, SCALE, EPS, bias=b), (23, 130)
    )
    assert len(saved) == 1 and saved[0] != y.data_ptr()
    y.backward(d_y)
    want = _output_fp64(result, lora, b, m.detach(), norm, d_y)[3].float()
    assert torch.isfinite(m.grad).all()
    assert_close(m.grad, want, scale=23**0.5)


def small_dora_model(lora_dropout=0.0):
    """Linear(24, 40) with a bias, ReLU, Linear(40, 17) without: DoRA r = 4 on both, A and B random (a trained
    adapter's, not B = 0), seed 0, eval mode."""
    from torch import nn

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 17, bias=False))
    config = LoraConfig(
        target_modules=["0", "2"], use_dora=True, init_lora_weights=False, r=4, lora_dropout=lora_dropout
    )
    return get_peft_model(model, config).eval()


def eager_forward(model, x):
    """``model(x)`` on the eager tier (PEFT_DORA_FUSED=0: computed afresh, nothing kept is read), the settings in force
    before restored."""
    from peft.tuners.lora import dora

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PEFT_DORA_FUSED", "0")
        dora._invalidate_fused_cache()
        out = model(x)
    dora._invalidate_fused_cache()
    return out


@pytest.mark.parametrize("path", ("small_forward", "decode"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_eval_forward_reuses_its_factors(dora_switches, dora_env, monkeypatch, dtype, path):
    """Eval without autograd and few rows (decode): the decode kernels (up to dispatch.DECODE_MAX_ROWS rows; switched
    off here for the other path) or two in-place PyTorch ops on the LoRA output, with g and (1 − g)·bias kept from
    the first forward. Agrees with the eager tier like the kernel does, never goes stale, and steps aside for large
    inputs, training mode and PEFT_DORA_FUSED=0."""
    from peft.tuners.lora import dora

    dora_switches(decode_kernels=path == "decode")
    tier = dora.TIER_DECODE if path == "decode" else dora.TIER_SMALL_FORWARD

    peft_model = small_dora_model().to(dtype)
    x = torch.randn(2, 3, 24).to(dtype)

    def eager():
        return eager_forward(peft_model, x)

    with torch.no_grad():
        dora.tier_counts.clear(), dora.norm_counts.clear()
        first = peft_model(x)
        second = peft_model(x)
        assert dora.tier_counts == {tier: 4}
        assert dora.norm_counts["scale_computed"] == 2 and dora.norm_counts["scale_reused"] == 2
        assert torch.equal(first, second)
        assert_close(first, eager(), dtype=dtype)
        for change in (
            lambda: peft_model.base_model.model[0].lora_B["default"].weight.mul_(1.5),
            lambda: peft_model.base_model.model[0].base_layer.bias.add_(0.25),
            lambda: peft_model.base_model.model[2].lora_magnitude_vector["default"].weight.mul_(0.5),
        ):
            change()
            assert_close(peft_model(x), eager(), dtype=dtype)
        monkeypatch.setattr(dispatch, "SMALL_FORWARD_NUMEL", 2 * 3 * 17 - 1)  # x is now "large" for both layers
        monkeypatch.setattr(dispatch, "DECODE_MAX_ROWS", 2 * 3 - 1)
        dora.tier_counts.clear(), dora.norm_counts.clear()
        peft_model(x)
        assert dora.tier_counts[dora.TIER_FUSED_FORWARD] == 2 and dora.tier_counts[tier] == 0
        assert not any(k.startswith("scale") for k in dora.norm_counts)  # a large output never asks for the factors
        peft_model.train()
        dora.tier_counts.clear()
        peft_model(x)
        assert dora.tier_counts == {dora.TIER_FUSED_FORWARD: 2}


# ---------------------------------------------------------------------------------------------------------------
# Decode: the LoRA branch and the output of a few rows in two launches (dora_decode).
# ---------------------------------------------------------------------------------------------------------------


def _decode_inputs(tokens, d_in, rank, d_out, mode, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "autocast": torch.bfloat16}[mode]
    factor_dtype = torch.float32 if mode == "autocast" else dtype  # PEFT's fp32 adapters under autocast
    wide = torch.randn(tokens, d_in + 5, generator=g).to(factor_dtype)
    x = wide[:, 3 : 3 + d_in]  # rows of a wider buffer
    weight_a = (torch.randn(rank, d_in, generator=g) / d_in**0.5).to(factor_dtype)
    weight_b = torch.randn(d_out, rank, generator=g).to(factor_dtype)
    result = torch.randn(tokens, d_out, generator=g).to(dtype)
    if tokens == 3:  # rows of a wider buffer
        result = torch.zeros(tokens, d_out + 2, dtype=dtype).narrow(1, 1, d_out).copy_(result)
    gs = torch.rand(d_out, generator=g) + 0.5
    rows = (gs, (1 - gs) * torch.randn(d_out, generator=g)) if bias else (gs,)
    return x, result, weight_a, weight_b, torch.stack(rows).contiguous(), dtype


def _decode_fp64(x, result, weight_a, weight_b, factors, bias):
    lora = x.double() @ weight_a.double().t() @ weight_b.double().t()
    out = factors[0].double() * (result.double() + SCALE * lora)
    return out + factors[1].double() if bias else out


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("mode", ("fp32", "bf16", "fp16", "autocast"))
@pytest.mark.parametrize("tokens, d_in, rank, d_out", [(1, 100, 7, 37), (3, 64, 40, 70), (8, 300, 130, 33)])
def test_decode_kernels_match_twin(tokens, d_in, rank, d_out, mode, bias):
    """Both launches against the PyTorch twin (F.linear's two matmuls in the compute dtype, the composition in fp32),
    at sizes that are no multiple of any block, x (and for 3 tokens the base output) as rows of a wider buffer; no
    further from fp64 than the twin; the output has contiguous rows."""
    from peft.tuners.lora import dora_decode as Dd

    x, result, weight_a, weight_b, factors, dtype = _decode_inputs(tokens, d_in, rank, d_out, mode, bias)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else torch.autocast("cpu", enabled=False)
    with ctx:
        layout = Dd.decode_layout(x, result, weight_a, weight_b)
        # one row reads as contiguous
        assert layout == (d_in + 5 if tokens > 1 else d_in, d_out + 2 if tokens == 3 else d_out, dtype)
        out = Dd.decode_output(x, result, weight_a, weight_b, factors, SCALE, layout, bias)
        twin = Dd.decode_output_torch(x, result, weight_a, weight_b, factors, SCALE, bias)
    assert out.dtype == dtype and out.shape == result.shape and out.is_contiguous()
    want = _decode_fp64(x, result, weight_a, weight_b, factors, bias)
    if dtype == torch.float32:
        assert_close(out, twin, dtype=dtype)
    else:
        # a and lora are rounded to the compute dtype in both, and sums in another order may round either way; the
        # interpreter converts fp32 to bf16 by truncation (the GPU rounds to nearest: test_dora_gpu checks it
        # there against the twin), up to a unit in the last place per rounding, three of them here
        err, err_twin = (out.double() - want).abs().max(), (twin.double() - want).abs().max()
        assert err <= 2 * err_twin + 2 * want.abs().max() * torch.finfo(dtype).eps, (err, err_twin)


@pytest.mark.parametrize("tokens", (1, 3))
def test_decode_kernels_take_a_wider_fp32_result(tokens):
    """bitsandbytes under autocast: an fp32 result beside the bf16 compute dtype; the output is fp32, as the twin's
    (and PyTorch's promotion)."""
    from peft.tuners.lora import dora_decode as Dd

    x, result, weight_a, weight_b, factors, _ = _decode_inputs(tokens, 64, 8, 40, "autocast", True)
    result = result.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layout = Dd.decode_layout(x, result, weight_a, weight_b)
        assert layout is not None and layout[2] == torch.bfloat16
        out = Dd.decode_output(x, result, weight_a, weight_b, factors, SCALE, layout, True)
        twin = Dd.decode_output_torch(x, result, weight_a, weight_b, factors, SCALE, True)
    assert out.dtype == twin.dtype == torch.float32
    want = _decode_fp64(x, result, weight_a, weight_b, factors, True)
    err, err_twin = (out.double() - want).abs().max(), (twin.double() - want).abs().max()
    assert err <= 2 * err_twin + 2 * want.abs().max() * torch.finfo(torch.bfloat16).eps, (err, err_twin)


@pytest.mark.parametrize("half", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("tokens", (1, 3))
def test_decode_kernels_take_a_half_result_beside_an_fp32_branch(tokens, half):
    """PEFT's default fp32 adapters beside a half base without autocast (``dispatch.wider_branch``; what
    ``PeftModel.from_pretrained`` loads onto a bf16 model): x, A and B fp32, the result half; the output is fp32, as
    the twin's (and PyTorch's promotion), and a plan made for it keeps writing fp32."""
    from peft.tuners.lora import dora_decode as Dd

    x, result, weight_a, weight_b, factors, _ = _decode_inputs(tokens, 64, 8, 40, "fp32", True)
    result = result.to(half)
    layout = Dd.decode_layout(x, result, weight_a, weight_b)
    assert layout is not None and layout[2] == torch.float32
    plan = Dd.DecodePlan(Dd.plan_key(x, result), x, result, weight_a, weight_b, factors, SCALE, layout, True)
    out, again = plan.run(x, result), plan.run(x, result)
    twin = Dd.decode_output_torch(x, result, weight_a, weight_b, factors, SCALE, True)
    assert out.dtype == again.dtype == twin.dtype == torch.float32 and torch.equal(out, again)
    assert out.shape == result.shape
    want = _decode_fp64(x, result, weight_a, weight_b, factors, True)
    assert_close(out, want.float())
    assert_close(twin, want.float())


@pytest.mark.parametrize(
    "case",
    ["tokens", "zero_tokens", "b_dtype", "result_dtype", "a_columns", "b_shape", "x_columns", "int_x", "shapes"],
)
def test_decode_layout_rejects_what_the_kernels_do_not_compute(case):
    from peft.tuners.lora import dora_decode as Dd

    x, result, weight_a, weight_b, _, _ = _decode_inputs(3, 64, 8, 40, "bf16", False)
    if case == "tokens":
        x, result = torch.randn(9, 64).to(x.dtype), torch.randn(9, 40).to(result.dtype)
    elif case == "zero_tokens":
        x, result = x[:0], result[:0]
    elif case == "b_dtype":
        weight_b = weight_b.float()  # F.linear raises without autocast: left to it
    elif case == "result_dtype":
        result = result.half()  # neither the compute dtype nor a wider fp32 result (dispatch.wider_result)
    elif case == "a_columns":
        weight_a = weight_a.t().contiguous().t()
    elif case == "b_shape":
        weight_b = weight_b[:, :7]
    elif case == "x_columns":
        x = torch.randn(64, 3).to(x.dtype).t()
    elif case == "int_x":
        x = x.to(torch.int32)
    elif case == "shapes":
        result = result.reshape(1, 3, 40)
    assert Dd.decode_layout(x, result, weight_a, weight_b) is None


@pytest.mark.parametrize("kept", (True, False), ids=("scaled_b_kept", "scaled_b_per_forward"))
def test_small_tier_folds_the_scale_into_b(dora_switches, dora_env, monkeypatch, kept):
    """The small tier's ``F.linear(F.linear(x, A), s·g·B, (1 − g)·bias)`` and ``addcmul_(result, g)``: the eager
    tier's output in fp32, under autocast (fp32 adapters, bf16 branch: s·g·B kept in bf16, then in fp32 again),
    after in-place edits of B, the magnitude and the bias (new factors, so a new s·g·B), with s·g·B kept or made in
    every forward; an fp32 result beside a bf16 branch (bitsandbytes under autocast) composes from the LoRA output in
    fp32 up to SMALL_FORWARD_WIDE_NUMEL elements and takes the one-pass kernel above."""

    from peft.tuners.lora import dora

    dora_switches(decode_kernels=False)
    if not kept:
        monkeypatch.setattr(dispatch, "SCALED_B_KEPT_NUMEL", 0)
    peft_model = small_dora_model()
    first = peft_model.base_model.model[0]
    x = torch.randn(2, 3, 24)

    def both(autocast: bool):
        outs = []
        for fused in ("1", "0"):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("PEFT_DORA_FUSED", fused)
                dora._invalidate_fused_cache()
                dora.tier_counts.clear()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    outs.append(peft_model(x))
                if fused == "1":
                    assert dict(dora.tier_counts) == {dora.TIER_SMALL_FORWARD: 2}
        dora._invalidate_fused_cache()
        return outs

    with torch.no_grad():
        for autocast in (False, True, False):
            got, want = both(autocast)
            assert got.dtype == want.dtype
            assert_close(got, want, dtype=torch.bfloat16 if autocast else torch.float32)
            kept_b = first.lora_magnitude_vector["default"]._reuse.scaled_b
            assert (kept_b is not None) is kept
            if kept:
                assert kept_b[2].dtype == (torch.bfloat16 if autocast else torch.float32)
        for change in (
            lambda: first.lora_B["default"].weight.mul_(1.5),
            lambda: first.lora_magnitude_vector["default"].weight.mul_(0.5),
            lambda: first.base_layer.bias.add_(0.25),
        ):
            change()
            got, want = both(False)
            assert_close(got, want, dtype=torch.float32)

        # an fp32 result beside the bf16 branch of autocast (bitsandbytes): (result + s·lora)·g + (1 − g)·bias in
        # fp32 up to SMALL_FORWARD_WIDE_NUMEL elements, the one-pass kernel above; an fp32 output either way
        layer = first.lora_magnitude_vector["default"]
        lora_A, lora_B = first.lora_A["default"], first.lora_B["default"]
        x2 = torch.randn(5, 24)
        result = first.base_layer(x2)
        w = first.base_layer.weight
        s = first.scaling["default"]
        norm = (w + s * lora_B.weight @ lora_A.weight).norm(dim=1)
        g = layer.weight / norm
        bias = first.base_layer.bias
        want = g * result + (1 - g) * bias + s * g * (x2 @ lora_A.weight.T @ lora_B.weight.T)
        for wide_numel, tier in ((1 << 20, dora.TIER_SMALL_FORWARD), (result.numel() - 1, dora.TIER_FUSED_FORWARD)):
            monkeypatch.setattr(dispatch, "SMALL_FORWARD_WIDE_NUMEL", wide_numel)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                dora.tier_counts.clear()
                out = layer.adapted_output(
                    x2, result, lora_A=lora_A, lora_B=lora_B, scaling=first.scaling["default"],
                    base_layer=first.base_layer,
                )  # fmt: skip
            assert dict(dora.tier_counts) == {tier: 1} and out.dtype == torch.float32
            assert_close(out, want, dtype=torch.bfloat16)


def test_records_beside_a_wider_result(dora_switches, dora_env, monkeypatch):
    """An fp32 result beside the bf16 branch of autocast (bitsandbytes' layers under the QLoRA recipe): up to
    SMALL_FORWARD_WIDE_NUMEL outputs the small tier's fp32 composition and its record, above it the one-pass kernel
    and its record, each answering with the bits of the full path's forward for its own sizes only (the full path
    decides the tier by the output's size, so must the records), and stepping aside when the weights change. None is
    made inside a CUDA graph capture, whose private pool the kept norm's copy would live in."""
    from peft.tuners.lora import dora

    dora_switches(decode_kernels=False)
    peft_model = small_dora_model()
    first = peft_model.base_model.model[0]
    layer = first.lora_magnitude_vector["default"]
    lora_A, lora_B = first.lora_A["default"], first.lora_B["default"]
    scaling, base = first.scaling["default"], first.base_layer
    small, large = torch.randn(2, 24), torch.randn(5, 24)  # 80 and 200 outputs
    monkeypatch.setattr(dispatch, "SMALL_FORWARD_WIDE_NUMEL", 100)
    args = dict(lora_A=lora_A, lora_B=lora_B, scaling=scaling, base_layer=base)

    def result(x):  # fp32, as bitsandbytes returns its input's dtype under autocast
        with torch.autocast("cpu", enabled=False):
            return base(x)

    def full(x):
        dora.tier_counts.clear()
        out = layer.adapted_output(x, result(x), **args)
        return out, next(iter(dora.tier_counts))

    def recorded(x):
        dora.tier_counts.clear()
        out = layer.recorded_small_output(x, result(x), lora_A, lora_B, scaling, base)
        return out, (next(iter(dora.tier_counts)) if dora.tier_counts else None)

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert result(small).dtype == torch.float32
        assert recorded(small)[0] is None and recorded(large)[0] is None  # no records yet
        with pytest.MonkeyPatch.context() as mp:  # inside a CUDA graph capture (a stand-in): nothing is kept
            mp.setattr(dora, "capturing", lambda sources: True)
            assert full(large)[1] == dora.TIER_FUSED_FORWARD and layer._reuse.one_pass is None
        want_small, tier = full(small)
        assert tier == dora.TIER_SMALL_FORWARD and layer._reuse.small is not None and layer._reuse.one_pass is None
        assert recorded(large)[0] is None  # the small record does not answer for the one-pass tier's sizes
        want_large, tier = full(large)
        assert tier == dora.TIER_FUSED_FORWARD and layer._reuse.one_pass is not None
        expected = ((small, want_small, dora.TIER_SMALL_FORWARD), (large, want_large, dora.TIER_FUSED_FORWARD))
        for x, want, tier in expected:
            got, got_tier = recorded(x)
            assert got_tier == tier and got.dtype == torch.float32 and torch.equal(got, want)
        layer._reuse.small = None
        assert recorded(small)[0] is None  # nor the one-pass record for the small tier's
        lora_B.weight.mul_(1.5)
        assert recorded(large)[0] is None  # stale: B changed
        want_large, _ = full(large)
        got, _ = recorded(large)
        assert torch.equal(got, want_large)


@pytest.mark.parametrize("precision", ("fp32", "bf16", "fp16", "autocast"))
@pytest.mark.parametrize("rows", (6, 9), ids=("decode_rows", "more_rows"))
@pytest.mark.parametrize("b_kept", (True, False), ids=("b_kept", "b_too_large"))
@pytest.mark.parametrize("output", ("small", "large"))
@pytest.mark.parametrize("caching", (False, True), ids=("uncached", "dora_caching"))
def test_every_eval_tier_keeps_a_record_that_answers(dora_switches, dora_env, monkeypatch, precision, rows, b_kept,
                                                     output, caching):  # fmt: skip
    """From the second eval forward on, whatever tier the full path takes (decode steps up to 8 rows with the decode
    kernels on, the small tier with ``s·g·B`` kept or, for a B above ``SCALED_B_KEPT_NUMEL``, scaled in each
    forward, the one-pass kernel above ``SMALL_FORWARD_NUMEL``), in fp32, bf16, fp16 and under autocast, each layer's
    record answers it, with the full path's bits. A tier without a record pays the full path's gates and lookups in
    every forward: the small tier with a B too large to keep beside it did (1.20x LoRA at a host-bound rank-768
    eval point on the H200)."""
    from peft.helpers import DoraCaching
    from peft.tuners.lora import dora

    dora_switches(decode_kernels=True)
    if output == "large":
        monkeypatch.setattr(dispatch, "SMALL_FORWARD_NUMEL", 0)
    if not b_kept:
        monkeypatch.setattr(dispatch, "SCALED_B_KEPT_NUMEL", 0)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    peft_model = small_dora_model()
    if half is not None:
        peft_model = peft_model.to(half)
    x = torch.randn(rows, 24, dtype=half or torch.float32)
    decode = rows <= dispatch.DECODE_MAX_ROWS
    answered, decoded = [], []
    monkeypatch.setattr(dora.DoraLinearLayer, "recorded_small_output", counting_records(answered))
    monkeypatch.setattr(dora.DoraLinearLayer, "_recorded_decode", counting_records(decoded, "_recorded_decode"))
    cache = DoraCaching() if caching else contextlib.nullcontext()
    with cache, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        dora.tier_counts.clear()
        full = peft_model(x)
        tiers = dict(dora.tier_counts)
        want = dora.TIER_DECODE if decode else dora.TIER_FUSED_FORWARD if output == "large" else dora.TIER_SMALL_FORWARD
        assert tiers == {want: 2}, tiers
        for _ in range(2):
            answered.clear(), decoded.clear(), dora.tier_counts.clear()
            again = peft_model(x)
            assert answered == [True, True] and dict(dora.tier_counts) == tiers
            assert decoded == ([True, True] if decode else [])
            assert torch.equal(again, full)


def counting_records(answered: list, name: str = "recorded_small_output"):
    """``DoraLinearLayer.<name>`` (a record's answer, as it is now: ``recorded_small_output`` or
    ``recorded_training_output``) that appends to ``answered`` whether each call answered, for a test to patch in."""
    from peft.tuners.lora import dora

    recorded = getattr(dora.DoraLinearLayer, name)

    def counted(self, *args):
        out = recorded(self, *args)
        answered.append(out is not None)
        return out

    return counted


@pytest.mark.parametrize("tier", ("small_forward", "small_forward_b_per_forward", "one_pass", "decode"))
def test_small_record_answers_only_while_it_holds(dora_switches, dora_env, monkeypatch, tier):
    """An eval forward on the small tier keeps a record (``dora_cache.SmallRecord``) that answers the next ones in three
    ops (four where B is too large to keep ``s·g·B`` beside it, here made so: the record keeps the column ``s·g`` and
    scales B in each forward, as the full path does), one on the one-pass output kernel (outputs above the small tier's
    limit, here made 0) a record that answers with two matmuls and the kernel, and a decode step (up to 8 rows, decode
    kernels on) a record with its plan that answers with the plan's two launches: the same bits as the full path while
    nothing changed; after each change below the output is a fresh computation's (the eager tier's), never the record's
    stale one: in-place edits of W, A, B, m and the bias, a new value through ``.data`` (a new storage), a ``.data``
    write PyTorch cannot see followed by ``invalidate_norm_caches()``, a new scaling, a replaced parameter object, a
    hook on ``lora_A`` (which must see the call), autocast, new settings, ``DoraCaching``, an output on the other tier,
    autograd in eval mode (the output must require grad), an optimizer step, inference mode and training mode."""
    from torch import nn

    from peft.tuners.lora import dora

    decode = tier == "decode"
    dora_switches(decode_kernels=decode)  # x below has 6 rows: the decode tier's where its kernels are on
    one_pass = tier == "one_pass"
    if one_pass:
        monkeypatch.setattr(dispatch, "SMALL_FORWARD_NUMEL", 0)  # every output is "large"
    if tier == "small_forward_b_per_forward":
        monkeypatch.setattr(dispatch, "SCALED_B_KEPT_NUMEL", 0)  # every B is "large"
    own_tier = dora.TIER_DECODE if decode else dora.TIER_FUSED_FORWARD if one_pass else dora.TIER_SMALL_FORWARD
    peft_model = small_dora_model()
    first, second = peft_model.base_model.model[0], peft_model.base_model.model[2]
    x = torch.randn(2, 3, 24)
    answered = []
    monkeypatch.setattr(dora.DoraLinearLayer, "recorded_small_output", counting_records(answered))

    def fresh():
        return eager_forward(peft_model, x)

    def check(answers: list, label: str):
        """One forward: which layers' records answered ([first, second]) and the output against a fresh one."""
        answered.clear()
        got = peft_model(x)
        assert answered == answers, (label, answered)
        assert_close(got, fresh(), dtype=torch.float32)

    with torch.no_grad():
        full = peft_model(x)  # makes the records
        dora.tier_counts.clear(), dora.norm_counts.clear()
        answered.clear()
        again = peft_model(x)
        assert answered == [True, True] and torch.equal(again, full)
        assert dict(dora.tier_counts) == {own_tier: 2}
        if tier == "small_forward_b_per_forward":  # nothing kept beside B: the record scaled it
            assert first.lora_magnitude_vector["default"]._reuse.scaled_b is None
        assert dora.norm_counts["norm_reused" if one_pass else "scale_reused"] == 2
        assert dict(dora.norm_counts).keys() == {"norm_reused" if one_pass else "scale_reused"}

        lora_B = first.lora_B["default"]
        changes = {  # what changes, and which layer's record must step aside
            "W in place": (lambda: first.base_layer.weight.add_(0.01), [False, True]),
            "A in place": (lambda: second.lora_A["default"].weight.mul_(1.25), [True, False]),
            "B in place": (lambda: lora_B.weight.mul_(1.5), [False, True]),
            "m in place": (lambda: second.lora_magnitude_vector["default"].weight.mul_(0.5), [True, False]),
            "bias in place": (lambda: first.base_layer.bias.add_(0.25), [False, True]),
            "B through .data": (lambda: setattr(lora_B.weight, "data", lora_B.weight.data * 0.5), [False, True]),
            "new scaling": (lambda: first.scaling.__setitem__("default", 0.75), [False, True]),
            "new B object": (
                lambda: setattr(lora_B, "weight", nn.Parameter(lora_B.weight.detach() * 2)),
                [False, True],
            ),
            # a write PyTorch's version counters cannot see, announced by invalidate_norm_caches()
            "unseen write": (lambda: (lora_B.weight.data.mul_(3), dora.invalidate_norm_caches()), [False, False]),
        }
        for label, (change, answers) in changes.items():
            change()
            check(answers, label)  # a fresh computation, which makes a new record
            check([True, True], "after " + label)

        calls = []
        handle = second.lora_A["default"].register_forward_hook(lambda *args: calls.append(1))
        check([True, False], "hook")
        assert calls == [1, 1, 1, 1]  # ours and the fresh forward's, each for the norm's identity and x (upstream's)
        handle.remove()
        check([True, True], "hook removed")  # the record still holds: nothing it was made from changed

        with torch.autocast("cpu", dtype=torch.bfloat16):
            answered.clear()
            peft_model(x)
            assert answered == [False, False]
        with dora_settings_changed():
            answered.clear()
            peft_model(x)
            assert answered == [False, False]
        monkeypatch.setattr(dora, "ENABLE_DORA_CACHING", True)
        answered.clear()
        peft_model(x)
        assert answered == [False, False]
        monkeypatch.setattr(dora, "ENABLE_DORA_CACHING", False)
        check([False, False], "after DoraCaching")
        if decode:
            check([True, True], "after DoraCaching, again")

            def other_rows(rows: int, answers: list, label: str):
                answered.clear()
                other = torch.randn(rows, 24)
                got = peft_model(other)
                assert answered == answers, (label, answered)
                assert_close(got, eager_forward(peft_model, other), dtype=torch.float32)

            dora.tier_counts.clear()
            other_rows(9, [False, False], "more rows than a decode step")  # the small tier's, without a record yet
            assert dora.tier_counts[dora.TIER_SMALL_FORWARD] == 2
            check([True, True], "decode again")  # the decode record and its plan still hold
            other_rows(1, [False, False], "one row")  # the rows' layout is the plan's key: a new plan and record
            check([False, False], "the first rows again")
        else:
            with pytest.MonkeyPatch.context() as mp:
                # both outputs on the other tier: "small" for the one-pass records, "large" for the small tier's
                mp.setattr(dispatch, "SMALL_FORWARD_NUMEL", 2 * 3 * 40 if one_pass else 2 * 3 * 17 - 1)
                dora.tier_counts.clear()
                check([False, False], "other tier")
                assert dora.tier_counts[dora.TIER_SMALL_FORWARD if one_pass else dora.TIER_FUSED_FORWARD] == 2
                dora.tier_counts.clear()
                check([True, True], "other tier's record")  # each tier keeps its own record
                assert dora.tier_counts[dora.TIER_SMALL_FORWARD if one_pass else dora.TIER_FUSED_FORWARD] == 2
        dora.tier_counts.clear()
        check([True, True], "own tier again")
        assert dora.tier_counts[own_tier] == 2  # beside the fresh forward's eager ones

    # autograd in eval mode: the output keeps its graph to m
    answered.clear()
    out = peft_model(x)
    assert answered == [False, False] and out.requires_grad
    # an optimizer step (the epoch), even one that changes nothing
    torch.optim.SGD([first.lora_magnitude_vector["default"].weight], lr=0.0).step()
    with torch.no_grad():
        check([False, False], "optimizer step")
    # a record made in inference mode answers only there
    with torch.inference_mode():
        dora.invalidate_norm_caches()
        peft_model(x)
        answered.clear()
        peft_model(x)
        assert answered == [True, True]
    with torch.no_grad():
        answered.clear()
        peft_model(x)
        assert answered == [False, False]
    # training mode forgets the records and never asks them
    peft_model.train()
    layer = first.lora_magnitude_vector["default"]
    assert layer._reuse.small is None and layer._reuse.one_pass is None and layer._reuse.decode_record is None
    answered.clear()
    with torch.no_grad():
        peft_model(x)
    assert answered == []


@pytest.mark.parametrize("tier", ("small_forward", "one_pass", "decode"))
def test_small_record_under_dora_caching(dora_switches, dora_env, monkeypatch, tier):
    """Under ``DoraCaching`` (upstream's semantics: the first cached eval forward's norm, kept until ``train()``
    whatever the weights do) the small tier's record (and the one-pass kernel's) answers as the full path would, so
    caching costs no more than it saves: the same bits as a forward with records switched off, after in-place edits
    of B (which the cached norm ignores), after the cache is emptied (the record held its entry, so it steps aside),
    and on leaving the context (records made under it step aside; those made before it answer where their tensors
    held). Forwards that alternate between caching on and off answer from a record of each: a pair per layer, not
    one that each forward replaces (as the grid's paired inference did, a norm copy per forward)."""

    from peft.helpers import DoraCaching
    from peft.tuners.lora import dora

    dora_switches(decode_kernels=tier == "decode")  # x below has 6 rows: the decode tier's where its kernels are on
    if tier == "one_pass":
        monkeypatch.setattr(dispatch, "SMALL_FORWARD_NUMEL", 0)  # every output is "large"
    peft_model = small_dora_model()
    first = peft_model.base_model.model[0]
    x = torch.randn(2, 3, 24)
    answered = []
    counted = counting_records(answered)

    def forward(records: bool = True):
        answered.clear()
        with pytest.MonkeyPatch.context() as mp:
            if records:
                mp.setattr(dora.DoraLinearLayer, "recorded_small_output", counted)
            else:
                mp.setattr(dora.DoraLinearLayer, "recorded_small_output", lambda *args: None)
            return peft_model(x)

    def as_without_records(answers: list):
        got = forward()
        assert answered == answers, answered
        assert torch.equal(got, forward(records=False))
        return got

    with torch.no_grad():
        forward()
        as_without_records([True, True])
        with DoraCaching():
            as_without_records([False, False])  # records made without the cache step aside
            as_without_records([True, True])
            first.lora_B["default"].weight.mul_(1.5)
            as_without_records([False, True])
            as_without_records([True, True])
            first.lora_magnitude_vector["default"]._dora_cache.clear()
            as_without_records([False, True])  # its entry is gone: the full path computes and caches a new norm
            as_without_records([True, True])
        # records made under the cache step aside; the first layer's from before it too (B changed since)
        fresh = as_without_records([False, True])
        assert_close(fresh, eager_forward(peft_model, x), dtype=torch.float32)
        for _ in range(3):
            with DoraCaching():
                as_without_records([True, True])
            as_without_records([True, True])
        first.lora_B["default"].weight.mul_(0.5)  # both of the first layer's records step aside
        with DoraCaching():
            as_without_records([False, True])
        as_without_records([False, True])
    peft_model.train()  # training mode forgets both pairs
    reuse = first.lora_magnitude_vector["default"]._reuse
    assert reuse.eval_records(True) == (None, None) and reuse.eval_records(False) == (None, None)
    assert reuse.decode_records(True) is None and reuse.decode_records(False) is None


@pytest.mark.parametrize("decode", (False, True), ids=("decode_off", "decode_on"))
def test_eval_records_never_change_the_bits_in_a_random_sequence(dora_switches, monkeypatch, decode):
    """Two copies of one DoRA model take the same seeded random sequence of eval forwards (few and many rows, the
    few on the decode tier where its kernels are on, ``DoraCaching`` on or off, no_grad or inference mode), in-place
    edits of B, m and W, train()/eval() and the small tier's limit at 0 or its default: the copy whose layers answer
    from their records gives the bits of the copy whose records never answer (the full path) after every forward."""
    import contextlib
    import random

    from peft.helpers import DoraCaching
    from peft.tuners.lora import dora

    dora_switches(decode_kernels=decode)
    ours, full = small_dora_model(), small_dora_model()
    limit = dispatch.SMALL_FORWARD_NUMEL
    rng = random.Random(0)
    answered = []
    counted = counting_records(answered)
    for step in range(120):
        op = rng.choice(("forward",) * 6 + ("B", "m", "W", "train", "limit"))
        if op == "forward":
            x = torch.randn(rng.choice((2, 11, 30)), 24, generator=torch.Generator().manual_seed(step))
            caching, inference = rng.random() < 0.5, rng.random() < 0.5
            outs = []
            for model, records in ((ours, True), (full, False)):
                answer = counted if records else (lambda *args: None)
                monkeypatch.setattr(dora.DoraLinearLayer, "recorded_small_output", answer)
                grad_mode = torch.inference_mode() if inference else torch.no_grad()
                with grad_mode, DoraCaching() if caching else contextlib.nullcontext():
                    outs.append(model(x).clone())
            assert torch.equal(outs[0], outs[1]), (step, caching, inference)
        elif op == "limit":
            monkeypatch.setattr(dispatch, "SMALL_FORWARD_NUMEL", rng.choice((0, limit)))
        else:
            for model in (ours, full):
                first, second = model.base_model.model[0], model.base_model.model[2]
                with torch.no_grad():
                    if op == "B":
                        first.lora_B["default"].weight.mul_(1.1)
                    elif op == "m":
                        second.lora_magnitude_vector["default"].weight.add_(0.01)
                    elif op == "W":
                        second.base_layer.weight.mul_(0.99)
                    else:
                        model.train()
                        model.eval()
    assert answered.count(True) > 20 and answered.count(False) > 10  # records answered, and stepped aside


def dora_settings_changed():
    """A context with other DoRA settings in force (a new snapshot)."""
    from peft.tuners.lora import dora_settings

    return dora_settings.override(one_node_branch=not dora_settings.current().one_node_branch)


def test_decode_tier_in_a_model_and_its_fallbacks(dora_switches, dora_env, monkeypatch):
    """A DoRA model in eval without autograd decodes through the two launches: same output as with them switched off
    (the small tier's matmuls and op), in autocast too; a hook on lora_A, autograd, more rows than the decode limit or
    a training-mode forward take the other paths."""

    from peft.tuners.lora import dora

    peft_model = small_dora_model()

    def run(x, decode, autocast=False):
        dora_switches(decode_kernels=decode)
        dora.tier_counts.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return peft_model(x), dict(dora.tier_counts)

    with torch.no_grad():
        for autocast in (False, True):
            x = torch.randn(1, 2, 24)
            out, tiers = run(x, True, autocast)
            assert tiers == {dora.TIER_DECODE: 2}
            ref, tiers = run(x, False, autocast)
            assert tiers == {dora.TIER_SMALL_FORWARD: 2}
            assert_close(out, ref, dtype=torch.bfloat16 if autocast else torch.float32)
        _, tiers = run(torch.randn(9, 24), True)
        assert dora.TIER_DECODE not in tiers
        handle = peft_model.base_model.model[0].lora_A["default"].register_forward_hook(lambda *a: None)
        _, tiers = run(torch.randn(2, 24), True)
        # the hooked branch runs as it is, then the one-pass output (the small tier folds s·g into B's matmul)
        assert tiers == {dora.TIER_FUSED_FORWARD: 1, dora.TIER_DECODE: 1}
        handle.remove()
    _, tiers = run(torch.randn(2, 24), True)  # autograd records: the one-pass output
    assert dora.TIER_DECODE not in tiers and dora.TIER_SMALL_FORWARD not in tiers
    peft_model.train()
    with torch.no_grad():
        _, tiers = run(torch.randn(2, 24), True)
    assert dora.TIER_DECODE not in tiers


def test_generate_through_decode_records_is_the_eager_tiers_generate(dora_switches, monkeypatch):
    """``generate`` with a KV cache on a tiny Llama with DoRA on all seven projections: its one-token steps (a batch of
    two: two rows) take the decode tier, answered from each layer's decode record after the first step, and give the
    eager tier's tokens and logits (PEFT_DORA_FUSED=0, nothing kept); after an in-place edit of one B and one m
    between two calls the records of those layers step aside and the next call matches the eager tier again."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import dora

    dora_switches(decode_kernels=True)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_config = LoraConfig(r=4, target_modules=targets, use_dora=True, init_lora_weights=False)
    model = get_peft_model(LlamaForCausalLM(config), lora_config).eval()
    prompt = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    answered = []
    recorded = dora.DoraLinearLayer._recorded_decode

    def counted(self, *args):
        out = recorded(self, *args)
        answered.append(out is not None)
        return out

    monkeypatch.setattr(dora.DoraLinearLayer, "_recorded_decode", counted)

    def generate(eager: bool):
        with pytest.MonkeyPatch.context() as mp:
            if eager:
                mp.setenv("PEFT_DORA_FUSED", "0")
            dora._invalidate_fused_cache()
            out = model.generate(
                input_ids=prompt, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True
            )
        dora._invalidate_fused_cache()
        return out.sequences, torch.stack(out.logits)

    def same_as_eager():
        answered.clear(), dora.tier_counts.clear()
        tokens, logits = generate(eager=False)
        tiers, hits = dict(dora.tier_counts), answered.count(True)
        eager_tokens, eager_logits = generate(eager=True)
        assert torch.equal(tokens, eager_tokens)
        assert_close(logits, eager_logits, dtype=torch.float32)
        return tiers, hits

    with torch.no_grad():
        tiers, hits = same_as_eager()
        modules = 2 * len(targets)
        assert tiers[dora.TIER_DECODE] == 5 * modules  # the five one-token steps after the prompt's forward
        assert hits == 4 * modules  # the first step makes each layer's record, the next four answer from it
        first = model.base_model.model.model.layers[0]
        first.self_attn.q_proj.lora_B["default"].weight.mul_(1.5)
        first.mlp.down_proj.lora_magnitude_vector["default"].weight.mul_(0.75)
        tiers, hits = same_as_eager()
        assert hits == 5 * modules - 2  # the two edited layers' records step aside once, every other one answers


def test_dora_caching_keeps_the_decode_tier(dora_switches):
    """``peft.helpers.DoraCaching`` (upstream's inference speed-up) never costs a faster path: decode steps with it on
    take the same tier as with it off, reuse the same factors and compute no norm again."""

    from peft.helpers import DoraCaching
    from peft.tuners.lora import dora

    dora_switches(decode_kernels=True)
    peft_model = small_dora_model()
    x = torch.randn(1, 2, 24)
    runs = {}
    with torch.no_grad():
        for caching in (False, True, False):
            dora.tier_counts.clear()
            dora.norm_counts.clear()
            with DoraCaching(enabled=caching):
                outs = [peft_model(x) for _ in range(3)]
            runs.setdefault(caching, []).append((outs, dict(dora.tier_counts), dict(dora.norm_counts)))
    (off, off_tiers, off_norms), (off_again, _, off_again_norms) = runs[False]
    (on, on_tiers, on_norms) = runs[True][0]
    assert off_tiers == on_tiers == {dora.TIER_DECODE: 6}
    assert off_norms.get("norm_computed") == 2 and not on_norms.get("norm_computed")
    assert not off_again_norms.get("norm_computed")
    for a, b in zip(off + off_again, on + on):
        torch.testing.assert_close(a, b)


def test_decode_plan_is_reused_and_never_stale(dora_env):
    """A layer keeps its decode launches (DecodePlan) across steps of the same shapes, and builds new ones when its
    factors change (an in-place edit of B, a new magnitude) or the rows do (more tokens, another dtype under
    autocast); outputs always equal a fresh computation. Deep copies start without a plan."""
    import copy

    from torch import nn

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import dora_settings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40))
    config = LoraConfig(target_modules=["0"], use_dora=True, init_lora_weights=False, r=4)
    peft_model = get_peft_model(model, config).eval()
    layer = peft_model.base_model.model[0]
    slot = layer.lora_magnitude_vector["default"]._reuse

    def fresh(x):
        with dora_settings.override(decode_kernels=False):
            return peft_model(x)

    with torch.no_grad():
        x = torch.randn(1, 24)
        first = peft_model(x)
        plan = slot.decode
        assert plan is not None
        assert torch.equal(peft_model(x), first) and slot.decode is plan
        x2 = torch.randn(1, 24)  # new values, same layout: same plan
        assert_close(peft_model(x2), fresh(x2))
        assert slot.decode is plan
        for change in (
            lambda: layer.lora_B["default"].weight.mul_(1.5),
            lambda: layer.lora_magnitude_vector["default"].weight.add_(0.5),
        ):
            change()
            out = peft_model(x)
            assert slot.decode is not plan
            plan = slot.decode
            assert_close(out, fresh(x))
        x3 = torch.randn(3, 24)
        assert_close(peft_model(x3), fresh(x3))
        assert slot.decode is not plan and slot.decode.a.shape[0] == 3
        twin = copy.deepcopy(peft_model)
        assert twin.base_model.model[0].lora_magnitude_vector["default"]._reuse.decode is None
        assert_close(twin(x3), peft_model(x3))


# ---------------------------------------------------------------------------------------------------------------
# The LoRA branch inside the output's node (FusedDoRALinearFunction).
# ---------------------------------------------------------------------------------------------------------------


def _branch_model(bias, dtype=torch.float32, d_in=24, d_out=40, r=6, fp32_adapters=False):
    """``fp32_adapters``: the base in ``dtype``, the adapters in fp32 (``get_peft_model``'s default beside a half
    base)."""
    from torch import nn

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, d_out, bias=bias), nn.Linear(d_out, 33, bias=bias))
    config = LoraConfig(target_modules=["0", "1"], use_dora=True, init_lora_weights=False, r=r, lora_alpha=4)
    if not fp32_adapters:
        return get_peft_model(model, config).to(dtype)
    model = get_peft_model(model.to(dtype), config)
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    return model


def _branch_step(model, x, mode, one_node, monkeypatch, d_y=None, checkpointed=False, hook=None):
    """Output, input gradient and parameter gradients of one training step, and how many one-node branches ran."""
    import contextlib

    from torch.utils.checkpoint import checkpoint

    from peft.tuners.lora import dora_settings

    calls = []
    original = F.FusedDoRALinearFunction.forward
    monkeypatch.setattr(F.FusedDoRALinearFunction, "forward", staticmethod(lambda *a: calls.append(1) or original(*a)))
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.is_floating_point())
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext()
    with dora_settings.override(one_node_branch=one_node):
        with ctx:
            y = checkpoint(model, x, use_reentrant=False) if checkpointed else model(x)
        y.backward(torch.ones_like(y) if d_y is None else d_y)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads, len(calls)


def _assert_same_gradients(dx1, dx0, g1, g0):
    """fp32 input and parameter gradients of two runs agree, dtype for dtype."""
    assert_close(dx1, dx0)
    for name in g0:
        assert g1[name].dtype == g0[name].dtype
        assert_close(g1[name], g0[name])


def _fp64_step(model, x, d_y, monkeypatch):
    """:func:`_branch_step` of an fp64 copy without the node: the reference for half-precision runs."""
    import copy

    return _branch_step(copy.deepcopy(model).double(), x.double(), "fp64", False, monkeypatch, d_y.double())


@pytest.mark.parametrize("scaled_grad", (False, True))
@pytest.mark.parametrize("checkpointed", (False, True))
@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("mode", ("fp32", "autocast", "bf16", "mixed"))
def test_one_node_branch_matches_separate_nodes(mode, bias, checkpointed, scaled_grad, monkeypatch):
    """The same output bitwise as the separate LoRA-branch nodes (the forward does the same matmuls and kernel);
    gradients equal in fp32; in bf16 both are compared with an fp64 run: above SCALED_BRANCH_GRAD_NUMEL g·s is
    applied to B instead of to d_y, one rounding of a [tokens, d_out] tensor fewer, so the one-node gradients are no
    further from fp64; up to it (``scaled_grad``) the kernel writes g·s·d_y, as the separate nodes compute it.
    ``mixed``: a bf16 base beside fp32 adapters without autocast (``dispatch.wider_branch``), the node's output fp32."""

    monkeypatch.setattr(F, "SCALED_BRANCH_GRAD_NUMEL", 1 << 23 if scaled_grad else 0)
    asked = []
    backward = F._backward_triton
    spy = lambda *a, **k: asked.append((a[4], k.get("gs_out"))) or backward(*a, **k)  # noqa: E731
    monkeypatch.setattr(F, "_backward_triton", spy)
    if mode == "mixed":
        model = _branch_model(bias, torch.bfloat16, fp32_adapters=True)
    else:
        model = _branch_model(bias, torch.bfloat16 if mode == "bf16" else torch.float32)
    x = torch.randn(4, 9, 24, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.float32 if mode == "fp32" else torch.bfloat16)
    d_y = torch.randn(4, 9, 33, generator=torch.Generator().manual_seed(2)).to(x.dtype)
    y1, dx1, g1, n1 = _branch_step(model, x, mode, True, monkeypatch, d_y, checkpointed)
    # every one-node backward took the path asked for: the kernel's d_lora, or g·s for B's rows and d_B
    assert len(asked) == 2 and all(lora_grad is scaled_grad and (gs is None) is scaled_grad for lora_grad, gs in asked)
    y0, dx0, g0, n0 = _branch_step(model, x, mode, False, monkeypatch, d_y, checkpointed)
    assert (n1, n0) == ((4 if checkpointed else 2), 0)
    assert torch.equal(y1, y0)
    assert sorted(g1) == sorted(g0) and len(g1) == 6
    if mode == "fp32":
        _assert_same_gradients(dx1, dx0, g1, g0)
        return
    _, dx_ref, g_ref, _ = _fp64_step(model, x, d_y, monkeypatch)
    for got, sep, ref in [(dx1, dx0, dx_ref)] + [(g1[n], g0[n], g_ref[n]) for n in g0]:
        assert got.dtype == sep.dtype
        assert _rel_err(got, ref) <= 1.25 * _rel_err(sep, ref) + 1e-4 and _rel_err(got, ref) < 2e-2


@pytest.mark.parametrize("half", (torch.bfloat16, torch.float16), ids=str)
def test_fp32_adapters_beside_a_half_base_take_the_fused_tiers(half, monkeypatch):
    """PEFT's default fp32 adapters on a half-precision model, trained and run without autocast (a training loop of
    its own; ``dispatch.wider_branch``): training forwards, plain and checkpointed, take the fused backward tier,
    where they took the eager tier before; eval forwards the small tier (its three ops in fp32, with B scaled per
    forward where B is too large to keep) or above its limit the one-pass kernel, and a decode step the decode
    kernels, each again from the layers' records with the same bits. Outputs and gradients are the eager tier's
    within the half dtype's tolerance, in the same dtypes (the LoRA layer casts its fp32 sum back to the base's
    dtype, as it does LoRA's)."""
    from torch.utils.checkpoint import checkpoint

    from peft.tuners.lora import dora

    model = _branch_model(True, half, fp32_adapters=True)
    x = torch.randn(4, 9, 24, generator=torch.Generator().manual_seed(3)).to(half)
    d_y = torch.randn(4, 9, 33, generator=torch.Generator().manual_seed(4)).to(half)

    def train(fused: str, checkpointed: bool):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PEFT_DORA_FUSED", fused)
            dora._invalidate_fused_cache()
            dora.tier_counts.clear()
            model.train().zero_grad(set_to_none=True)
            xi = x.detach().requires_grad_()
            y = checkpoint(model, xi, use_reentrant=False) if checkpointed else model(xi)
            y.backward(d_y)
            tiers = dict(dora.tier_counts)
        dora._invalidate_fused_cache()
        return y.detach(), xi.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, tiers

    for checkpointed in (False, True):
        y1, dx1, g1, t1 = train("1", checkpointed)
        y0, dx0, g0, t0 = train("0", checkpointed)
        assert set(t1) == {dora.TIER_FUSED_BACKWARD} and set(t0) == {dora.TIER_EAGER}
        assert y1.dtype == y0.dtype == dx1.dtype == half
        assert_close(y1, y0, dtype=half)
        assert_close(dx1, dx0, dtype=half)
        assert sorted(g1) == sorted(g0) and len(g1) == 6
        for name in g0:
            assert g1[name].dtype == g0[name].dtype == torch.float32
            assert_close(g1[name], g0[name], dtype=half, scale=6.0)

    def evaluate(fused: str, small_numel: int = dispatch.SMALL_FORWARD_NUMEL, kept_numel=dispatch.SCALED_B_KEPT_NUMEL,
                 x=x):  # fmt: skip
        outs, tiers = [], []
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PEFT_DORA_FUSED", fused)
            mp.setattr(dispatch, "SMALL_FORWARD_NUMEL", small_numel)
            mp.setattr(dispatch, "SCALED_B_KEPT_NUMEL", kept_numel)
            dora._invalidate_fused_cache()
            model.train().eval()  # no record of an earlier call's left
            with torch.no_grad():
                for _ in range(2):  # the full path, then the layers' records
                    dora.tier_counts.clear()
                    outs.append(model(x))
                    tiers.append(set(dora.tier_counts))
            layers = [model.base_model.model[i].lora_magnitude_vector["default"] for i in (0, 1)]
            kept = [layer._reuse.eval_records(False) for layer in layers]  # (small, one-pass) per layer
        dora._invalidate_fused_cache()
        return outs, tiers, kept

    (want, _), _, _ = evaluate("0")
    for small_numel, kept_numel, tier in (
        (dispatch.SMALL_FORWARD_NUMEL, dispatch.SCALED_B_KEPT_NUMEL, dora.TIER_SMALL_FORWARD),  # s·g·B kept
        (dispatch.SMALL_FORWARD_NUMEL, 0, dora.TIER_SMALL_FORWARD),  # B scaled in each forward
        (0, dispatch.SCALED_B_KEPT_NUMEL, dora.TIER_FUSED_FORWARD),  # above the small tier's limit
    ):
        outs, tiers, kept = evaluate("1", small_numel, kept_numel)
        assert tiers == [{tier}, {tier}], (small_numel, kept_numel)
        which = 0 if tier == dora.TIER_SMALL_FORWARD else 1
        assert all(records[which] is not None and records[1 - which] is None for records in kept), (tier, kept)
        assert outs[0].dtype == half and torch.equal(outs[1], outs[0])
        assert_close(outs[0], want, dtype=half)
    # a decode step (two rows): the decode kernels, then their plan through the decode record
    step = x[0, :2]
    (want, _), _, _ = evaluate("0", x=step)
    outs, tiers, _ = evaluate("1", x=step)
    assert tiers == [{dora.TIER_DECODE}, {dora.TIER_DECODE}]
    assert outs[0].dtype == half and torch.equal(outs[1], outs[0])
    assert_close(outs[0], want, dtype=half)


def test_one_node_branch_frozen_parts_zero_tokens_and_broadcast_gradient(monkeypatch):
    """Frozen A and B (only x and m need gradients), a frozen magnitude, zero tokens, and a stride-0 incoming
    gradient (the PyTorch twin of the backward) all agree with the separate nodes."""
    model = _branch_model(True)
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(3))
    for name, p in model.named_parameters():
        p.requires_grad_("magnitude" in name)
    y1, dx1, g1, n1 = _branch_step(model, x, "fp32", True, monkeypatch)  # ones_like: the broadcast twin path
    y0, dx0, g0, _ = _branch_step(model, x, "fp32", False, monkeypatch)
    assert n1 == 2 and torch.equal(y1, y0) and sorted(g1) == sorted(g0) and len(g1) == 2
    assert_close(dx1, dx0)
    for name in g0:
        assert_close(g1[name], g0[name])
    for name, p in model.named_parameters():
        p.requires_grad_("lora_A" in name or "lora_B" in name)
    y1, dx1, g1, _ = _branch_step(model, x, "fp32", True, monkeypatch, d_y=torch.randn(3, 33))
    y0, dx0, g0, _ = _branch_step(model, x, "fp32", False, monkeypatch, d_y=y1.clone().normal_())
    assert len(g1) == 4
    empty = torch.randn(0, 24)
    y1, dx1, g1, n1 = _branch_step(model, empty, "fp32", True, monkeypatch)
    assert n1 == 2 and y1.shape == (0, 33) and dx1.shape == (0, 24)
    assert all(torch.count_nonzero(g) == 0 for g in g1.values()) and len(g1) == 4


def test_one_node_branch_saves_no_copy_of_b(dora_switches, monkeypatch):
    """Under autocast the separate nodes save bf16 copies of A and B for their backward; with lora_B inside the
    output's node only A's copy is saved (by lora_A's matmul), with x, a = x·Aᵀ and y. Its backward refuses a B
    changed in place after the forward."""

    model = _branch_model(False, d_in=24, d_out=40, r=6)
    x = torch.randn(5, 24, dtype=torch.bfloat16, requires_grad=True)
    shapes = {}
    for one_node in (True, False):
        dora_switches(one_node_branch=one_node)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(x)
        shapes[one_node] = saved
    base_weights = [(24, 40), (40, 33)]  # W·x saves the (cast, transposed) frozen base weights either way
    a_copies = [(24, 6), (40, 6)]  # Aᵀ of both layers, saved by lora_A's matmul
    activations = [(5, 24), (5, 6), (5, 40), (5, 40), (5, 6), (5, 33)]  # x, a, y per layer
    assert sorted(shapes[True]) == sorted(base_weights + a_copies + activations)
    assert sorted(shapes[False]) == sorted(shapes[True] + [(6, 40), (6, 33)])  # plus Bᵀ of both layers
    dora_switches(one_node_branch=True)
    y = model(x.float())
    with torch.no_grad():
        model.base_model.model[0].lora_B["default"].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation: the DoRA lora_B"):
        y.sum().backward()


def test_one_node_branch_steps_aside_for_hooks_and_lora_bias(monkeypatch):
    """A hook on lora_A (it must see the call, and the norm's identity before it, as upstream's forward runs them) or
    a LoRA bias takes the separate nodes, with the same output (the hooked norm dense, as upstream's: close, not the
    same bits)."""
    model = _branch_model(False)
    x = torch.randn(4, 24)
    y1, *_, n1 = _branch_step(model, x, "fp32", True, monkeypatch)
    seen = []
    handle = model.base_model.model[0].lora_A["default"].register_forward_hook(lambda *a: seen.append(1))
    y2, *_, n2 = _branch_step(model, x, "fp32", True, monkeypatch)
    handle.remove()
    assert (n1, n2, len(seen)) == (2, 1, 2)
    assert_close(y2, y1)
    lora_B = model.base_model.model[1].lora_B["default"]
    lora_B.bias = torch.nn.Parameter(torch.zeros(33))
    y3, *_, n3 = _branch_step(model, x, "fp32", True, monkeypatch)
    assert n3 == 1 and torch.equal(y1, y3)


class _FixedDropout(torch.nn.Module):
    """LoRA dropout with a mask drawn from the input's shape alone: the same mask in every dtype and run (the fp64
    reference too), and not an nn.Identity, so the layer takes the dropout path."""

    def forward(self, x):
        gen = torch.Generator().manual_seed(x.numel())
        keep = torch.rand(x.shape, generator=gen) >= 0.3
        return x * (keep.to(x.dtype) / 0.7)


def _dropout_model(bias, dtype=torch.float32):
    model = _branch_model(bias, dtype)
    for layer in (model.base_model.model[0], model.base_model.model[1]):
        layer.lora_dropout["default"] = _FixedDropout()
    return model


@pytest.mark.parametrize("checkpointed", (False, True))
@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("mode", ("fp32", "autocast", "bf16", "fp16"))
def test_dropout_node_matches_the_composition(mode, bias, checkpointed, monkeypatch):
    """LoRA dropout (upstream's semantics, y = result + (g - 1)·W·dropout(x) + g·s·B·A·dropout(x)): the output's
    node with W·dropout(x) as its base input against the composition it replaces: equal in fp32; in bf16 both near
    an fp64 run. (Not closer than the composition here: Triton's interpreter converts fp32 to bf16 by truncation,
    a bias toward zero that the magnitude's gradient sums over tokens; CUDA rounds to nearest, and the GPU suite
    compares the fused tiers' half-precision accuracy with upstream's.)"""

    half = {"bf16": torch.bfloat16, "fp16": torch.float16}
    model = _dropout_model(bias, half.get(mode, torch.float32))
    x = torch.randn(4, 9, 24, generator=torch.Generator().manual_seed(1))
    x = x.to(torch.float32 if mode == "fp32" else half.get(mode, torch.bfloat16))
    d_y = torch.randn(4, 9, 33, generator=torch.Generator().manual_seed(2)).to(x.dtype)
    y1, dx1, g1, n1 = _branch_step(model, x, mode, True, monkeypatch, d_y, checkpointed)
    y0, dx0, g0, n0 = _branch_step(model, x, mode, False, monkeypatch, d_y, checkpointed)
    assert (n1, n0) == ((4 if checkpointed else 2), 0)
    assert sorted(g1) == sorted(g0) and len(g1) == 6
    if mode == "fp32":
        assert_close(y1, y0)
        _assert_same_gradients(dx1, dx0, g1, g0)
        return
    y_ref, dx_ref, g_ref, _ = _fp64_step(model, x, d_y, monkeypatch)
    for got, sep, ref in [(y1, y0, y_ref), (dx1, dx0, dx_ref)] + [(g1[n], g0[n], g_ref[n]) for n in g0]:
        assert got.dtype == sep.dtype
        assert _rel_err(got, ref) < 1.5e-2 and _rel_err(sep, ref) < 1.5e-2
        if mode == "fp16":  # the interpreter rounds fp32 -> fp16 to nearest: here the node is no further from fp64
            assert _rel_err(got, ref) <= 1.25 * _rel_err(sep, ref) + 1e-5


@pytest.mark.parametrize("checkpointed", (False, True))
def test_dropout_node_under_autocast_casts_the_dropped_out_input_once(checkpointed, monkeypatch):
    """Under autocast the dropout node's two matmuls (``x·Aᵀ`` and ``W·x``) read the dropped-out input in autocast's
    dtype from one cast of it (autocast casts it for each matmul, and each cast's backward widens its gradient), in
    the node's forward and in its training record's, checkpoint recompute included: one cast per forward, where the
    composition (the eager tier, upstream's route) makes two."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from peft.tuners.lora import dora

    model = _dropout_model(False)
    x = torch.randn(4, 9, 24, generator=torch.Generator().manual_seed(1))
    dropped = []
    for layer in (model.base_model.model[0], model.base_model.model[1]):
        layer.lora_dropout["default"].register_forward_hook(lambda m, i, out: dropped.append(out))

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and any(args[0] is d for d in dropped):
                casts.append(args[0])
            return func(*args, **(kwargs or {}))

    for fused, per_forward in (("1", 1), ("0", 2)):
        monkeypatch.setenv("PEFT_DORA_FUSED", fused)
        dora._invalidate_fused_cache()
        for _ in range(2):  # the full path, then the layers' training records
            casts, dropped[:] = [], []
            with Casts():
                _branch_step(model, x, "autocast", True, monkeypatch, checkpointed=checkpointed)
            assert len(dropped) == (4 if checkpointed else 2)
            assert len(casts) == per_forward * len(dropped), fused
    dora._invalidate_fused_cache()


def test_interpreter_converts_to_bf16_by_truncation():
    """Why the bf16 comparisons above stop at a bound: the interpreter's fp32 -> bf16 store truncates (CUDA rounds to
    nearest); if a Triton release changes this, they can compare with the composition's error instead."""
    import triton
    import triton.language as tl

    @triton.jit
    def store(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets).to(y_ptr.dtype.element_ty))

    x = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    y = torch.empty(1024, dtype=torch.bfloat16)
    store[(1,)](x, y, BLOCK=1024)
    assert torch.equal(y.float(), (x.view(torch.int32) & ~0xFFFF).view(torch.float32))
    assert not torch.equal(y, x.to(torch.bfloat16))


def test_dropout_node_frozen_and_zero_magnitudes_and_the_chunk_budget(monkeypatch):
    """A magnitude with a zero (the node saves inner either way), a frozen magnitude (nothing activation-sized
    saved for it), frozen A and B, zero tokens and a transposed input; an output over PEFT_DORA_FWD_CHUNK_MB composes
    in slices instead."""
    from peft.tuners.lora import dora_settings

    model = _dropout_model(True)
    with torch.no_grad():
        model.base_model.model[0].lora_magnitude_vector["default"].weight[3] = 0.0
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(3))
    d_y = torch.randn(5, 33, generator=torch.Generator().manual_seed(4))
    for trainable in (("magnitude", "lora_"), ("magnitude",), ("lora_",)):
        for name, p in model.named_parameters():
            p.requires_grad_(any(t in name for t in trainable))
        y1, dx1, g1, n1 = _branch_step(model, x, "fp32", True, monkeypatch, d_y)
        y0, dx0, g0, _ = _branch_step(model, x, "fp32", False, monkeypatch, d_y)
        assert n1 == 2 and sorted(g1) == sorted(g0) and g1
        assert_close(y1, y0)
        _assert_same_gradients(dx1, dx0, g1, g0)
    for name, p in model.named_parameters():
        p.requires_grad_("magnitude" in name or "lora_" in name)
    empty = torch.randn(0, 24)
    y1, dx1, g1, n1 = _branch_step(model, empty, "fp32", True, monkeypatch)
    assert n1 == 2 and y1.shape == (0, 33) and dx1.shape == (0, 24)
    assert all(torch.count_nonzero(g) == 0 for g in g1.values()) and len(g1) == 6
    strided = torch.randn(24, 5, generator=torch.Generator().manual_seed(6)).t()  # a transposed input
    y1, dx1, g1, n1 = _branch_step(model, strided, "fp32", True, monkeypatch, d_y)
    y0, dx0, g0, _ = _branch_step(model, strided.contiguous(), "fp32", False, monkeypatch, d_y)
    assert n1 == 2
    assert_close(y1, y0)
    _assert_same_gradients(dx1, dx0, g1, g0)
    big = torch.randn(4, 4096, 24, generator=torch.Generator().manual_seed(5))  # outputs of 2.6 and 2.2 MB
    dispatch.tier_counts.clear()
    with dora_settings.override(fwd_chunk_mb=1):
        _, _, _, n = _branch_step(model, big, "fp32", True, monkeypatch)
    assert n == 0 and sum(dispatch.tier_counts.values()) > 2  # each output composed in 1 MB slices
    with dora_settings.override(fwd_chunk_mb=4):
        _, _, _, n = _branch_step(model, big, "fp32", True, monkeypatch)
    assert n == 2


def _recorded_branch_model(inference=False):
    """:func:`_branch_model` whose first DoRA Linear takes its training norms from a record of a stand-in graph
    (``inference``: one captured under torch.inference_mode, whose buffer is an inference tensor)."""
    from peft.tuners.lora import dora_norm

    model = _branch_model(False)
    linear = model.base_model.model[0]
    layer = linear.lora_magnitude_vector["default"]
    tensors = linear.base_layer.weight, linear.lora_A["default"].weight, linear.lora_B["default"].weight
    graph = StandInNormGraph(*tensors, linear.scaling["default"], inference=inference)
    graph.replay()
    layer._reuse.record = dora_norm.eager_record(graph, *tensors, linear.scaling["default"], None, graph.out)
    assert layer._reuse.record is not None
    return model, graph, tensors


def test_training_nodes_read_the_norm_buffer_only_while_its_weights_hold():
    """A layer's norm graph hands its training nodes the output buffer itself (no copy per forward): two forwards
    of unchanged weights before one backward give the gradients of copies; a forward after an in-place edit of A
    that autograd does not see (the layer's input takes no gradient, so A is not saved) rewrites the buffer, and the
    earlier forward's backward fails as autograd fails on an edited saved tensor instead of reading the new norm."""
    model, graph, (weight, lora_A, lora_B) = _recorded_branch_model()
    reference = _branch_model(False)  # the same seeded weights, norms computed afresh
    x1, x2 = (torch.randn(5, 24, generator=torch.Generator().manual_seed(k)) for k in (1, 2))
    d1, d2 = (torch.randn(5, 33, generator=torch.Generator().manual_seed(k)) for k in (3, 4))
    grads = []
    for m in (model, reference):
        ((m(x1) * d1).sum() + (m(x2) * d2).sum()).backward()
        grads.append([p.grad for p in m.parameters() if p.requires_grad])
    assert graph.replays == 3  # the record replayed the graph in both forwards
    for got, want in zip(*grads):
        assert torch.equal(got, want)

    model.zero_grad(set_to_none=True)
    y1 = model(x1)
    with torch.no_grad():
        lora_A.mul_(1.5)
    model(x2)  # replays from the edited A: the buffer y1's node holds changes
    assert graph.replays == 5
    with pytest.raises(RuntimeError, match="weight norm"):
        (y1 * d1).sum().backward()


def test_a_norm_graph_captured_under_inference_mode_trains_from_copies():
    """A training-mode model first called under torch.inference_mode captures its norm graph there: the buffer is an
    inference tensor, which has no version counter and which autograd may not record outside inference mode. Its
    training forwards take copies of it (ordinary tensors), and train as a model without the record does."""
    model, graph, _ = _recorded_branch_model(inference=True)
    assert graph.out.is_inference()
    reference = _branch_model(False)
    x = torch.randn(5, 24, generator=torch.Generator().manual_seed(1))
    d_y = torch.randn(5, 33, generator=torch.Generator().manual_seed(2))
    grads = []
    for m in (model, reference):
        (m(x) * d_y).sum().backward()
        grads.append([p.grad for p in m.parameters() if p.requires_grad])
    assert graph.replays == 2
    for got, want in zip(*grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dropout", ("none", "exact", "branch"))
def test_training_record_answers_only_while_it_holds(monkeypatch, request, dropout):
    """A training forward on the one-node branch keeps a record (``dora_cache.TrainRecord``) that answers the next
    training forwards and their checkpoint recomputes without the gates (with LoRA dropout, upstream's semantics'
    node, whose base input is ``W·dropout(x)``, or PEFT_DORA_DROPOUT=branch's): the same bits as the full path, and the
    output a fresh computation's (the eager tier's), after each change below. Values the norm record sees (in-place
    edits of W, A, m, an optimizer step) leave it answering with a fresh norm; a replaced parameter object, a new
    scaling, m in another dtype, a trainable bias, a hook on ``lora_A``, autocast, new settings, ``DoraCaching``,
    grad mode off, eval mode and a wider input make it step aside (the full path decides, and makes a new record
    where its tier is the node's)."""
    import contextlib

    from sharded_training_worker import _emulate_norm_graphs
    from torch import nn

    from peft.helpers import DoraCaching
    from peft.tuners.lora import dora, dora_settings

    _emulate_norm_graphs(monkeypatch.setattr)  # training norms down the GPU's path: the layers make norm records
    if dropout == "branch":
        settings = contextlib.ExitStack()
        settings.enter_context(dora_settings.override(dropout="branch"))
        request.addfinalizer(settings.close)
    model = small_dora_model(0.0 if dropout == "none" else 0.25).train()
    first, second = model.base_model.model[0], model.base_model.model[2]
    x, answered, step, check, settle, fresh = training_record_steps(monkeypatch, model, 24, 17, torch.float32)

    settle("the first steps")
    # the forward of both layers and the recompute (which stops once the saved tensors the backward needs are back:
    # the first layer's)
    check([True, True, True], "checkpoint recompute", checkpointed=True)
    # a reentrant checkpoint: both layers' first passes without autograd (the one-pass output kernel; with upstream's
    # dropout semantics the composition), then both recomputes with it
    check([True] * 4, "reentrant checkpoint", reentrant=True)
    outputs = []
    for off in (False, True):  # a training-mode forward under inference_mode: the record's answer is the full path's
        with torch.inference_mode(), pytest.MonkeyPatch.context() as mp:
            if off:
                mp.setattr(dora.DoraLinearLayer, "recorded_training_output", lambda *args: None)
            answered.clear()
            torch.manual_seed(3)
            outputs.append(model(x))
            assert answered == ([] if off else [True, True])
    assert torch.equal(*outputs)
    settle("inference mode")  # the norm records' inference values are not handed to autograd
    lora_B = first.lora_B["default"]
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    weight = first.base_layer.weight
    fresh_values = {  # the norm record replays its graph from these values, so the training record answers
        "A in place": (lambda: second.lora_A["default"].weight.mul_(1.25), [True, True]),
        "m in place": (lambda: first.lora_magnitude_vector["default"].weight.mul_(0.5), [True, True]),
        "optimizer step": (lambda: opt.step(), [True, True]),  # with the gradients of the step before
        # a frozen W's kept ||W||² is stale: the norm record declines, and the training record with it
        "W in place": (lambda: weight.add_(0.01), [False, True]),
        # a write PyTorch's version counters cannot see, announced by invalidate_norm_caches()
        "unseen write": (lambda: (weight.data.mul_(1.5), dora.invalidate_norm_caches()), [False, False]),
    }
    for label, (change, answers) in fresh_values.items():
        with torch.no_grad():
            change()
        check(answers, label)
        settle(label)
    m = second.lora_magnitude_vector["default"].weight
    steps_aside = {  # what changes, which layer's record must step aside, and how it is undone (None: it is not)
        "new B object": (
            lambda: setattr(lora_B, "weight", nn.Parameter(lora_B.weight.detach() * 2)), [False, True], None
        ),
        "new scaling": (lambda: first.scaling.__setitem__("default", 0.75), [False, True], None),
        "m in float64": (
            lambda: setattr(m, "data", m.data.double()), [True, False], lambda: setattr(m, "data", m.data.float())
        ),
        "a trainable bias": (
            lambda: first.base_layer.bias.requires_grad_(True), [False, True],
            lambda: first.base_layer.bias.requires_grad_(False),
        ),
    }  # fmt: skip
    for label, (change, answers, undo) in steps_aside.items():
        change()
        answered.clear()
        y, _ = step()
        assert answered == answers, (label, answered)
        assert_close(y, fresh(x), dtype=torch.float32)
        if undo is not None:
            undo()
        settle(label)

    handle = second.lora_A["default"].register_forward_hook(lambda *args: None)
    check([True, False], "hook")
    handle.remove()
    check([True, True], "hook removed")
    wide = torch.randn(2, 3, 24, dtype=torch.float64)
    model.double()  # a new dtype throughout: every layout differs
    answered.clear()
    step(inputs=wide)
    assert answered == [False, False]
    model.float()
    settle("float64")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        answered.clear()
        step()
        assert answered == [False, False]
    with dora_settings_changed():
        answered.clear()
        step()
        assert answered == [False, False]
    with DoraCaching():
        answered.clear()
        step()
        assert answered == [False, False]
    answered.clear()
    with torch.no_grad():
        model(x)
    assert answered == [False, False]  # grad mode off: the full path (no node)
    model.eval()
    with torch.no_grad():
        model(x)
    assert answered == [False, False]  # eval forwards do not ask
    model.train()  # clears every record
    answered.clear()
    step()
    assert answered == [False, False]
    settle("train()")


@pytest.mark.parametrize("dropout", ("none", "exact"))
@pytest.mark.parametrize("kind", ("nf4", "int8"))
def test_training_record_of_a_quantized_layer_answers_only_while_it_holds(monkeypatch, kind, dropout):
    """The training record on a bitsandbytes base (QDoRA: the packed weight and its scales stand for W, the norm comes
    from the layer's quantized norm record, ``dora_norm._QuantRecord``; with LoRA dropout the node's base input is
    ``W·dropout(x)`` through the dequantizing matmul): it answers the next training forwards and checkpoint recomputes
    with the full path's bits and a fresh computation's output. An optimizer step and an in-place edit of A leave it
    answering (the norm record replays); scales edited in place (the kept ``||W||²`` is stale, the norm record
    declines), a requantized weight (new objects), a new scaling, autocast and ``train()`` make it step aside."""

    from dora_testing import BnbNet, bnb_linear, edit_scales_in_place, perturb_magnitudes
    from sharded_training_worker import _emulate_norm_graphs

    from peft import LoraConfig, get_peft_model

    _emulate_norm_graphs(monkeypatch.setattr)  # training norms down the GPU's path: the layers make norm records
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["up", "down"], use_dora=True, init_lora_weights=False,
                        lora_dropout=0.0 if dropout == "none" else 0.25)  # fmt: skip
    torch.manual_seed(3)
    model = perturb_magnitudes(get_peft_model(BnbNet(kind), config)).train()
    up, down = model.base_model.model.up, model.base_model.model.down
    _, answered, step, check, settle, _ = training_record_steps(monkeypatch, model, 64, 40, torch.bfloat16)

    settle("the first steps")
    assert all(type(layer._reuse.train.norm).__name__ == "_QuantRecord" for layer in dora_layers_of(model))
    # both layers' forwards and the recompute, which stops once the saved tensors the backward needs are back (up's)
    check([True, True, True], "checkpoint recompute", checkpointed=True)
    # prepare_model_for_kbit_training's reentrant checkpoint: the first passes without autograd, then the recomputes
    check([True] * 4, "reentrant checkpoint", reentrant=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with torch.no_grad():
        opt.step()
    check([True, True], "optimizer step")
    with torch.no_grad():
        down.lora_A["default"].weight.mul_(1.25)
    check([True, True], "A in place")
    edit_scales_in_place(up.base_layer)  # the norm record's kept ||W||² is stale: it declines, and this record too
    check([False, True], "scales in place")
    settle("scales in place")
    replacement = bnb_linear(kind, 96, 40, seed=7)
    down.base_layer.weight = replacement.weight  # requantized: new objects
    if kind == "int8":
        down.base_layer.state = replacement.state
    check([True, False], "requantized")
    settle("requantized")
    down.scaling["default"] = 0.75
    check([True, False], "new scaling")
    settle("new scaling")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        answered.clear()
        step()
        assert answered == [False, False]
    model.train()  # clears every record
    answered.clear()
    step()
    assert answered == [False, False]


@pytest.mark.parametrize("dropout", ("none", "exact"))
@pytest.mark.parametrize("mode", ("plain", "checkpointed", "reentrant"))
def test_training_record_takes_odd_inputs_as_the_full_path_does(monkeypatch, mode, dropout):
    """Once the training records answer, inputs of other shapes and layouts go through them (the record keys on the
    tensors and settings, not on x's rows): 0 tokens, an empty batch, one row, more rows, a transposed (non-contiguous)
    and a broadcast (stride-0) input, a 2-D input and NaNs. Each step's output, input gradient and parameter gradients
    are bitwise the full path's (records off), and the output a fresh eager computation's; plainly, under a
    non-reentrant checkpoint and a reentrant one, with and without LoRA dropout (upstream's semantics)."""
    from sharded_training_worker import _emulate_norm_graphs
    from torch.utils.checkpoint import checkpoint

    from peft.tuners.lora import dora

    _emulate_norm_graphs(monkeypatch.setattr)  # training norms down the GPU's path: the layers make norm records
    model = small_dora_model(0.0 if dropout == "none" else 0.25).train()
    x, answered, _, _, settle, fresh = training_record_steps(monkeypatch, model, 24, 17, torch.float32)
    settle("the first steps")
    odd = {
        "0 tokens": x[:, :0],
        "empty batch": x[:0],
        "one row": x[:1, :1],
        "more rows": torch.randn(4, 50, 24, generator=torch.Generator().manual_seed(4)),
        "transposed": torch.randn(3, 2, 24, generator=torch.Generator().manual_seed(5)).transpose(0, 1),
        "broadcast": torch.randn(1, 1, 24, generator=torch.Generator().manual_seed(6)).expand(2, 3, 24),
        "2-D": x[0],
        "NaNs": torch.where(torch.rand(x.shape, generator=torch.Generator().manual_seed(7)) < 0.1, torch.nan, x),
    }

    def run(inputs, fast):
        with pytest.MonkeyPatch.context() as mp:
            if not fast:
                mp.setattr(dora.DoraLinearLayer, "recorded_training_output", lambda *args: None)
            model.zero_grad(set_to_none=True)
            torch.manual_seed(3)  # the same dropout masks
            inputs = inputs.detach().clone().requires_grad_()
            if mode == "reentrant":
                y = checkpoint(model, inputs, use_reentrant=True)
            else:
                y = checkpoint(model, inputs, use_reentrant=False) if mode == "checkpointed" else model(inputs)
            (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            return [y.detach(), inputs.grad, *grads.values()], list(grads)

    same = lambda a, b: torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))  # noqa: E731
    for label, inputs in odd.items():
        answered.clear()
        ours, names = run(inputs, True)
        assert answered and all(answered), (label, answered)  # every forward (and recompute) from a record
        full, full_names = run(inputs, False)
        assert names == full_names and len(names) == 6, label
        assert all(same(a, b) for a, b in zip(ours, full)), label
        reference = fresh(inputs)
        assert same(torch.isnan(ours[0]).float(), torch.isnan(reference).float()), label
        assert_close(ours[0].nan_to_num(0.0), reference.nan_to_num(0.0), dtype=torch.float32)


def dora_layers_of(model):
    from peft.tuners.lora import dora

    return [m for m in model.modules() if isinstance(m, dora.DoraLinearLayer)]


def training_record_steps(monkeypatch, model, d_in: int, d_out: int, dtype: torch.dtype) -> tuple:
    """``(x, answered, step, check, settle, fresh)`` of the training record tests for ``model`` (two DoRA layers,
    ``d_in`` features in and ``d_out`` out): a seeded input ``x`` [2, 3, d_in] and loss weights ``d_y``; ``answered``,
    the list each ``recorded_training_output`` call appends its answer to (``counting_records``, patched in).
    ``step(fast, inputs, checkpointed, reentrant)``: one training step on ``inputs`` (``x``) with the loss
    ``sum(y·d_y)``, the same dropout masks every time, as it is (``fast``) or with the records switched off (the full
    path), plainly, under a non-reentrant checkpoint or a reentrant one (the first pass without autograd, the
    recompute with it); the output and the gradients. ``check(answers, label, **step_kwargs)``: one step whose records
    answered as ``answers`` say, its output and gradients bitwise the full path's, its output a fresh eager
    computation's (``dtype``'s tolerance). ``settle(label)``: steps until the records answer again (the norm graph
    captures on a layer's second forward with new tensors, the records follow), then one checked step.
    ``fresh(inputs)``: that fresh computation's output."""
    import copy

    from torch.utils.checkpoint import checkpoint

    from peft.tuners.lora import dora, dora_settings

    x = torch.randn(2, 3, d_in, generator=torch.Generator().manual_seed(1))
    d_y = torch.randn(2, 3, d_out, generator=torch.Generator().manual_seed(2))
    answered = []
    monkeypatch.setattr(
        dora.DoraLinearLayer, "recorded_training_output", counting_records(answered, "recorded_training_output")
    )

    def step(fast=True, inputs=x, checkpointed=False, reentrant=False):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)  # the same dropout masks in every step
        with pytest.MonkeyPatch.context() as mp:
            if not fast:
                mp.setattr(dora.DoraLinearLayer, "recorded_training_output", lambda *args: None)
            if reentrant:  # the first pass without autograd, the recompute with it (an input must require grad)
                y = checkpoint(model, inputs.detach().requires_grad_(), use_reentrant=True)
            else:
                y = checkpoint(model, inputs, use_reentrant=False) if checkpointed else model(inputs)
            (y * d_y).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    def fresh(inputs):
        """The output computed afresh with PyTorch ops (upstream's path) by a copy of the model (whose records start
        empty), leaving the model's records and the settings snapshot as they were."""
        with torch.no_grad(), dora_settings.plain():
            reference = copy.deepcopy(model)
            torch.manual_seed(3)
            return reference(inputs)

    def check(answers, label, **kwargs):
        answered.clear()
        y, grads = step(**kwargs)
        assert answered == answers, (label, answered)
        y_full, grads_full = step(fast=False, **kwargs)
        assert torch.equal(y, y_full), label
        assert grads.keys() == grads_full.keys() and len(grads) == 6, label
        assert all(torch.equal(grads[k], grads_full[k]) for k in grads), label
        assert_close(y, fresh(kwargs.get("inputs", x)), dtype=dtype)

    def settle(label):
        for _ in range(3):
            answered.clear()
            step()
        check([True, True], "after " + label)

    return x, answered, step, check, settle, fresh


def _dropout_layer(bias=True, p=0.25, d_in=48, d_out=40, r=6):
    """A bf16 Linear with PEFT's default fp32 adapters and LoRA dropout ``p`` (upstream's semantics)."""
    from torch import nn

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(target_modules=["0"], use_dora=True, init_lora_weights=False, r=r, lora_alpha=4, lora_dropout=p)
    model = get_peft_model(nn.Sequential(nn.Linear(d_in, d_out, bias=bias)).to(torch.bfloat16), config)
    layer = model.get_base_model()[0]
    assert layer.lora_A["default"].weight.dtype == torch.float32
    return layer


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("fused", ("1", "0"))
def test_dropout_of_a_bf16_input_beside_fp32_adapters_keeps_w_in_bf16(fused, bias, monkeypatch):
    """LoRA dropout (upstream's semantics) on a bf16 model with fp32 adapters, without autocast: ``W·dropout(x)`` is
    one bf16 matmul of the dropped-out input taken back to bf16, fp32 out (``dora_fused.DroppedHalfBase``; its fp32
    twin here, as CUDA's fp32-output matmul is not on the CPU), not a copy of W in fp32 and an fp32 matmul; on the
    one-node tier where the fused tiers run (the eager tier before), the composition where they do not. Against an
    fp64 run of the same dropout mask the output and every gradient err at most as much as the fp32-W path's, within
    1.25x (the input's gradient: the bf16 rounding of ``(g - 1)·d_y`` before its matmul, then of the input's own
    gradient, which the fp32 path rounds once)."""
    from dora_testing import dropout_reference_fp64, dropout_step

    from peft.tuners.lora import dora

    layer = _dropout_layer(bias)
    x = torch.randn(3, 11, 48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    weights = torch.randn(40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    monkeypatch.setenv("PEFT_DORA_FUSED", fused)
    dora._invalidate_fused_cache()
    runs = {}
    for devices in (("cuda", "cpu"), ("cuda",)):
        monkeypatch.setattr(F, "HALF_BASE_DEVICES", devices)
        dora.tier_counts.clear()
        runs[devices] = dropout_step(layer, x, weights)
        runs[devices]["tiers"] = set(dora.tier_counts)
    dora._invalidate_fused_cache()
    new, old = runs[("cuda", "cpu")], runs[("cuda",)]
    assert (new["half_bases"], old["half_bases"]) == (1, 0)
    assert torch.equal(new["dropped"], old["dropped"])  # the same mask (seeded)
    tier = dora.TIER_FUSED_BACKWARD if fused == "1" else dora.TIER_EAGER
    assert new["tiers"] == {tier} and old["tiers"] == {dora.TIER_EAGER}
    assert new["y"].dtype == new["dx"].dtype == torch.bfloat16
    ref = dropout_reference_fp64(layer, x, new["dropped"], weights)
    pairs = [(new["y"], old["y"], ref["y"]), (new["dx"], old["dx"], ref["dx"])]
    pairs += [(new["grads"][n], old["grads"][n], ref["grads"][n]) for n in ref["grads"]]
    for got, before, want in pairs:
        assert got.dtype == before.dtype
        assert _rel_err(got, want) <= 1.25 * _rel_err(before, want) + 1e-3


def test_dropout_of_a_bf16_input_keeps_the_fp32_path_where_the_bf16_base_does_not_hold(monkeypatch):
    """``W·dropout(x)`` stays an fp32 matmul of an fp32 copy of W (upstream's) where the bf16 path's premises fail:
    a W that takes a gradient, a dropout module other than ``nn.Dropout`` itself (its scaling unknown), a PyTorch
    without ``torch.mm``'s fp32 output, autocast (the matmul is autocast's), fp32 activations (no bf16 input to take
    back)."""
    from dora_testing import dropout_step
    from torch import nn

    layer = _dropout_layer()
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights = torch.randn(40, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    monkeypatch.setattr(F, "HALF_BASE_DEVICES", ("cuda", "cpu"))
    assert dropout_step(layer, x, weights)["half_bases"] == 1

    layer.base_layer.weight.requires_grad_(True)
    assert dropout_step(layer, x, weights)["half_bases"] == 0
    layer.base_layer.weight.requires_grad_(False)

    class MyDropout(nn.Dropout):
        pass

    original = layer.lora_dropout["default"]
    layer.lora_dropout["default"] = MyDropout(original.p)
    assert dropout_step(layer, x, weights)["half_bases"] == 0
    layer.lora_dropout["default"] = original

    monkeypatch.setattr(F, "WIDE_MM", False)
    assert dropout_step(layer, x, weights)["half_bases"] == 0
    monkeypatch.setattr(F, "WIDE_MM", True)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert dropout_step(layer, x, weights)["half_bases"] == 0
    layer.float()
    assert dropout_step(layer, x.float(), weights)["half_bases"] == 0


@pytest.mark.parametrize("p", (0.05, 0.1, 0.3, 0.5, 0.9))
def test_undo_dropout_scale_gives_back_the_masked_bf16_input(p):
    """``nn.Dropout``'s fp32 output of a bf16 input, times the keep probability and rounded to bf16, is the input
    where the mask kept it, bit for bit, over bf16's normal range (``dora_fused.undo_dropout_scale``); the matmul
    of :class:`dora_fused.DroppedHalfBase` then equals fp64's of the dropped-out input within fp32 rounding, and its
    input gradient ``d_base·W`` within the bf16 rounding of ``d_base``."""
    gen = torch.Generator().manual_seed(int(p * 100))
    mantissa = torch.rand(4096, generator=gen) + 1.0
    exponent = torch.randint(-120, 120, (4096,), generator=gen).float()
    sign = torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0)
    x = (sign * mantissa * torch.exp2(exponent)).to(torch.bfloat16)
    x[:4] = torch.tensor([0.0, -0.0, 3.0e38, -1.0e-37])
    x = x.view(64, 64)
    dropout = torch.nn.Dropout(p)
    torch.manual_seed(5)
    dropped = dropout(x.float())
    masked = F.undo_dropout_scale(dropped, 1.0 - p, torch.bfloat16)
    assert masked.dtype == torch.bfloat16
    # where 3e38 / keep overflowed fp32, upstream's dropped-out input holds inf too, and so does the bf16 one
    want = torch.where(dropped != 0, x, torch.zeros_like(x)).masked_fill(dropped.isinf(), float("inf"))
    assert torch.equal(masked, want)

    weight = torch.randn(24, 64, generator=gen).to(torch.bfloat16)
    act = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    torch.manual_seed(6)
    drop = dropout(act.float()).requires_grad_()
    out = F.dropped_half_base(drop, F.undo_dropout_scale(drop, 1.0 - p, torch.bfloat16), weight, 1.0 - p)
    want = drop.detach().double() @ weight.double().T
    assert out.dtype == torch.float32
    assert_close(out.double(), want, dtype=torch.float32)
    d_base = torch.randn(5, 24, generator=gen)
    out.backward(d_base)
    assert drop.grad.dtype == torch.float32
    want_grad = d_base.double() @ weight.double()
    assert _rel_err(drop.grad, want_grad) < 2**-8
