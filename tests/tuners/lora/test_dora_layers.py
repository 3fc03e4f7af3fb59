"""Module-level DoRA behaviour beyond a single forward: merging, several adapters, mixed batches, caching, state."""

import warnings

import pytest
import torch
from dora_testing import assert_close, to_upstream
from test_dora_parity import build, inputs_for, run
from torch import nn

from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from peft.helpers import DoraCaching
from peft.tuners.lora import dora, dora_dispatch


MERGEABLE = ["linear", "gpt2_conv1d", "embedding", "scaled_embedding", "conv2d", "conv3d"]


def add_second_adapter(model, kind):
    targets = {
        "linear": ["lin0", "lin1"],
        "gpt2_conv1d": ["c_fc"],
        "embedding": ["emb", "lin"],
        "scaled_embedding": ["emb"],
        "conv2d": ["conv0", "conv1"],
        "conv3d": ["conv0"],
    }[kind]
    config = LoraConfig(
        target_modules=targets,
        use_dora=True,
        init_lora_weights=False,
        r=3,
        lora_alpha=5,
        fan_in_fan_out=kind == "gpt2_conv1d",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.add_adapter("other", config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector.other" in name:
                p.mul_(1 + 0.1 * torch.rand_like(p))


@pytest.mark.parametrize("kind", MERGEABLE)
@pytest.mark.parametrize("safe_merge", [False, True])
def test_merge_unmerge_matches_forward_and_upstream(kind, safe_merge):
    model = build(kind, bias=True, dropout=0.0).eval()
    theirs = to_upstream(model).eval()
    x = inputs_for(model, kind, torch.float32)
    with torch.no_grad():
        expected = model(*x)
        model.base_model.merge_adapter(safe_merge=safe_merge)
        theirs.base_model.merge_adapter(safe_merge=safe_merge)
        merged = model(*x)
        for (name, p), (_, q) in zip(model.named_parameters(), theirs.named_parameters()):
            if "base_layer.weight" in name:
                assert_close(p, q)
        model.base_model.unmerge_adapter()
        unmerged = model(*x)
    assert_close(merged, expected, scale=10)
    assert_close(unmerged, expected, scale=10)


@pytest.mark.parametrize("kind", MERGEABLE)
def test_two_active_adapters_match_upstream(kind):
    model = build(kind, bias=True, dropout=0.0)
    add_second_adapter(model, kind)
    model.base_model.set_adapter(["default", "other"])
    theirs = to_upstream(model)
    x = inputs_for(model, kind, torch.float32)
    out_o, grads_o = run(model, x)
    out_u, grads_u = run(theirs, x)
    assert_close(out_o, out_u)
    assert any(".other." in n for n in grads_o)
    for name in grads_o:
        assert_close(grads_o[name], grads_u[name], dtype=torch.float32, scale=10)


@pytest.mark.parametrize("kind", MERGEABLE)
def test_merging_two_adapters_matches_upstream(kind):
    model = build(kind, bias=True, dropout=0.0).eval()
    add_second_adapter(model, kind)
    theirs = to_upstream(model).eval()
    x = inputs_for(model, kind, torch.float32)
    with torch.no_grad():
        model.base_model.set_adapter(["default", "other"])
        theirs.base_model.set_adapter(["default", "other"])
        expected = model(*x)
        merged_o = model.merge_and_unload(adapter_names=["default", "other"])
        merged_u = theirs.merge_and_unload(adapter_names=["default", "other"])
        assert_close(merged_o(*x), merged_u(*x), scale=10)
        assert_close(merged_o(*x), expected, scale=10)


@pytest.mark.parametrize("kind", ["linear", "embedding", "conv2d"])
def test_mixed_adapter_batch_is_refused_like_upstream(kind):
    # Upstream 0.21.2 refuses `adapter_names` with DoRA adapters; a base-only batch still runs.
    model = build(kind, bias=True, dropout=0.0).eval()
    theirs = to_upstream(model).eval()
    x = inputs_for(model, kind, torch.float32)
    n = x[0].shape[0]
    with torch.no_grad():
        got = model(*x, adapter_names=["__base__"] * n)
        with model.disable_adapter():
            want = model(*x)
    assert_close(got, want, scale=0)
    for m in (model, theirs):
        with pytest.raises(ValueError, match="Cannot pass `adapter_names` when DoRA is enabled"):
            m(*x, adapter_names=["default"] * n)


def caches(model):
    return [m._dora_cache for m in model.modules() if isinstance(m, dora.DoraLinearLayer)]


@pytest.mark.parametrize("kind", ["linear", "embedding", "conv2d"])
def test_dora_caching(kind, dora_env):
    dora_env("PEFT_DORA_NORM_CACHE", "0")  # upstream's cache on its own (by default our eval reuse answers first)
    model = build(kind, bias=True, dropout=0.0)
    x = inputs_for(model, kind, torch.float32)
    model.eval()
    with torch.no_grad():
        expected = model(*x)
        assert caches(model) and not any(caches(model))
        with DoraCaching():
            first = model(*x)
            assert all(caches(model))
            # the cache holds a [d_out]-sized norm per adapter, never a dense weight-sized tensor
            for cache in caches(model):
                for value in cache.values():
                    assert value.numel() == value.shape[1] if value.dim() == 4 else value.dim() == 1
            second = model(*x)
        assert_close(first, expected, scale=0)
        assert_close(second, expected, scale=0)
        model(*x)
        assert not any(caches(model))
        model.train()
        with DoraCaching():
            model(*x)
            assert not any(caches(model))


@pytest.mark.parametrize("kind", ["linear", "embedding", "conv2d"])
def test_dora_caching_keeps_its_first_norm_as_upstream_after_plain_eval_forwards(kind):
    """With our eval reuse on (the default), an eval forward before ``DoraCaching`` keeps a norm; the first cached
    forward then found it and stored nothing in ``_dora_cache``, so after an in-place edit of B ours served the edited
    weights' norm where upstream's cache serves the first one until ``train()``: the same calls, other outputs."""
    from dora_testing import upstream_modules

    up_dora, _ = upstream_modules()
    model = build(kind, bias=True, dropout=0.0).eval()
    theirs = to_upstream(model)
    x = inputs_for(model, kind, torch.float32)
    with torch.no_grad():
        assert_close(model(*x), theirs(*x))  # plain eval forwards: ours keeps the norm
        up_dora.ENABLE_DORA_CACHING = True  # the oracle's own switch (DoraCaching sets ours)
        try:
            with DoraCaching():
                assert_close(model(*x), theirs(*x))
                assert all(caches(model))
                for m in (model, theirs):
                    for name, p in m.named_parameters():
                        if "lora_B" in name or "lora_embedding_B" in name:
                            p.mul_(1.7)
                edited_ours, edited_theirs = model(*x), theirs(*x)
        finally:
            up_dora.ENABLE_DORA_CACHING = False
        assert_close(edited_ours, edited_theirs)
        fresh = to_upstream(model)(*x)  # no cache: the edited weights' own norm
        assert (edited_ours - fresh).abs().max() > 1e-3  # the cached norm is the first one: it shows


def test_state_dict_keys_and_shapes_match_upstream():
    for kind in ["linear", "gpt2_conv1d", "embedding", "conv2d", "conv1d", "conv3d"]:
        model = build(kind, bias=True, dropout=0.0)
        theirs = to_upstream(model)
        sd_o, sd_u = get_peft_model_state_dict(model), get_peft_model_state_dict(theirs)
        assert sd_o.keys() == sd_u.keys()
        assert any("lora_magnitude_vector" in k for k in sd_o)
        for k in sd_o:
            assert sd_o[k].shape == sd_u[k].shape and sd_o[k].dtype == sd_u[k].dtype, k


def test_magnitude_init_matches_upstream_init():
    # Built by upstream's own update_layer on the same weights: same initial magnitude.
    from dora_testing import upstream_modules

    up_dora, _ = upstream_modules()
    torch.manual_seed(0)
    base = nn.Linear(33, 21)
    lora_A, lora_B = torch.randn(5, 33), torch.randn(21, 5) * 0.1
    ours, theirs = dora.DoraLinearLayer(False), up_dora.DoraLinearLayer(False)
    ours.update_layer(base_layer=base, lora_A=lora_A, lora_B=lora_B, scaling=0.8)
    theirs.update_layer(base_layer=base, lora_A=lora_A, lora_B=lora_B, scaling=0.8)
    assert ours.weight.shape == theirs.weight.shape and ours.weight.dtype == theirs.weight.dtype
    assert_close(ours.weight, theirs.weight)


class FakeQuantLinear(nn.Module):
    """A base layer that only exposes its weight through dequantize(), like HQQ's (detected by `W_q`)."""

    def __init__(self, linear):
        super().__init__()
        self.W_q = linear.weight.detach().clone().to(torch.bfloat16)  # pretend-quantized storage
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantize(self):
        return self.W_q.float()

    def forward(self, x):
        return nn.functional.linear(x, self.dequantize(), self.bias)


def test_dequantized_base_weight_is_used():
    torch.manual_seed(0)
    linear = nn.Linear(16, 12)
    quant = FakeQuantLinear(linear)
    layer = dora.DoraLinearLayer(fan_in_fan_out=False)
    lora_A, lora_B = nn.Linear(16, 4, bias=False), nn.Linear(4, 12, bias=False)
    nn.init.normal_(lora_B.weight, std=0.1)
    layer.update_layer(base_layer=quant, lora_A=lora_A.weight, lora_B=lora_B.weight, scaling=0.5)
    w = quant.dequantize().double()
    expected_norm = torch.linalg.vector_norm(w + 0.5 * lora_B.weight.double() @ lora_A.weight.double(), dim=1)
    torch.testing.assert_close(layer.weight.double(), expected_norm, rtol=2e-6, atol=0)
    x = torch.randn(3, 16)
    delta = layer(x, lora_A=lora_A, lora_B=lora_B, scaling=0.5, base_layer=quant, base_result=quant(x))
    ref = 0.5 * lora_B(lora_A(x))  # g == 1 right after init: the delta is plain LoRA
    assert_close(delta, ref)


def test_low_cpu_mem_usage_leaves_the_magnitude_on_meta():
    from peft import inject_adapter_in_model

    model = nn.Sequential(nn.Linear(16, 8), nn.Embedding(10, 8), nn.Conv2d(3, 4, 3))
    config = LoraConfig(target_modules=["0", "1", "2"], use_dora=True)
    inject_adapter_in_model(config, model, low_cpu_mem_usage=True)
    for module in (model[0], model[1], model[2]):
        magnitude = module.lora_magnitude_vector["default"].weight
        assert magnitude.device.type == "meta"
    assert model[0].lora_magnitude_vector["default"].weight.shape == (8,)
    assert model[2].lora_magnitude_vector["default"].weight.shape == (1, 4, 1, 1)


def _one_linear(use_dora=True):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 12))
    from peft import get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["0"], use_dora=use_dora, init_lora_weights=False)
    return get_peft_model(base, config)


def test_lora_branch_skips_module_calls_only_where_nothing_can_see_them(monkeypatch):
    """The LoRA branch runs as two F.linear calls for plain Linears; a hook, a wrapped forward, a global hook or a
    Linear subclass takes nn.Module's call (and sees it), with the same output either way."""
    model = _one_linear()
    layer = model.base_model.model[0]
    lora_A, lora_B = layer.lora_A["default"], layer.lora_B["default"]
    x = torch.randn(3, 16)
    assert dora._plain_linear(lora_A) and dora._plain_linear(lora_B)
    expected = lora_B(lora_A(x))
    direct = dora._lora_output(lora_A, lora_B, x)
    assert torch.equal(direct, expected)

    seen = []
    handle = lora_A.register_forward_hook(lambda mod, args, out: seen.append("hook"))
    assert not dora._plain_linear(lora_A)
    assert torch.equal(dora._lora_output(lora_A, lora_B, x), expected) and seen == ["hook"]
    layer(x)
    # the DoRA forward itself goes through the hook: for the norm's identity and for x, as upstream's does
    assert seen == ["hook", "hook", "hook"]
    handle.remove()

    original = lora_B.forward
    lora_B.forward = lambda inp: seen.append("wrapped") or original(inp)  # accelerate-style instance wrapper
    assert torch.equal(dora._lora_output(lora_A, lora_B, x), expected) and seen[-1] == "wrapped"
    del lora_B.forward

    handle = nn.modules.module.register_module_forward_pre_hook(lambda mod, args: seen.append("global"))
    try:
        assert not dora._plain_linear(lora_A)
        dora._lora_output(lora_A, lora_B, x)
        assert seen[-2:] == ["global", "global"]
    finally:
        handle.remove()
    assert dora._plain_linear(lora_A)

    class MyLinear(nn.Linear):
        pass

    assert not dora._plain_linear(MyLinear(2, 2))


def test_small_forward_matches_the_fused_composition_and_follows_a_new_magnitude(dora_switches, monkeypatch):
    """Eval-mode decode path (g·(result + s·lora) with cached g) against the eager composition, with and without a
    bias, and after the magnitude changes in place."""
    monkeypatch.setattr(dora_dispatch, "kernels_available", lambda t: True)  # the small path needs no kernel
    dora_switches(decode_kernels=False)  # (the decode launches do)
    for bias in (True, False):
        model = _one_linear()
        layer = model.base_model.model[0]
        if not bias:
            layer.base_layer.bias = None
        model.eval()
        x = torch.randn(1, 16)
        with torch.no_grad():
            monkeypatch.setenv("PEFT_DORA_FUSED", "0")
            dora._invalidate_fused_cache()
            expected = model(x)
            monkeypatch.delenv("PEFT_DORA_FUSED")
            dora._invalidate_fused_cache()
            dora.tier_counts.clear()
            got = model(x)
            assert dora.tier_counts[dora.TIER_SMALL_FORWARD] == 1
            assert_close(got, expected, torch.float32)
            layer.lora_magnitude_vector["default"].weight.mul_(1.5)
            monkeypatch.setenv("PEFT_DORA_FUSED", "0")
            dora._invalidate_fused_cache()
            expected = model(x)
            monkeypatch.delenv("PEFT_DORA_FUSED")
            dora._invalidate_fused_cache()
            assert_close(model(x), expected, torch.float32)
            assert dora.tier_counts[dora.TIER_SMALL_FORWARD] == 2


def test_forward_makes_its_tensors_device_current(monkeypatch):
    """A layer on cuda:1 while cuda:0 is current (a model split over GPUs): the variant's forward runs inside
    ``torch.cuda.device(1)`` and leaves cuda:0 current; on the current device or the CPU it enters no device context.
    (The GPU side, two real devices, is ``test_dora_multi_gpu.py``.)"""
    import contextlib

    current, entered, seen = [0], [], []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        previous, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = previous

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)

    class OnCuda:  # what the guard reads of a CUDA tensor
        is_cuda = True

        def __init__(self, index):
            self.index = index

        def get_device(self):
            return self.index

    def inner(module, adapter, x, result, **kwargs):
        seen.append(current[0])
        return adapter

    forward = dora._on_device_of_result(inner)
    assert forward(None, "a", None, OnCuda(1)) == "a" and seen == [1] and entered == [1] and current == [0]
    assert forward(None, "b", None, OnCuda(0)) == "b" and seen == [1, 0] and entered == [1]
    assert forward(None, "c", None, torch.zeros(1)) == "c" and seen == [1, 0, 0] and entered == [1]
    for variant in (dora.DoraLinearVariant, dora.DoraEmbeddingVariant, dora.DoraConv2dVariant):
        assert variant.forward.__wrapped__ is not None, variant


def test_summary_names_tiers_norms_and_why_eager(monkeypatch):
    """``dora.summary`` counts compositions per tier with their meaning, norms computed/reused and the model's modules
    by latest tier, and says why a CUDA machine ran eager where a setting is the reason."""
    torch.manual_seed(0)
    model = get_peft_model(nn.Sequential(nn.Linear(8, 8)), LoraConfig(r=2, use_dora=True, target_modules=["0"]))
    dora.tier_counts.clear()
    dora.norm_counts.clear()
    model(torch.randn(3, 8))
    text = dora.summary(model)
    assert "eager: 1  (PyTorch composition" in text
    assert "weight norms: 1 computed, 0 reused" in text
    assert "modules by latest tier: eager: 1" in text
    assert "because" not in text or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dora, "is_triton_available", lambda: False)
    assert "Triton is not installed" in dora.summary()


def test_dropout_path_under_autocast_makes_no_weight_sized_copy():
    """With LoRA dropout the base output of the dropped-out input is one matmul in autocast's dtype: the bf16 weight
    is not copied to the adapters' fp32 for it and cast back by autocast (two weight-sized copies per forward; the
    CPU norm's own fp32 copy of W is a different op and is allowed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 48))
    peft_model = get_peft_model(model, LoraConfig(target_modules=["0"], use_dora=True, lora_dropout=0.1, r=4))
    for name, p in peft_model.named_parameters():
        if "lora_" not in name:
            p.data = p.data.to(torch.bfloat16)

    class WeightCopies(TorchDispatchMode):
        copies: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and out.shape == (48, 64) and out.dtype == torch.bfloat16:
                self.copies.append(args[0].dtype)  # a weight-sized cast back into autocast's dtype
            return out

    x = torch.randn(5, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16), WeightCopies() as mode:
        peft_model(x).float().sum().backward()
    assert mode.copies == []


@pytest.mark.parametrize("bias", (False, True))
def test_branch_dropout_drops_the_lora_branch_input_only(dora_switches, bias):
    """PEFT_DORA_DROPOUT=branch: in training y = g·(W·x + s·B·A·drop(x)) + (1 − g)·bias, the dropout mask drawn once
    (fp64 reference with the same mask); no second base matmul, so the layer takes the no-dropout tiers. Eval mode is
    the same in both settings, and the default is upstream's semantics (the base output of the dropped-out input)."""
    torch.manual_seed(0)
    model = get_peft_model(
        nn.Sequential(nn.Linear(24, 40, bias=bias)),
        LoraConfig(target_modules=["0"], use_dora=True, lora_dropout=0.3, r=4, init_lora_weights=False),
    )
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_magnitude_vector["default"].weight.mul_(1 + 0.2 * torch.randn(40))
    x = torch.randn(6, 24)

    def reference(seed: int, exact: bool) -> torch.Tensor:
        torch.manual_seed(seed)
        xd = layer.lora_dropout["default"](x).double()
        w, b = layer.base_layer.weight.double(), layer.base_layer.bias
        a, bb = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
        s = layer.scaling["default"]
        norm = torch.linalg.vector_norm(w + s * bb @ a, dim=1)
        g = layer.lora_magnitude_vector["default"].weight.double() / norm
        base = x.double() @ w.T
        if exact:  # upstream: the DoRA delta sees the dropped-out input
            y = base + (g - 1) * (xd @ w.T) + g * s * (xd @ a.T @ bb.T)
        else:
            y = g * (base + s * (xd @ a.T @ bb.T))
        return y if b is None else y + b.double()

    model.train()
    torch.manual_seed(3)
    exact = model(x)
    assert_close(exact.double(), reference(3, exact=True), dtype=torch.float32)
    dora_switches(dropout="branch")
    dora.tier_counts.clear()
    torch.manual_seed(3)
    branch = model(x)
    assert_close(branch.double(), reference(3, exact=False), dtype=torch.float32)
    assert (branch - exact).abs().max() > 1e-3  # the two semantics differ in training
    assert set(dora.tier_counts) == {dora.TIER_EAGER}  # the no-dropout Linear path (CPU: its eager tier)
    branch.sum().backward()
    assert layer.lora_magnitude_vector["default"].weight.grad is not None
    model.eval()
    with torch.no_grad():
        evaluated = model(x)
    dora_switches(dropout="exact")
    with torch.no_grad():
        assert torch.equal(model(x), evaluated)


@pytest.mark.parametrize("dropout", (0.0, 0.3))
def test_fsdp1_route_calls_the_magnitude_module(monkeypatch, dropout):
    """Under FSDP1 units of their own (``dora_dist.fsdp1_unit``) a Linear's DoRA forward calls the magnitude module
    rather than its methods, with and without LoRA dropout: the same outputs and gradients as the direct route (the
    same dropout mask: same seed), and one module call per forward."""
    from peft.tuners.lora import dora_dist

    torch.manual_seed(0)
    model = get_peft_model(
        nn.Sequential(nn.Linear(24, 40, bias=True)),
        LoraConfig(target_modules=["0"], use_dora=True, lora_dropout=dropout, r=4, init_lora_weights=False),
    )
    layer = model.base_model.model[0]
    dora_layer = layer.lora_magnitude_vector["default"]
    x = torch.randn(6, 24)

    def step():
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        y = model(x)
        y.square().sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.train()
    direct_y, direct_g = step()
    calls = []
    dora_layer.register_forward_pre_hook(lambda *_: calls.append(1))
    monkeypatch.setattr(dora_dist, "fsdp1_unit", lambda module: module is dora_layer)
    fsdp1_y, fsdp1_g = step()
    assert calls == [1]
    assert_close(fsdp1_y, direct_y)
    assert sorted(fsdp1_g) == sorted(direct_g) and len(direct_g) == 3
    for name in direct_g:
        assert_close(fsdp1_g[name], direct_g[name])


def test_dropout_setting_rejects_unknown_values(monkeypatch):
    from peft.tuners.lora import dora_settings

    monkeypatch.setenv("PEFT_DORA_DROPOUT", "lora")
    dora_settings._invalidate_fused_cache()
    try:
        with pytest.raises(ValueError, match="PEFT_DORA_DROPOUT='lora' is not valid: use one of exact, branch"):
            dora_settings.current()
    finally:
        monkeypatch.delenv("PEFT_DORA_DROPOUT")
        dora_settings._invalidate_fused_cache()
