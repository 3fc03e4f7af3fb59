"""The factored row norm against an fp64 dense reference, its chunking, its memory and its edge cases."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peft.tuners.lora import dora
from peft.tuners.lora.dora import factored_conv_norm, factored_row_norm


def dense_norm_fp64(weight, lora_A, lora_B, scale):
    w = weight.double() + scale * (lora_B.double() @ lora_A.double())
    return torch.linalg.vector_norm(w, dim=1)


def make(d_out, d_in, r, dtype, seed=0, adapter_ratio=0.1):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(d_out, d_in, generator=gen) / d_in**0.5).to(dtype)
    lora_A = torch.randn(r, d_in, generator=gen) / d_in**0.5
    lora_B = torch.randn(d_out, r, generator=gen) * adapter_ratio / r**0.5
    return weight, lora_A, lora_B


# fp32 accumulation: the error against fp64 is a few fp32 ulps, whatever the weight's storage dtype.
NORM_RTOL = 2e-6


@pytest.mark.parametrize(
    "d_out,d_in,r",
    [(1, 1, 1), (123, 77, 8), (64, 3000, 64), (3000, 64, 16), (40, 14336, 384), (17, 2048, 768)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_fp64_dense(d_out, d_in, r, dtype):
    weight, lora_A, lora_B = make(d_out, d_in, r, dtype)
    scale = 2.0 / r**0.5
    got = factored_row_norm(weight, lora_A, lora_B, scale)
    ref = dense_norm_fp64(weight, lora_A, lora_B, scale)
    assert got.dtype == torch.float32 and got.shape == (d_out,)
    torch.testing.assert_close(got.double(), ref, rtol=NORM_RTOL, atol=0)


@pytest.mark.parametrize("chunk_bytes", [1, 64 * 4 * 200, 1 << 20, 1 << 40])
def test_chunking_does_not_change_the_result(chunk_bytes):
    weight, lora_A, lora_B = make(100, 1000, 32, torch.float32, seed=1)
    got = factored_row_norm(weight, lora_A, lora_B, 0.7, chunk_bytes=chunk_bytes)
    ref = dense_norm_fp64(weight, lora_A, lora_B, 0.7)
    torch.testing.assert_close(got.double(), ref, rtol=NORM_RTOL, atol=0)


def test_transposed_view_of_weight():
    # GPT-2 Conv1D stores W transposed; the norm takes the view without a copy.
    weight, lora_A, lora_B = make(50, 70, 4, torch.float32, seed=2)
    stored = weight.T.contiguous()
    got = factored_row_norm(stored.T, lora_A, lora_B, 1.5)
    torch.testing.assert_close(got.double(), dense_norm_fp64(weight, lora_A, lora_B, 1.5), rtol=NORM_RTOL, atol=0)


def test_shape_mismatch_is_a_clear_error():
    weight, lora_A, lora_B = make(10, 20, 4, torch.float32)
    with pytest.raises(ValueError, match="shapes do not chain"):
        factored_row_norm(weight, lora_A.T, lora_B, 1.0)


class RecordOps(TorchDispatchMode):
    """Records every ATen op that runs and the shape/bytes of what it returns."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        for o in outs:
            if isinstance(o, torch.Tensor):
                self.calls.append((func, tuple(o.shape), o.numel() * o.element_size()))
        return out


def test_zero_scale_skips_cross_and_gram():
    weight, lora_A, lora_B = make(30, 40, 8, torch.float32)
    with RecordOps() as rec:
        got = factored_row_norm(weight, lora_A, lora_B, 0.0)
    assert not [f for f, _, _ in rec.calls if "mm" in str(f)]
    torch.testing.assert_close(got, torch.linalg.vector_norm(weight, dim=1))


def test_transients_stay_within_the_chunk_budget():
    d_out, d_in, r = 256, 4096, 16
    weight, lora_A, lora_B = make(d_out, d_in, r, torch.bfloat16)
    budget = 256 * 1024  # 64 columns of fp32 W and A per chunk, well below a full fp32 copy of W (4 MiB)
    with RecordOps() as rec:
        factored_row_norm(weight, lora_A, lora_B, 0.5, chunk_bytes=budget)
    rank_sized = d_out * r * 4  # U = W·Aᵀ and B ⊙ U: rank-dependent, O(d_out·r), outside the chunk budget
    biggest = max(nbytes for _, shape, nbytes in rec.calls if shape != (d_out, r))
    assert biggest <= budget, biggest
    assert max(nbytes for _, _, nbytes in rec.calls) <= max(budget, rank_sized)


def test_default_budget_comes_from_the_environment(dora_env):
    dora_env("PEFT_DORA_NORM_CHUNK_MB", "16")
    assert dora.get_dora_norm_threshold_mb() == 16
    assert dora.get_dora_norm_threshold_bytes() == 16 << 20
    dora_env("PEFT_DORA_NORM_CHUNK_MB", None)
    assert dora.get_dora_norm_threshold_mb() == 256


def test_zero_row_gives_finite_scale():
    weight, lora_A, lora_B = make(8, 16, 2, torch.bfloat16)
    weight[3] = 0
    lora_B[3] = 0
    norm = factored_row_norm(weight, lora_A, lora_B, 1.0)
    assert norm[3] == 0
    g = dora.magnitude_scale(torch.ones(8), norm, weight.dtype)
    assert torch.isfinite(g).all() and g[3] == 1e6


def test_nan_propagates_to_its_row_only():
    weight, lora_A, lora_B = make(8, 16, 2, torch.float32)
    weight[5, 7] = float("nan")
    norm = factored_row_norm(weight, lora_A, lora_B, 1.0)
    assert torch.isnan(norm[5]) and torch.isfinite(torch.cat([norm[:5], norm[6:]])).all()


def test_inf_gives_inf_or_nan_not_a_finite_value():
    weight, lora_A, lora_B = make(8, 16, 2, torch.float32)
    weight[2, 0] = float("inf")
    norm = factored_row_norm(weight, lora_A, lora_B, 1.0)
    assert not torch.isfinite(norm[2])


@pytest.mark.parametrize("groups,r", [(1, 4), (2, 4), (4, 8)])
def test_conv_norm_matches_upstream_semantics(groups, r):
    # upstream's conv DoRA norm uses (B.view(-1, r) @ A.view(r, -1)).reshape(W.shape), also for groups > 1
    gen = torch.Generator().manual_seed(groups)
    weight = torch.randn(8, 12 // groups, 3, 3, generator=gen)
    lora_A = torch.randn(r, 12, 3, 3, generator=gen) * 0.1
    lora_B = torch.randn(8, r // groups, 1, 1, generator=gen) * 0.1
    dense = (lora_B.double().view(-1, r) @ lora_A.double().view(r, -1)).reshape(weight.shape)
    ref = torch.linalg.vector_norm((weight.double() + 0.5 * dense).reshape(8, -1), dim=1)
    got = factored_conv_norm(weight, lora_A, lora_B, 0.5)
    torch.testing.assert_close(got.double(), ref, rtol=NORM_RTOL, atol=0)


@pytest.mark.parametrize("value", ["2", "yes", "-1"])
def test_invalid_fused_env_value_is_a_clear_error(dora_env, value):
    dora_env("PEFT_DORA_FUSED", value)
    with pytest.raises(ValueError, match="PEFT_DORA_FUSED"):
        dora.dora_settings.current()


@pytest.mark.parametrize("name", ["PEFT_DORA_FUSED", "PEFT_DORA_FUSED_BACKWARD"])
@pytest.mark.parametrize("value,expected", [("1", True), ("TRUE", True), ("0", False), ("false", False), ("", None)])
def test_tristate_env_values(dora_env, name, value, expected):
    dora_env(name, value)
    env = dora.dora_settings.current()
    assert (env.fused if name == "PEFT_DORA_FUSED" else env.fused_backward) is expected


@pytest.mark.parametrize("bad", [15, 65537, 1.5, "64", True])
def test_set_norm_threshold_validates(bad):
    with pytest.raises(ValueError):
        dora.set_dora_norm_threshold_mb(bad)


def test_set_norm_threshold_round_trip(dora_env):
    dora_env("PEFT_DORA_NORM_CHUNK_MB", None)
    dora.set_dora_norm_threshold_mb(64)  # sets the variable itself; dora_env's teardown restores it
    assert dora.get_dora_norm_threshold_mb() == 64


@pytest.mark.parametrize("value", ["8", "abc", "70000"])
def test_invalid_chunk_env_is_a_clear_error(dora_env, value):
    dora_env("PEFT_DORA_NORM_CHUNK_MB", value)
    with pytest.raises(ValueError, match="PEFT_DORA_NORM_CHUNK_MB"):
        dora.get_dora_norm_threshold_mb()


def test_empty_input_dimension():
    norm = factored_row_norm(torch.zeros(3, 0), torch.zeros(2, 0), torch.ones(3, 2), 1.0)
    torch.testing.assert_close(norm, torch.zeros(3))


def test_launch_count_of_a_one_chunk_norm():
    # The norm's cost on real models is host time per launched op: keep it to a dozen for a single chunk.
    weight, lora_A, lora_B = make(64, 128, 8, torch.float32)
    with RecordOps() as rec:
        factored_row_norm(weight, lora_A, lora_B, 0.5)
    kernels = [str(f) for f, _, _ in rec.calls if not f.is_view]  # views launch nothing
    assert len(kernels) <= 12, kernels


def test_settings_override_outlives_a_reset_and_restores(dora_env):
    """``dora_settings.override``: the fields hold inside the block, also after the environment is re-read, and are
    gone after it; an unknown name is an error."""
    from peft.tuners.lora import dora_settings

    with dora_settings.override(decode_kernels=False):
        dora_env("PEFT_DORA_FUSED", "0")
        assert dora.dora_settings.current().decode_kernels is False and dora.dora_settings.current().fused is False
    assert dora.dora_settings.current().decode_kernels is True and dora.dora_settings.current().fused is False
    with pytest.raises(TypeError, match="bogus"):
        with dora_settings.override(bogus=1):
            pass
