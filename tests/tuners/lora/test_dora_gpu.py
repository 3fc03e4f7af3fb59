"""The fused tier on a CUDA GPU: kernels against their PyTorch twins on randomized shapes, dtypes, strides and
non-finite inputs; DoRA Linear gradients against fp64; d_mag determinism; torch.compile; fused vs eager tier.

Run on the GPU machine with ``pytest -m gpu``.
"""

import random

import pytest
import torch
from dora_testing import TOL, assert_close
from torch import nn

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora
from peft.tuners.lora import dora_dispatch as dispatch
from peft.tuners.lora import dora_fused as F


pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _random_case(seed):
    rng = random.Random(seed)
    dtype = rng.choice(DTYPES)
    tokens = rng.choice([0, 1, 2, 7, rng.randint(1, 300), rng.randint(300, 5000)])
    d_out = rng.choice([1, 5, 123, 130, 1000, 4095, 4096, 5000, rng.randint(1, 9000)])
    layout = rng.choice(["contiguous", "slice", "batched"])
    g_dtype = rng.choice([torch.float32, dtype])
    scale = rng.choice([0.0, 0.5, 2.0, rng.uniform(0.01, 4.0)])
    nonfinite = rng.random() < 0.2
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def act():
        if layout == "slice":  # a column window of a wider activation: row stride > d_out
            return torch.randn(tokens, d_out + 17, device="cuda", generator=gen).to(dtype)[:, 9 : 9 + d_out]
        if layout == "batched" and tokens % 2 == 0 and tokens > 0:
            return torch.randn(2, tokens // 2, d_out, device="cuda", generator=gen).to(dtype)
        return torch.randn(tokens, d_out, device="cuda", generator=gen).to(dtype)

    lora, base, d_out_t = act(), act(), act()
    base = base.reshape(lora.shape) if base.shape != lora.shape else base
    d_out_t = d_out_t.reshape(lora.shape) if d_out_t.shape != lora.shape else d_out_t
    g = (1 + 0.05 * torch.randn(d_out, device="cuda", generator=gen)).to(g_dtype)
    if rng.random() < 0.5:
        g = g.view(1, d_out)
    if nonfinite and lora.numel() > 3:
        for t, value in ((lora, float("nan")), (base, float("inf")), (d_out_t, float("-inf"))):
            row, col = rng.randrange(t.shape[-2]), rng.randrange(d_out)
            t.view(-1, t.shape[-2], d_out)[0, row, col] = value
    return lora, base, d_out_t, g, scale, dtype


@pytest.mark.parametrize("seed", range(200))
def test_random_kernels_match_twins(seed):
    lora, base, d_out_t, g, scale, dtype = _random_case(seed)
    if g.dim() > lora.dim():
        g = g.view(-1)
    assert dispatch.kernels_support(lora, base, g)
    want = F.compose_torch(lora, base, g, scale)
    got = F.fused_dora_compose(lora, base, g, scale, inplace=False)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_close(got, want, equal_nan=True)
    out, inner = F.fused_dora_forward_and_inner(lora, base, g, scale)
    out_ref, inner_ref = F._forward_and_inner_torch(lora, base, g, scale)
    assert_close(out, out_ref, equal_nan=True)
    assert_close(inner, inner_ref, equal_nan=True)
    grads = F._fused_backward(d_out_t, inner_ref, g, scale, True, True, True)
    grads_ref = F._backward_torch(d_out_t, inner_ref, g, scale, True, True, True)
    for a, b in zip(grads, grads_ref):
        assert a.shape == b.shape and a.dtype == b.dtype
    assert_close(grads[0], grads_ref[0], equal_nan=True)
    assert_close(grads[1], grads_ref[1], equal_nan=True)
    # d_mag sums up to thousands of products: both sum in fp32 in different orders; scale the tolerance by rows.
    rows = max(1, lora.numel() // max(1, lora.shape[-1]))
    assert_close(grads[2].float(), grads_ref[2].float(), dtype=g.dtype, scale=max(1.0, rows**0.5 / 4), equal_nan=True)
    before = lora.clone()
    in_place = F.fused_dora_compose(lora, base, g, scale, inplace=True)
    assert in_place.data_ptr() == lora.data_ptr()
    torch.testing.assert_close(in_place, got, rtol=0, atol=0, equal_nan=True)
    del before


def test_over_2_31_elements():
    """int64 offsets: the last rows of a > 2^31-element activation are written, and correctly."""
    d_out = 4096
    rows = (1 << 31) // d_out + 3
    gen = torch.Generator(device="cuda").manual_seed(0)
    lora = torch.randn(rows, d_out, device="cuda", dtype=torch.bfloat16, generator=gen)
    base = torch.randn(rows, d_out, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = 1 + 0.05 * torch.randn(d_out, device="cuda", generator=gen)
    out = torch.full_like(lora, float("nan"))
    F._compose_triton(lora, base, g, 0.5, out)
    for sl in (slice(0, 8), slice(rows - 8, rows), slice(rows // 2, rows // 2 + 8)):
        assert_close(out[sl], F.compose_torch(lora[sl], base[sl], g, 0.5))
    assert not out.isnan().any()
    d_lora, d_base, d_mag = F._fused_backward(base, lora, g, 0.5, True, True, True)
    tail = slice(rows - 8, rows)
    ref_tail = F._backward_torch(base[tail], lora[tail], g, 0.5, True, True, False)
    assert_close(d_lora[tail], ref_tail[0])
    assert_close(d_base[tail], ref_tail[1])
    ref_mag = torch.zeros(d_out, device="cuda", dtype=torch.float64)
    for c in range(0, rows, 1 << 16):
        ref_mag += (lora[c : c + (1 << 16)].double() * base[c : c + (1 << 16)].double()).sum(0)
    torch.testing.assert_close(d_mag.double(), ref_mag, rtol=1e-4, atol=1e-2 * rows**0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_d_mag_bitwise_deterministic(dtype):
    gen = torch.Generator(device="cuda").manual_seed(1)
    d_out_t = torch.randn(8192, 4100, device="cuda", dtype=dtype, generator=gen)
    inner = torch.randn(8192, 4100, device="cuda", dtype=dtype, generator=gen)
    g = 1 + 0.05 * torch.randn(4100, device="cuda", generator=gen)
    runs = [F._fused_backward(d_out_t, inner, g, 0.5, True, False, True)[2] for _ in range(5)]
    for r in runs[1:]:
        assert torch.equal(r.view(torch.int32), runs[0].view(torch.int32))


def _dora_linear(dtype, d_in=640, d_out=1000, r=16, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d_in, d_out), nn.GELU(), nn.Linear(d_out, 130))
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0", "2"], use_dora=True, lora_dropout=dropout,
                        init_lora_weights=False)  # fmt: skip
    return get_peft_model(model, config).to("cuda", dtype)


def _reference_fp64(layer, x, weights):
    """One DoRA Linear in fp64 from its definition: dense norm of W + s·B·A (detached), then the stable compose."""
    W, b = (t.detach().double() for t in (layer.base_layer.weight, layer.base_layer.bias))
    A, B, m = (
        t.detach().double().requires_grad_()
        for t in (layer.lora_A["default"].weight, layer.lora_B["default"].weight)
        + (layer.lora_magnitude_vector["default"].weight,)
    )
    s = layer.scaling["default"]
    g = m / (W + s * B @ A).norm(dim=1).detach()
    xd = x.double()
    base = xd @ W.T
    y = base + b + (g - 1) * base + g * (s * (xd @ A.T @ B.T))
    (y * weights).sum().backward()
    return {"lora_A": A.grad, "lora_B": B.grad, "lora_magnitude_vector": m.grad}


def _layer_grads(layer, x, weights):
    layer.zero_grad(set_to_none=True)
    (layer(x).double() * weights).sum().backward()
    return {"lora_A": layer.lora_A["default"].weight.grad, "lora_B": layer.lora_B["default"].weight.grad,
            "lora_magnitude_vector": layer.lora_magnitude_vector["default"].weight.grad}  # fmt: skip


@pytest.fixture
def fused_backward_forced(monkeypatch):
    monkeypatch.setenv("PEFT_DORA_FUSED_BACKWARD", "1")
    dora._invalidate_fused_cache()
    yield
    monkeypatch.delenv("PEFT_DORA_FUSED_BACKWARD")
    dora._invalidate_fused_cache()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("freeze_magnitude", [False, True])
def test_dora_linear_gradients_vs_fp64(dtype, freeze_magnitude, fused_backward_forced):
    layer = _dora_linear(dtype).get_base_model()[0]
    layer.lora_magnitude_vector["default"].weight.requires_grad_(not freeze_magnitude)
    x = torch.randn(4, 77, 640, device="cuda").to(dtype)
    weights = torch.randn(1000, device="cuda", dtype=torch.float64)
    dora.tier_counts.clear()
    fused = _layer_grads(layer, x, weights)
    assert dora.tier_counts[dora.TIER_FUSED_BACKWARD] == 1 and dora.tier_counts[dora.TIER_EAGER] == 0
    ref = _reference_fp64(layer, x, weights)
    # The same-dtype eager tier is the yardstick: the fused tier may err at most 2x as much (+ a small floor).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PEFT_DORA_FUSED", "0")
        dora._invalidate_fused_cache()
        eager = _layer_grads(layer, x, weights)
    dora._invalidate_fused_cache()
    assert (fused["lora_magnitude_vector"] is None) is freeze_magnitude
    for name, r in ref.items():
        if freeze_magnitude and name == "lora_magnitude_vector":
            continue
        err = ((fused[name].double() - r).norm() / r.norm()).item()
        eager_err = ((eager[name].double() - r).norm() / r.norm()).item()
        assert err <= 2 * eager_err + TOL[dtype][1] / 10, (name, err, eager_err)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_tiers_match_eager_tier(dtype):
    model = _dora_linear(dtype, seed=3)
    x = torch.randn(3, 50, 640, device="cuda", dtype=dtype)
    with torch.no_grad():
        dora.tier_counts.clear()
        fused = model(x)
        assert dora.tier_counts[dora.TIER_FUSED_FORWARD] == 2
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("PEFT_DORA_FUSED", "0")
            dora._invalidate_fused_cache()
            eager = model(x)
        dora._invalidate_fused_cache()
    assert_close(fused, eager)


@pytest.mark.parametrize("half", (torch.bfloat16, torch.float16), ids=str)
def test_fp32_adapters_beside_a_half_base_take_the_fused_tiers(half):
    """PEFT's default fp32 adapters on a half-precision model run without autocast (``dispatch.wider_branch``, a
    training loop of its own): a training step takes the fused backward tier and an eval forward the small tier
    (above its limit the one-pass kernel), where both took the eager tier before; the gradients err against fp64 at
    most 2x as much as the eager tier's (+ a small floor), the eval outputs are the eager tier's within the half
    dtype's tolerance."""
    torch.manual_seed(5)
    base = nn.Sequential(nn.Linear(640, 1000), nn.GELU(), nn.Linear(1000, 130)).to("cuda", half)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["0", "2"], use_dora=True, init_lora_weights=False)
    model = get_peft_model(base, config)
    layer = model.get_base_model()[0]
    assert layer.lora_A["default"].weight.dtype == torch.float32 and layer.base_layer.weight.dtype == half
    x = torch.randn(4, 77, 640, device="cuda").to(half)
    weights = torch.randn(1000, device="cuda", dtype=torch.float64)
    dora.tier_counts.clear()
    fused = _layer_grads(layer, x, weights)
    assert set(dora.tier_counts) == {dora.TIER_FUSED_BACKWARD}
    ref = _reference_fp64(layer, x, weights)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PEFT_DORA_FUSED", "0")
        dora._invalidate_fused_cache()
        eager = _layer_grads(layer, x, weights)
        with torch.no_grad():
            eager_eval = model.eval()(x)
    dora._invalidate_fused_cache()
    for name, r in ref.items():
        assert fused[name].dtype == torch.float32
        err = ((fused[name].double() - r).norm() / r.norm()).item()
        eager_err = ((eager[name].double() - r).norm() / r.norm()).item()
        assert err <= 2 * eager_err + TOL[half][1] / 10, (name, err, eager_err)
    for small_numel, tier in ((dispatch.SMALL_FORWARD_NUMEL, dora.TIER_SMALL_FORWARD), (0, dora.TIER_FUSED_FORWARD)):
        with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
            mp.setattr(dispatch, "SMALL_FORWARD_NUMEL", small_numel)
            dora._invalidate_fused_cache()
            dora.tier_counts.clear()
            fused_eval = model.train().eval()(x)
            assert set(dora.tier_counts) == {tier}
        dora._invalidate_fused_cache()
        assert fused_eval.dtype == eager_eval.dtype == half
        assert_close(fused_eval, eager_eval, dtype=half)


@pytest.mark.parametrize("fused", ("1", "0"))
def test_dropout_of_a_bf16_input_beside_fp32_adapters_keeps_w_in_bf16(fused, monkeypatch):
    """LoRA dropout (upstream's semantics) on a bf16 model with PEFT's default fp32 adapters, without autocast:
    ``W·dropout(x)`` is one bf16 matmul with an fp32 output (``torch.mm(..., out_dtype=torch.float32)``) of the
    dropped-out input taken back to bf16 (``dora_fused.DroppedHalfBase``), not an fp32 copy of W and an fp32 matmul:
    on the one-node tier where the fused tiers run, else the composition. Against fp64 of the same dropout mask the
    output and every gradient err at most 1.25x as much as the fp32 path's (+ a small floor)."""
    from dora_testing import dropout_reference_fp64, dropout_step, relative_error

    torch.manual_seed(7)
    base = nn.Sequential(nn.Linear(640, 1000)).to("cuda", torch.bfloat16)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["0"], use_dora=True, init_lora_weights=False,
                        lora_dropout=0.1)  # fmt: skip
    layer = get_peft_model(base, config).get_base_model()[0]
    assert layer.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(4, 77, 640, device="cuda").to(torch.bfloat16)
    weights = torch.randn(1000, device="cuda", dtype=torch.float64)
    monkeypatch.setenv("PEFT_DORA_FUSED", fused)
    dora._invalidate_fused_cache()
    runs = {}
    for devices in (("cuda",), ()):
        monkeypatch.setattr(F, "HALF_BASE_DEVICES", devices)
        dora.tier_counts.clear()
        runs[devices] = dropout_step(layer, x, weights)
        runs[devices]["tiers"] = set(dora.tier_counts)
    dora._invalidate_fused_cache()
    new, old = runs[("cuda",)], runs[()]
    assert (new["half_bases"], old["half_bases"]) == (1, 0) and torch.equal(new["dropped"], old["dropped"])
    assert new["tiers"] == {dora.TIER_FUSED_BACKWARD if fused == "1" else dora.TIER_EAGER}
    assert new["y"].dtype == new["dx"].dtype == torch.bfloat16
    ref = dropout_reference_fp64(layer, x, new["dropped"], weights)
    pairs = [("y", new["y"], old["y"], ref["y"]), ("dx", new["dx"], old["dx"], ref["dx"])]
    pairs += [(n, new["grads"][n], old["grads"][n], ref["grads"][n]) for n in ref["grads"]]
    for name, got, before, want in pairs:
        assert got.dtype == before.dtype
        err, old_err = relative_error(got, want), relative_error(before, want)
        assert err <= 1.25 * old_err + 1e-3, (name, err, old_err)


def _graph_breaks(module, x):
    torch._dynamo.reset()
    return torch._dynamo.explain(module)(x).graph_break_count


def test_torch_compile_fullgraph_without_dropout(fused_backward_forced):
    model = _dora_linear(torch.bfloat16, seed=4)
    x = torch.randn(2, 64, 640, device="cuda", dtype=torch.bfloat16)
    inner = model.get_base_model()
    assert _graph_breaks(inner, x) == 0
    torch._dynamo.reset()
    compiled = torch.compile(inner, fullgraph=True)
    out = compiled(x)
    out.float().sum().backward()
    grads = {n: p.grad.clone() for n, p in inner.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    eager = inner(x)
    eager.float().sum().backward()
    assert_close(out, eager)
    for n, p in inner.named_parameters():
        if p.grad is not None:  # bf16 matmul gradients: compare as a whole, elementwise cancellation is expected
            assert ((grads[n].float() - p.grad.float()).norm() / p.grad.float().norm()).item() < 1e-2, n


def test_torch_compile_graph_breaks_with_dropout():
    """Dropout takes the chunked path (base recomputed from the dropped-out x); count its graph breaks, and check the
    compiled model still computes what eager does (eval mode: dropout off, same code path)."""
    model = _dora_linear(torch.bfloat16, dropout=0.1, seed=5)
    x = torch.randn(2, 64, 640, device="cuda", dtype=torch.bfloat16)
    inner = model.get_base_model()
    breaks = _graph_breaks(inner, x)
    print(f"graph breaks with lora_dropout=0.1: {breaks}")
    inner.eval()
    with torch.no_grad():
        torch._dynamo.reset()
        assert_close(torch.compile(inner)(x), inner(x))


@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("mode", ("fp32", "bf16", "fp16", "autocast", "mixed"))
@pytest.mark.parametrize("tokens, d_in, rank, d_out", [(1, 4096, 384, 14336), (3, 14336, 768, 4096), (8, 1000, 7, 37)])
def test_decode_kernels_match_twin(tokens, d_in, rank, d_out, mode, bias):
    """The two decode launches against their PyTorch twin (cuBLAS matmuls in the compute dtype, the composition in
    fp32) at the model benchmark's shapes and odd ones: no further from fp64 than the twin (both round a and lora to
    the compute dtype; the GPU rounds to nearest), and equal to it within fp32 rounding in fp32. ``mixed``: fp32 x,
    A and B beside a bf16 result without autocast (PEFT's default adapters on a bf16 model), an fp32 output."""
    from peft.tuners.lora import dora_decode as Dd

    gen = torch.Generator(device="cuda").manual_seed(tokens + rank)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "autocast": torch.bfloat16,
             "mixed": torch.float32}[mode]  # fmt: skip
    factor_dtype = torch.float32 if mode == "autocast" else dtype

    def rand(*shape, div=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) / div).to(factor_dtype)

    x = rand(tokens, d_in + 8)[:, 8:]
    weight_a, weight_b = rand(rank, d_in, div=d_in**0.5), rand(d_out, rank, div=rank**0.5)
    result = torch.randn(tokens, d_out, device="cuda", generator=gen).to(torch.bfloat16 if mode == "mixed" else dtype)
    g = torch.rand(d_out, device="cuda", generator=gen) + 0.5
    factors = torch.stack((g, (1 - g) * torch.randn(d_out, device="cuda", generator=gen)) if bias else (g,))
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast"):
        layout = Dd.decode_layout(x, result, weight_a, weight_b)
        assert layout is not None
        out = Dd.decode_output(x, result, weight_a, weight_b, factors, 0.75, layout, bias)
        twin = Dd.decode_output_torch(x, result, weight_a, weight_b, factors, 0.75, bias)
    want = factors[0].double() * (result.double() + 0.75 * (x.double() @ weight_a.double().t() @ weight_b.double().t()))
    want = want + factors[1].double() if bias else want
    assert out.dtype == twin.dtype == torch.promote_types(dtype, result.dtype)
    if dtype == torch.float32:
        assert_close(out, twin, dtype=dtype)
    err, err_twin = (out.double() - want).abs().max(), (twin.double() - want).abs().max()
    assert err <= 1.5 * err_twin + 0.5 * want.abs().max() * torch.finfo(dtype).eps, (err, err_twin)


def test_decode_tier_in_generation_matches_matmul_path(dora_switches, monkeypatch):
    """A DoRA Linear in eval decodes one token through the two launches, with the same output as the matmul path
    (within the rounding of sums in another order), also on the next steps, whose launches go direct."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(512, 1024, bias=True)).cuda().to(torch.bfloat16)
    config = LoraConfig(r=64, lora_alpha=32, target_modules=["0"], use_dora=True, init_lora_weights=False)
    model = get_peft_model(base, config).to(torch.bfloat16).eval()
    x = torch.randn(1, 1, 512, device="cuda", dtype=torch.bfloat16)
    slot = model.base_model.model[0].lora_magnitude_vector["default"]._reuse
    with torch.no_grad():
        dora.tier_counts.clear()
        out = model(x)
        assert dora.tier_counts == {dora.TIER_DECODE: 1}
        plan = slot.decode
        assert plan.token_a is not None and plan.token_out is not None  # the next steps call the kernels directly
        x2 = torch.randn_like(x)
        again, out2 = model(x), model(x2)
        assert slot.decode is plan and torch.equal(again, out)
        dora_switches(decode_kernels=False)
        ref, ref2 = model(x), model(x2)
    assert_close(out, ref, dtype=torch.bfloat16)
    assert_close(out2, ref2, dtype=torch.bfloat16)


def test_decode_plan_follows_the_stream():
    """The plan's ``a`` buffer is reused in stream order: a decode step on another stream builds its own plan (and
    buffer), the first stream's plan is built again when it returns, and every output equals the one computed alone.
    Both streams run their steps back to back without synchronising in between."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 512, bias=False)).cuda().to(torch.bfloat16)
    config = LoraConfig(r=32, lora_alpha=16, target_modules=["0"], use_dora=True, init_lora_weights=False)
    model = get_peft_model(base, config).to(torch.bfloat16).eval()
    slot = model.base_model.model[0].lora_magnitude_vector["default"]._reuse
    xs = [torch.randn(1, 256, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    side = torch.cuda.Stream()
    with torch.no_grad():
        alone = [model(x).clone() for x in xs]
        plan = slot.decode
        outs = []
        side.wait_stream(torch.cuda.current_stream())
        for i, x in enumerate(xs):
            if i % 2:
                with torch.cuda.stream(side):
                    outs.append(model(x))
                assert slot.decode is not plan
            else:
                outs.append(model(x))
            plan = slot.decode
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    for out, want in zip(outs, alone):
        assert torch.equal(out, want)


@pytest.mark.parametrize("mode", ("fp32", "bf16", "fp16", "autocast"))
def test_small_tier_within_the_one_pass_kernels_error(mode, dora_switches, monkeypatch):
    """Eval without autograd, outputs the small tier takes (``F.linear(F.linear(x, A), s·g·B, (1 − g)·bias)`` and
    ``addcmul_(result, g)`` in the branch's dtype): its error against an fp64 reference of the same weights is at most
    twice the one-pass kernel's (the tier it replaced there) plus a floor, with and without a bias; s·g·B follows an
    in-place edit of B."""
    dora_switches(decode_kernels=False)
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(mode, torch.bfloat16)
    model = _dora_linear(torch.float32 if mode == "autocast" else dtype, d_in=640, d_out=1000, seed=3)
    model.base_model.model[2].base_layer.bias = None
    model.eval()
    x = torch.randn(4, 96, 640, device="cuda", dtype=torch.float32 if mode == "autocast" else dtype)

    def run(numel):
        monkeypatch.setattr(dispatch, "SMALL_FORWARD_NUMEL", numel)
        dora.tier_counts.clear()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast"):
            out = model(x)
        return out.double(), dict(dora.tier_counts)

    def reference():
        y = x.double()
        for i in (0, 2):
            layer = model.base_model.model[i]
            W, A, B = (t.detach().double() for t in (layer.base_layer.weight, layer.lora_A["default"].weight,
                                                     layer.lora_B["default"].weight))  # fmt: skip
            m, s = layer.lora_magnitude_vector["default"].weight.detach().double(), layer.scaling["default"]
            b = layer.base_layer.bias
            g = m / (W + s * B @ A).norm(dim=1)
            base = y @ W.T
            y = g * base + (0 if b is None else b.detach().double()) + g * s * (y @ A.T @ B.T)
            if i == 0:
                y = torch.nn.functional.gelu(y)
        return y

    for _ in range(2):
        small, tiers = run(1 << 62)
        assert tiers == {dora.TIER_SMALL_FORWARD: 2}
        kernel, tiers = run(0)
        assert tiers == {dora.TIER_FUSED_FORWARD: 2}
        want = reference()
        err_small = (small - want).abs().max().item()
        err_kernel = (kernel - want).abs().max().item()
        floor = {torch.float32: 1e-5, torch.float16: 2e-3}.get(dtype, 2e-2) * want.abs().max().item()
        assert err_small <= 2 * err_kernel + floor, (err_small, err_kernel)
        with torch.no_grad():
            model.base_model.model[0].lora_B["default"].weight.mul_(1.5)
