"""Our DoRA against upstream PEFT 0.21.2's own DoRA (loaded from the pinned wheel): outputs and gradients.

fp32: ours and upstream agree within the fp32 row of the tolerance table. bf16/fp16: both are compared with an
fp64 run of the same (rounded) weights, and ours must be at least as accurate as upstream's up to a factor 2 plus the
dtype's tolerance – the factored norm accumulates in fp32 where upstream rounds the dense sum to the half dtype.
"""

import copy
import warnings

import pytest
import torch
from dora_testing import TOL, assert_close, to_upstream
from torch import nn
from transformers.pytorch_utils import Conv1D

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora


class LinearModel(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.lin0 = nn.Linear(24, 40, bias=bias)
        self.lin1 = nn.Linear(40, 17, bias=bias)

    def forward(self, x):
        return self.lin1(torch.relu(self.lin0(x)))

    @staticmethod
    def inputs(gen):
        return (torch.randn(3, 5, 24, generator=gen),)


class GPT2Conv1DModel(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.c_fc = Conv1D(36, 20)  # (nf=out, nx=in), weight stored [in, out]; Conv1D always has a bias

    def forward(self, x):
        return self.c_fc(x)

    @staticmethod
    def inputs(gen):
        return (torch.randn(2, 7, 20, generator=gen),)


class ScaledEmbedding(nn.Embedding):
    """Like transformers' scaled word embeddings (e.g. Gemma's): the output is multiplied by ``embed_scale``."""

    def __init__(self, num, dim, embed_scale):
        super().__init__(num, dim)
        self.register_buffer("embed_scale", torch.tensor(embed_scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class EmbeddingModel(nn.Module):
    def __init__(self, bias=True, embed_scale=None):
        super().__init__()
        self.emb = nn.Embedding(30, 12) if embed_scale is None else ScaledEmbedding(30, 12, embed_scale)
        self.lin = nn.Linear(12, 9, bias=bias)

    def forward(self, ids):
        return self.lin(self.emb(ids))

    @staticmethod
    def inputs(gen):
        return (torch.randint(0, 30, (4, 6), generator=gen),)


class ConvModel(nn.Module):
    def __init__(self, dim, bias=True):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        self.dim = dim
        self.conv0 = conv(3, 6, 3, padding=1, bias=bias)
        self.conv1 = conv(6, 4, 1, bias=bias)

    def forward(self, x):
        return self.conv1(torch.relu(self.conv0(x)))

    def inputs(self, gen):
        return (torch.randn((2, 3) + (5,) * self.dim, generator=gen),)


MODELS = {
    "linear": (LinearModel, ["lin0", "lin1"]),
    "gpt2_conv1d": (GPT2Conv1DModel, ["c_fc"]),
    "embedding": (EmbeddingModel, ["emb", "lin"]),
    "scaled_embedding": (lambda bias: EmbeddingModel(bias, embed_scale=3.5), ["emb"]),
    "conv1d": (lambda bias: ConvModel(1, bias), ["conv0", "conv1"]),
    "conv2d": (lambda bias: ConvModel(2, bias), ["conv0", "conv1"]),
    "conv3d": (lambda bias: ConvModel(3, bias), ["conv0"]),
}


def build(kind, bias, dropout, seed=0, r=4):
    factory, targets = MODELS[kind]
    torch.manual_seed(seed)
    model = factory(bias)
    config = LoraConfig(
        target_modules=targets,
        use_dora=True,
        init_lora_weights=False,  # non-zero B, so the cross and Gram terms matter
        r=r,
        lora_alpha=2 * r,
        lora_dropout=dropout,
        fan_in_fan_out=kind == "gpt2_conv1d",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, config)
    # magnitudes away from the initial norm, so g differs from 1 as after training
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.rand_like(p))
    return peft_model


def run(model, inputs, seed=0):
    """Output and the gradients of every trainable parameter for a fixed random cotangent."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(*inputs)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(out.device)
    (out.double() * cot).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), grads


def inputs_for(model, kind, dtype):
    gen = torch.Generator().manual_seed(2)
    base = model.get_base_model()
    xs = base.inputs(gen)
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in xs)


KIND_BIAS = [(kind, bias) for kind in MODELS for bias in (True, False) if bias or kind != "gpt2_conv1d"]


@pytest.mark.parametrize("kind,bias", KIND_BIAS)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fp32_forward_and_gradients_match_upstream(kind, bias, dropout):
    ours = build(kind, bias, dropout)
    theirs = to_upstream(ours)
    ours.train()
    theirs.train()
    inputs = inputs_for(ours, kind, torch.float32)
    out_o, grads_o = run(ours, inputs)
    out_u, grads_u = run(theirs, inputs)
    assert_close(out_o, out_u)
    assert grads_o.keys() == grads_u.keys()
    assert any("lora_magnitude_vector" in n for n in grads_o)
    for name in grads_o:
        assert_close(grads_o[name], grads_u[name], dtype=torch.float32, scale=10)


def max_err(a, ref):
    return (a.double() - ref.double()).abs().max().item()


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_is_at_least_as_accurate_as_upstream(kind, dtype):
    ours = build(kind, bias=True, dropout=0.0).to(dtype)
    theirs = to_upstream(ours)
    reference = to_upstream(ours).double()  # same rounded weights, upstream's math in fp64
    inputs = inputs_for(ours, kind, dtype)
    out_o, grads_o = run(ours, inputs)
    out_u, grads_u = run(theirs, inputs)
    out_r, grads_r = run(reference, tuple(x.double() if x.is_floating_point() else x for x in inputs))
    atol = TOL[dtype][0]
    assert out_o.dtype == dtype
    assert max_err(out_o, out_r) <= 2 * max_err(out_u, out_r) + atol * out_r.abs().max().item()
    for name in grads_o:
        ref = grads_r[name]
        err_o, err_u = max_err(grads_o[name], ref), max_err(grads_u[name], ref)
        assert err_o <= 2 * err_u + atol * ref.abs().max().item(), (name, err_o, err_u)


def test_output_stays_in_activation_dtype_with_fp32_magnitude():
    # PEFT's default precision: bf16 base and activations, fp32 adapter weights (here: the magnitude).
    model = build("linear", bias=True, dropout=0.0)
    model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_magnitude_vector" in name:
            p.data = p.data.float()
    x = torch.randn(2, 3, 24, dtype=torch.bfloat16)
    out = model(x)
    assert out.dtype == torch.bfloat16


def test_no_dense_weight_sized_product_or_identity():
    """No op on the DoRA path returns a tensor as large as W (as B·A would be), and no eye() is built."""
    d_in, d_out = 96, 80  # tokens * d_out stays below d_out * d_in, so only a dense weight-sized op could reach it
    model = nn.Sequential(nn.Linear(d_in, d_out))
    config = LoraConfig(target_modules=["0"], use_dora=True, init_lora_weights=False, r=8)
    from test_dora_norm import RecordOps

    with RecordOps() as rec:
        peft_model = get_peft_model(model, config)
        x = torch.randn(1, 10, d_in)
        peft_model(x).sum().backward()
        peft_model.eval()
        with torch.no_grad():
            peft_model(x)
    ops = [str(f) for f, _, _ in rec.calls]
    assert ops, "the recorder saw nothing"
    assert not any("eye" in op for op in ops)
    weight_numel = d_in * d_out
    big = [(f, shape) for f, shape, nbytes in rec.calls if torch.Size(shape).numel() >= weight_numel]
    # the only weight-sized tensors allowed are the base layer's own parameters being created or initialised
    assert all("matmul" not in str(f) and "mm" not in str(f) for f, _ in big), big


def test_tier_is_observable_on_cpu():
    model = build("linear", bias=True, dropout=0.0)
    dora.tier_counts.clear()
    model(torch.randn(2, 24))
    assert dora.tier_counts[dora.TIER_EAGER] == 2
    assert sum(dora.tier_counts.values()) == 2


def test_forced_fused_on_cpu_raises(monkeypatch):
    model = build("linear", bias=True, dropout=0.0)
    monkeypatch.setenv("PEFT_DORA_FUSED", "1")
    dora._invalidate_fused_cache()
    try:
        with pytest.raises(RuntimeError, match="PEFT_DORA_FUSED=1"):
            model(torch.randn(2, 24))
    finally:
        monkeypatch.delenv("PEFT_DORA_FUSED")
        dora._invalidate_fused_cache()


def test_forced_eager_matches_default():
    model = build("linear", bias=True, dropout=0.0)
    x = torch.randn(2, 24)
    expected = model(x)
    import os

    os.environ["PEFT_DORA_FUSED"] = "0"
    dora._invalidate_fused_cache()
    try:
        dora.tier_counts.clear()
        got = model(x)
        assert dora.tier_counts[dora.TIER_EAGER] == 2
    finally:
        del os.environ["PEFT_DORA_FUSED"]
        dora._invalidate_fused_cache()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_dropout_path_chunks_output_columns(monkeypatch):
    # With a 1 MB forward budget and 40 output columns of 1.2 MB each... the dropout path composes column slices.
    model = build("linear", bias=True, dropout=0.3)
    theirs = to_upstream(model)
    x = torch.randn(4, 2048, 24)
    monkeypatch.setenv("PEFT_DORA_FWD_CHUNK_MB", "1")
    dora._invalidate_fused_cache()
    try:
        dora.tier_counts.clear()
        out_o, grads_o = run(model, (x,))
        assert dora.tier_counts[dora.TIER_EAGER] > 2  # lin0 alone was composed in several slices
    finally:
        monkeypatch.delenv("PEFT_DORA_FWD_CHUNK_MB")
        dora._invalidate_fused_cache()
    out_u, grads_u = run(theirs, (x,))
    assert_close(out_o, out_u)
    for name in grads_o:
        assert_close(grads_o[name], grads_u[name], dtype=torch.float32, scale=10)


def test_zero_tokens():
    model = build("linear", bias=True, dropout=0.0)
    out = model(torch.randn(0, 24))
    assert out.shape == (0, 17)
    copy.deepcopy(model)(torch.randn(2, 0, 24)).sum().backward()


@pytest.mark.parametrize(
    "kind, dropout", [("linear", 0.0), ("gpt2_conv1d", 0.0), ("embedding", 0.0), ("conv2d", 0.0), ("linear", 0.2)]
)
def test_autocast_mode_is_at_least_as_accurate_as_upstream(kind, dropout):
    # PEFT's default precision: bf16 base weights, fp32 adapters (incl. the magnitude), bf16 autocast; with dropout
    # the base output of the dropped-out input is computed by the matmul in autocast's dtype, as upstream's is.
    ours = build(kind, bias=True, dropout=dropout)
    for name, p in ours.named_parameters():
        if "lora_" not in name:
            p.data = p.data.to(torch.bfloat16)
    theirs = to_upstream(ours)
    reference = to_upstream(ours).double()
    inputs = inputs_for(ours, kind, torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_o, grads_o = run(ours, inputs)
        out_u, grads_u = run(theirs, inputs)
    out_r, grads_r = run(reference, tuple(x.double() if x.is_floating_point() else x for x in inputs))
    atol = TOL[torch.bfloat16][0]
    assert max_err(out_o, out_r) <= 2 * max_err(out_u, out_r) + atol * out_r.abs().max().item()
    for name in grads_o:
        assert grads_o[name].dtype == grads_u[name].dtype == torch.float32 or "lora_" not in name
        ref = grads_r[name]
        assert max_err(grads_o[name], ref) <= 2 * max_err(grads_u[name], ref) + atol * ref.abs().max().item(), name


@pytest.mark.parametrize("zero", (False, True), ids=("m_nonzero", "m_with_a_zero"))
@pytest.mark.parametrize("setup", ("fp16_model", "fp16_base_autocast"))
def test_fp16_branch_beyond_its_range_matches_upstream(setup, zero):
    """A LoRA branch whose ``s·lora`` leaves fp16's range (here ~8.2e4) while the output ``g·(W·x + s·B·A·x)`` does
    not (g divides by the large ‖W + s·B·A‖): upstream multiplies by g first in fp32 and stays finite; ours formed
    ``s·lora`` (and, with a zero in m, the saved ``inner = base + s·lora``) in fp16 and returned inf, or an inf
    magnitude gradient. Outputs and gradients in training and eval (a second eval forward reuses the factors) match
    upstream's and an fp64 reference, on the eager tiers and, under the interpreter, the fused ones."""
    torch.manual_seed(0)
    config = LoraConfig(target_modules=["0"], r=1, lora_alpha=256, use_dora=True, init_lora_weights=False)
    if setup == "fp16_model":
        model = get_peft_model(nn.Sequential(nn.Linear(16, 8)), config).half()
    else:
        model = get_peft_model(nn.Sequential(nn.Linear(16, 8).half()), config)  # PEFT keeps adapters fp32
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_A["default"].weight.fill_(1.0)
        layer.lora_B["default"].weight.fill_(20.0)  # x·Aᵀ = 16 for x = 1: lora = 320, s·lora ≈ 8.2e4
        layer.lora_magnitude_vector["default"].weight.fill_(1.0)
        if zero:
            layer.lora_magnitude_vector["default"].weight[-1] = 0.0
    theirs = to_upstream(model)
    x = torch.ones(2, 16, dtype=torch.float16)
    # fp64 reference, the norm a constant for autograd (as in both implementations)
    w = layer.base_layer.weight.double()
    params = (
        layer.lora_A["default"].weight,
        layer.lora_B["default"].weight,
        layer.lora_magnitude_vector["default"].weight,
    )
    a, b, m = (t.detach().double().requires_grad_() for t in params)
    v = w + layer.scaling["default"] * b @ a
    ref = x.double() @ (m[:, None] * v / v.norm(dim=1, keepdim=True).detach()).T + layer.base_layer.bias.double()
    ref.sum().backward()
    ref_grads = {"lora_A": a.grad, "lora_B": b.grad, "lora_magnitude_vector": m.grad}
    autocast = setup == "fp16_base_autocast"
    for train in (True, False, False):
        outs = []
        for net in (model, theirs):
            net.train(train)
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast), torch.set_grad_enabled(train):
                y = net(x)
            outs.append(y.detach().float())
            if train and net is model:
                y.float().sum().backward()
                grads = {n: p.grad.double() for n, p in net.named_parameters() if p.requires_grad}
                net.zero_grad()
        assert torch.isfinite(outs[0]).all(), (train, outs[0])
        torch.testing.assert_close(outs[0], outs[1], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(outs[0].double(), ref.detach(), rtol=4e-3, atol=4e-3)
        if train:  # against the reference: upstream's own magnitude gradient is inf in the fp16 model
            for name, grad in grads.items():
                expected = next(g for key, g in ref_grads.items() if key in name)
                torch.testing.assert_close(grad, expected, rtol=4e-3, atol=4e-3 * expected.abs().max(), msg=name)
