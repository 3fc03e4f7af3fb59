"""One-pass Triton row norm against an fp64 dense reference under the Triton interpreter; `test_dora_norm_triton.py`
runs this file in a child process with TRITON_INTERPRET=1 (Triton fixes interpretation when a kernel is decorated,
i.e. when the module is first imported).

Run directly: TRITON_INTERPRET=1 python -m pytest tests/tuners/lora/dora_norm_triton_cases.py -q
"""

import itertools

import pytest
import torch

from peft.tuners.lora import dora_norm_triton as N


if not N.row_norm_supported(torch.empty(1, 1), torch.empty(1, 1), torch.empty(1, 1)):
    raise RuntimeError("dora_norm_triton_cases.py needs TRITON_INTERPRET=1 set before peft is imported")

DIMS = (1, 5, 17, 64, 100, 130)
RANKS = (1, 3, 16, 33, 70)
SCALE = 0.75
# Relative tolerance by W dtype. The reference takes the same rounded inputs in fp64, so only the kernel's fp32
# arithmetic is judged (the interpreter runs every dot in fp32; TF32 is checked on the GPU).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}
# Small tiles so that shapes of a few dozen columns already run several splits, several tiles per split and
# (with r > 16) the rank loop instead of resident B rows.
SMALL = N._Config(block_m=16, block_k=16, block_r=16, cols_per_split=32, num_warps=4, num_stages=3)


def _inputs(d_out, d_in, r, w_dtype=torch.float32, ab_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed * 100003 + d_out * 1009 + d_in * 31 + r)
    weight = torch.randn(d_out, d_in, generator=gen).to(w_dtype)
    lora_A = (torch.randn(r, d_in, generator=gen) / max(d_in, 1) ** 0.5).to(ab_dtype)
    lora_B = torch.randn(d_out, r, generator=gen).to(ab_dtype)
    return weight, lora_A, lora_B


def _reference(weight, lora_A, lora_B, scale):
    return torch.linalg.vector_norm(weight.double() + scale * lora_B.double() @ lora_A.double(), dim=1)


def _norm(weight, lora_A, lora_B, scale, config=None):
    """The public function (default policy) or the launcher with an explicit config."""
    if config is None:
        return N.triton_row_norm(weight, lora_A, lora_B, scale)
    return N._row_norm_triton(weight, lora_A, lora_B, scale, config)


def _check(got, weight, lora_A, lora_B, scale=SCALE):
    assert got.dtype == torch.float32 and got.shape == (weight.shape[0],) and got.is_contiguous()
    want = _reference(weight, lora_A, lora_B, scale)
    rtol = RTOL[weight.dtype]
    atol = rtol * want.nan_to_num(0.0, 0.0, 0.0).abs().max().item()  # rows near 0: judged on the output scale
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol, equal_nan=True)


@pytest.mark.parametrize("d_out, d_in", list(itertools.product(DIMS, DIMS)))
def test_fp32_matches_fp64(d_out, d_in):
    r = RANKS[(DIMS.index(d_out) + DIMS.index(d_in)) % len(RANKS)]  # every rank, spread over the shape grid
    weight, lora_A, lora_B = _inputs(d_out, d_in, r)
    _check(N.triton_row_norm(weight, lora_A, lora_B, SCALE), weight, lora_A, lora_B)


DTYPE_COMBOS = [
    (torch.bfloat16, torch.float32, torch.float32),  # autocast: half base weight, fp32 adapter
    (torch.float16, torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),  # native half dot
    (torch.float16, torch.float16, torch.float16),
    (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.float32),  # mixed adapter dtypes: fp32 operands
    (torch.float16, torch.bfloat16, torch.float16),
]


@pytest.mark.parametrize("w_dtype, a_dtype, b_dtype", DTYPE_COMBOS, ids=str)
@pytest.mark.parametrize("d_out, d_in, r", [(17, 130, 33), (100, 64, 3), (5, 100, 70)])
def test_dtype_combinations(w_dtype, a_dtype, b_dtype, d_out, d_in, r):
    weight, lora_A, _ = _inputs(d_out, d_in, r, w_dtype, a_dtype)
    lora_B = _inputs(d_out, d_in, r, ab_dtype=b_dtype, seed=1)[2]
    _check(N.triton_row_norm(weight, lora_A, lora_B, SCALE), weight, lora_A, lora_B)


@pytest.mark.parametrize("layout", ["w_transposed", "a_transposed", "b_transposed", "all_transposed", "sliced"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_inputs(layout, dtype):
    d_out, d_in, r = 37, 100, 20
    weight, lora_A, lora_B = _inputs(d_out, d_in, r, dtype, dtype)
    if layout in ("w_transposed", "all_transposed"):
        weight = weight.t().contiguous().t()
    if layout in ("a_transposed", "all_transposed"):
        lora_A = lora_A.t().contiguous().t()
    if layout in ("b_transposed", "all_transposed"):
        lora_B = lora_B.t().contiguous().t()
    if layout == "sliced":  # strides > extent on both axes of every operand
        weight = _inputs(2 * d_out, 3 * d_in, r, dtype)[0][::2, 1::3]
        lora_A = _inputs(2 * r, 2 * d_in, r, dtype)[0][1::2, ::2]
        lora_B = _inputs(3 * d_out, 2 * r, r, dtype)[0][::3, 1::2]
    _check(N.triton_row_norm(weight, lora_A, lora_B, SCALE), weight, lora_A, lora_B)
    _check(N._row_norm_triton(weight, lora_A, lora_B, SCALE, SMALL), weight, lora_A, lora_B)


@pytest.mark.parametrize("d_out, d_in, r", [(37, 100, 20), (5, 130, 70), (64, 33, 1), (17, 16, 16)])
def test_several_splits(d_out, d_in, r):
    weight, lora_A, lora_B = _inputs(d_out, d_in, r)
    for config in (SMALL, SMALL._replace(cols_per_split=16), SMALL._replace(block_m=32, block_r=64)):
        _check(N._row_norm_triton(weight, lora_A, lora_B, SCALE, config), weight, lora_A, lora_B)


def test_default_policy_splits_wide_weights():
    weight, lora_A, lora_B = _inputs(20, 600, 3)
    config = N._launch_config(20, 600, 4, N._DEFAULT_SM_COUNT)
    assert -(-600 // config.cols_per_split) > 1
    _check(N.triton_row_norm(weight, lora_A, lora_B, SCALE), weight, lora_A, lora_B)


def test_bitwise_repeatable():
    weight, lora_A, lora_B = _inputs(37, 100, 20, torch.bfloat16, torch.float32)
    for config in (SMALL, N._launch_config(37, 100, 32, N._DEFAULT_SM_COUNT)):
        first = N._row_norm_triton(weight, lora_A, lora_B, SCALE, config)
        assert torch.equal(first, N._row_norm_triton(weight, lora_A, lora_B, SCALE, config))


def test_empty_input_dimension_gives_zeros():
    weight, lora_A, lora_B = _inputs(7, 0, 3)
    got = N.triton_row_norm(weight, lora_A, lora_B, SCALE)
    assert got.dtype == torch.float32 and torch.equal(got, torch.zeros(7))


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
def test_zero_scale_is_the_weight_norm(config):
    weight, lora_A, lora_B = _inputs(17, 100, 33, torch.bfloat16, torch.float32)
    got = _norm(weight, lora_A, lora_B, 0.0, config)
    torch.testing.assert_close(got.double(), torch.linalg.vector_norm(weight.double(), dim=1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("config", [None, SMALL], ids=["default", "small"])
def test_nan_and_inf_propagate(config):
    weight, lora_A, lora_B = _inputs(37, 100, 20)
    weight[3, 50], weight[9, 0], weight[20, 99] = float("nan"), float("inf"), float("-inf")
    got = _norm(weight, lora_A, lora_B, SCALE, config)
    assert got[3].isnan() and got[9] == float("inf") and got[20] == float("inf")
    _check(got, weight, lora_A, lora_B)  # every other row as usual, NaN/Inf in the same places


@pytest.mark.parametrize("scale", [-0.5, 2.0**-17, 2.0**-16, 3.0, 2.0**16, 2.0**17])
@pytest.mark.parametrize("ab_dtype", [torch.bfloat16, torch.float32])
def test_scales_in_and_outside_the_folded_range(scale, ab_dtype):
    """A half W's tiles start from ``W/s`` inside ``_FOLD_SCALES`` and add ``s·(B·A)`` outside it: the same norm
    either way, negative scales included (B scaled so that ``s·B·A`` stays comparable to W)."""
    weight, lora_A, lora_B = _inputs(37, 100, 20, torch.bfloat16, ab_dtype)
    lora_B = (lora_B.float() / abs(scale)).to(ab_dtype)
    assert N._folds(weight, scale) == (2.0**-16 <= abs(scale) <= 2.0**16)
    for config in (None, SMALL):
        _check(_norm(weight, lora_A, lora_B, scale, config), weight, lora_A, lora_B, scale)


def test_nan_and_inf_propagate_through_the_folded_tiles():
    weight, lora_A, lora_B = _inputs(37, 100, 20, torch.bfloat16, torch.bfloat16)
    weight[3, 50], weight[9, 0], weight[20, 99] = float("nan"), float("inf"), float("-inf")
    assert N._folds(weight, SCALE)
    got = N.triton_row_norm(weight, lora_A, lora_B, SCALE)
    assert got[3].isnan() and got[9] == float("inf") and got[20] == float("inf")
    _check(got, weight, lora_A, lora_B)


def test_ignores_autocast_and_autograd():
    weight, lora_A, lora_B = _inputs(17, 64, 16, torch.bfloat16, torch.float32)
    lora_A.requires_grad_(True)
    lora_B.requires_grad_(True)
    plain = N.triton_row_norm(weight, lora_A, lora_B, SCALE)
    assert not plain.requires_grad
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert torch.equal(N.triton_row_norm(weight, lora_A, lora_B, SCALE), plain)
    _check(plain, weight, lora_A.detach(), lora_B.detach())


# ---------------------------------------------------------------------------------------------------------------
# The split norm (fp32 adapters on a half W): hi/lo splits, three products, the row-wise epilogue kernel.
# ---------------------------------------------------------------------------------------------------------------


def _split_norm(weight, lora_A, lora_B, scale=SCALE, cols=None):
    from peft.tuners.lora import dora

    assert N.split_norm_supported(weight, lora_A, lora_B)
    return N.split_row_norm(weight, lora_A, lora_B, scale, dora.row_sq_norm(weight), cols or weight.shape[1])


@pytest.mark.parametrize("ab", ["fp32", "half"])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d_out, d_in, r", [(1, 5, 1), (17, 100, 16), (130, 64, 33), (64, 130, 70), (100, 17, 130)])
def test_split_norm_matches_fp64(d_out, d_in, r, w_dtype, ab):
    # r = 130 takes two steps of the epilogue's walk over the rank (128 columns each); the others one, masked.
    # "half": A and B in W's dtype, A unsplit (U and the Gram without hi/lo pairs)
    weight, lora_A, lora_B = _inputs(d_out, d_in, r, w_dtype, w_dtype if ab == "half" else torch.float32)
    _check(_split_norm(weight, lora_A, lora_B), weight, lora_A, lora_B)


@pytest.mark.parametrize("ab", ["fp32", "half"])
@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_split_norm_strides_chunks_and_half_b(layout, ab):
    weight, lora_A, lora_B = _inputs(70, 130, 70, torch.bfloat16)
    a_dtype = torch.bfloat16 if ab == "half" else torch.float32
    lora_A = lora_A.to(a_dtype)
    if layout == "transposed":
        weight, lora_A, lora_B = (t.t().contiguous().t() for t in (weight, lora_A, lora_B.half()))
    else:
        weight = torch.zeros(70, 260, dtype=torch.bfloat16)[:, ::2].copy_(weight)
        lora_A = torch.zeros(140, 130, dtype=a_dtype)[1::2].copy_(lora_A)
        lora_B = torch.zeros(70, 75)[:, 3:73].copy_(lora_B)
    for cols in (None, 48):  # one chunk, and three column chunks of W and A
        _check(_split_norm(weight, lora_A, lora_B, cols=cols), weight, lora_A, lora_B)


def test_split_norm_support_rules():
    w, a, b = torch.empty(6, 8, dtype=torch.bfloat16), torch.empty(3, 8), torch.empty(6, 3)
    assert N.split_norm_supported(w, a, b) and N.split_norm_supported(w.half(), a, b.bfloat16())
    assert not N.split_norm_supported(w.float(), a, b)  # fp32 W: the PyTorch form
    assert N.split_norm_supported(w, a.bfloat16(), b.bfloat16())  # A in W's dtype: unsplit
    assert N.split_norm_supported(w.half(), a.half(), b.half())
    assert not N.split_norm_supported(w, a.half(), b)  # a half A of another dtype: the PyTorch form
    assert not N.split_norm_supported(w[:, :0], a[:, :0], b)  # nothing to multiply
    assert not N.split_norm_supported(w, a[:, :7], b)  # shapes that do not chain


@pytest.mark.parametrize("adapters,r", [("bf16", 16), ("bf16", 70), ("fp32", 16), ("fp32", 40)])
def test_auto_takes_the_kernel_up_to_its_ranks_and_the_split_norm_above(adapters, r, monkeypatch):
    """``factored_row_norm`` on auto: the one-pass kernel up to ``_KERNEL_MAX_RANK`` (half adapters of W's dtype) or
    ``_KERNEL_MAX_RANK_MIXED`` (fp32 adapters), the split norm's GEMMs above, whether or not a kept ``||W||²`` is
    given; either way within the fp64 reference's tolerance."""
    from peft.tuners.lora import dora, dora_norm

    dtype = torch.float32 if adapters == "fp32" else torch.bfloat16
    weight, lora_A, lora_B = _inputs(48, 96, r, torch.bfloat16, dtype)
    calls = []
    for name in ("row_norm_checked", "split_row_norm"):
        real = getattr(N, name)
        monkeypatch.setattr(N, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    unkept = dora.factored_row_norm(weight, lora_A, lora_B, SCALE)
    kept = dora.factored_row_norm(weight, lora_A, lora_B, SCALE, w_sq=dora_norm.row_sq_norm(weight))
    limit = dora_norm._KERNEL_MAX_RANK_MIXED if adapters == "fp32" else dora_norm._KERNEL_MAX_RANK
    assert calls == ["row_norm_checked" if r <= limit else "split_row_norm"] * 2
    assert dora_norm.w_sq_reusable(weight, lora_A, lora_B) == (r > limit)  # no ||W||² kept where the kernel runs
    _check(unkept, weight, lora_A, lora_B)
    _check(kept, weight, lora_A, lora_B)


@pytest.mark.parametrize("training", [False, True])
def test_layer_norm_launched_as_it_is_takes_the_kernel_to_the_eager_rank(training, monkeypatch):
    """A DoRA Linear's norm that is not a CUDA graph (here: CPU tensors; on GPUs ZeRO-3's and FSDP1's gathered weights,
    eval forwards, PEFT_DORA_NORM_GRAPH=0) is computed inside ``eager_norms``: half adapters of W's dtype above
    ``_KERNEL_MAX_RANK`` take the one-pass kernel up to ``_KERNEL_MAX_RANK_EAGER``, with no ``||W||²`` kept for it,
    and the norm is the fp64 reference's; outside (``factored_row_norm`` called directly) the split norm still runs."""
    from torch import nn

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import dora, dora_norm

    r = 70
    assert dora_norm._KERNEL_MAX_RANK < r <= dora_norm._KERNEL_MAX_RANK_EAGER
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(96, 48, bias=False)).to(torch.bfloat16)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], use_dora=True, init_lora_weights=False)
    model = get_peft_model(base, config).to(torch.bfloat16)
    model.train(training)
    layer = model.base_model.model[0]
    calls = []
    for name in ("row_norm_checked", "split_row_norm"):
        real = getattr(N, name)
        monkeypatch.setattr(N, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    with torch.set_grad_enabled(training):
        model(x)
    assert calls == ["row_norm_checked"], calls
    assert dora_norm._eager.depth == 0
    weight, lora_A, lora_B = layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    scale = layer.scaling["default"]
    with dora_norm.eager_norms():
        assert not dora_norm.w_sq_reusable(weight, lora_A, lora_B)  # the kernel reads W for ||W||² in its pass
    assert dora_norm.w_sq_reusable(weight, lora_A, lora_B)
    with torch.no_grad():
        got = layer.lora_magnitude_vector["default"].get_weight_norm(weight, lora_A, lora_B, scale)
        with dora_norm.eager_norms():
            eager = dora.factored_row_norm(weight, lora_A, lora_B, scale)
    assert calls == ["row_norm_checked", "split_row_norm", "row_norm_checked"], calls
    _check(eager, weight, lora_A, lora_B, scale)
    _check(got, weight, lora_A, lora_B, scale)
