"""DoRA on the quantizers that keep upstream's dequantization (``dequantize_module_weight``), on the CPU: HQQ
(``HQQLinear``, 4-bit) and torchao's weight subclasses (int8 weight-only, int8 dynamic, int4 as ``IntxWeightOnly``,
float8 weight-only), in fp32 and bf16.

Against upstream's DoRA (the in-process oracle, a deep copy of the same quantized model): training forward and
gradients with and without LoRA dropout, a second step after an optimizer update, the eval forward, a replaced base
weight never served a kept norm, the initial magnitude, HQQ's merge, and the adapter saved and loaded into a fresh
quantized model. Under TRITON_INTERPRET=1 (``test_fused_tiers_under_interpreter``) the fp32 cases run the fused tiers.

GPTQ, AWQ, AQLM and EETQ are not here: upstream PEFT 0.21.2's LoRA layers for them refuse DoRA (``... does not
support DoRA yet``), and so do ours (``test_dora_refused_as_upstream``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchao.quantization as ao
from dora_testing import (
    assert_close,
    assert_initial_magnitude_is_upstreams,
    perturb_magnitudes,
    to_upstream,
)
from hqq.core.quantize import BaseQuantizeConfig, HQQLinear
from torch import nn

from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import dora
from peft.tuners.lora.aqlm import AqlmLoraLinear
from peft.tuners.lora.awq import AwqLoraLinear
from peft.tuners.lora.dora_launch import INTERPRET
from peft.tuners.lora.gptq import GPTQLoraLinear
from peft.tuners.lora.hqq import HqqLoraLinear
from peft.tuners.lora.torchao import TorchaoLoraLinear


# TorchaoLoraLinear without transformers' quantizer config: "Forward and training will work, but `merge()` /
# `unmerge()` will raise an error."
pytestmark = pytest.mark.filterwarnings("ignore:.*merge\\(\\)` / `unmerge\\(\\)` will raise")


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin0 = nn.Linear(64, 96)
        self.lin1 = nn.Linear(96, 40)

    def forward(self, x):
        return self.lin1(torch.relu(self.lin0(x)))


def hqq_4bit(model: nn.Module, dtype: torch.dtype) -> None:
    config = BaseQuantizeConfig(nbits=4, group_size=32)
    with torch.no_grad():  # else HQQLinear's bias is a clone with a grad_fn, which deepcopy (the oracle) refuses
        for name in ("lin0", "lin1"):
            setattr(model, name, HQQLinear(getattr(model, name), config, compute_dtype=dtype, device="cpu"))


def torchao_with(config):
    def quantize(model: nn.Module, dtype: torch.dtype) -> None:
        ao.quantize_(model.to(dtype), config)

    return quantize


INT4_WEIGHT_ONLY = ao.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=ao.PerGroup(32))  # int4 on the CPU

# name: (quantize the MLP in place, dtype of the base layers and activations)
CASES = {
    "hqq4_fp32": (hqq_4bit, torch.float32),
    "hqq4_bf16": (hqq_4bit, torch.bfloat16),
    "ao_int8wo_fp32": (torchao_with(ao.Int8WeightOnlyConfig()), torch.float32),
    "ao_int8wo_bf16": (torchao_with(ao.Int8WeightOnlyConfig()), torch.bfloat16),
    "ao_int8dyn_fp32": (torchao_with(ao.Int8DynamicActivationInt8WeightConfig()), torch.float32),
    "ao_int4wo_fp32": (torchao_with(INT4_WEIGHT_ONLY), torch.float32),
    "ao_float8wo_bf16": (torchao_with(ao.Float8WeightOnlyConfig()), torch.bfloat16),
}


def quantized_mlp(case: str, seed: int = 0) -> nn.Module:
    quantize, dtype = CASES[case]
    torch.manual_seed(seed)
    model = MLP()
    quantize(model, dtype)
    return model


def adapted(case: str, dropout: float = 0.0) -> nn.Module:
    # init_lora_weights=False: a non-zero B, so the cross and Gram terms of the norm matter
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["lin0", "lin1"], use_dora=True, lora_dropout=dropout,
                        init_lora_weights=False)  # fmt: skip
    model = perturb_magnitudes(get_peft_model(quantized_mlp(case), config))
    lora_class = HqqLoraLinear if case.startswith("hqq") else TorchaoLoraLinear
    assert all(isinstance(model.base_model.model.get_submodule(n), lora_class) for n in ("lin0", "lin1"))
    return model


def inputs(case: str, seed: int = 1) -> torch.Tensor:
    return torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(seed)).to(CASES[case][1])


def step(model: nn.Module, x: torch.Tensor):
    """Output and gradients of the trainable parameters for a fixed cotangent; the same dropout masks on both sides."""
    torch.manual_seed(11)
    out = model(x)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out.float() * cot).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out.detach(), grads


def assert_matches(case, out, grads, out_up, grads_up):
    dtype = CASES[case][1]
    assert out.dtype == out_up.dtype
    assert_close(out, out_up, dtype=dtype)
    assert grads.keys() == grads_up.keys()
    assert sum("lora_magnitude_vector" in n for n in grads) == 2 and sum("lora_B" in n for n in grads) == 2
    for name, ref in grads_up.items():
        assert_close(grads[name], ref, dtype=dtype, scale=max(1.0, ref.abs().max().item()))


def dora_layers(model):
    return [m for m in model.modules() if isinstance(m, dora.DoraLinearLayer)]


# ---------------------------------------------------------------------------------------------------------------
# Against upstream's DoRA on the same quantized model.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dropout", (0.0, 0.1))
@pytest.mark.parametrize("case", CASES)
def test_training_matches_upstream(case, dropout):
    model = adapted(case, dropout).train()
    theirs = to_upstream(model)
    assert len(dora_layers(model)) == 2 and not dora_layers(theirs)  # the oracle runs upstream's layers
    x = inputs(case)
    dora.tier_counts.clear()
    out, grads = step(model, x)
    assert sum(dora.tier_counts.values()) == 2, dict(dora.tier_counts)
    if INTERPRET and dropout == 0.0 and CASES[case][1] == torch.float32:
        assert dora.tier_counts[dora.TIER_FUSED_BACKWARD] == 2, dict(dora.tier_counts)
    assert_matches(case, out, grads, *step(theirs, x))

    # a second step after the same update on both sides: nothing kept from the first step may be served stale
    for m, g in ((model, grads), (theirs, grads)):
        with torch.no_grad():
            for name, p in m.named_parameters():
                if p.requires_grad:
                    p -= 0.05 * g[name] / max(1.0, g[name].abs().max().item())
    assert_matches(case, *step(model, x), *step(theirs, x))


@pytest.mark.parametrize("dropout", (0.0, 0.1))
@pytest.mark.parametrize("case", CASES)
def test_eval_matches_upstream(case, dropout):
    model = adapted(case, dropout).eval()
    theirs = to_upstream(model).eval()
    x = inputs(case)
    with torch.no_grad():
        expected = theirs(x)
        first, second = model(x), model(x)
    assert_close(first, expected)
    assert_close(second, expected)


@pytest.mark.parametrize("case", ("hqq4_fp32", "ao_int8wo_fp32", "ao_int4wo_fp32"))
def test_replaced_base_weight_is_never_served_a_kept_norm(case):
    """Requantizing replaces the quantized weight (HQQ's merge swaps the whole HQQLinear): every kept value ends."""
    model = adapted(case).eval()
    x = inputs(case)
    other = quantized_mlp(case, seed=7)
    with torch.no_grad():
        before = model(x)
        model(x)
        layer = model.base_model.model.lin0
        if case.startswith("hqq"):
            layer.base_layer = other.lin0
        else:
            layer.base_layer.weight = other.lin0.weight
        after = model(x)
        expected = to_upstream(model)(x)
    assert not torch.allclose(before, after)
    assert_close(after, expected)


@pytest.mark.parametrize("case", CASES)
def test_initial_magnitude_is_upstreams(case):
    """The magnitude is the checkpoint's content: the same values and dtype as upstream's initialisation."""
    assert_initial_magnitude_is_upstreams(quantized_mlp(case).lin0, 64, 96)


@pytest.mark.parametrize("case", ("hqq4_fp32", "hqq4_bf16"))
def test_hqq_merge_and_unload_as_upstream(case):
    """HQQ's merge requantizes the merged weight: ours and upstream's quantize the same weight."""
    model = adapted(case).eval()
    theirs = to_upstream(model)
    x = inputs(case)
    with torch.no_grad():
        adapted_out = model(x)
        ours_merged = model.merge_and_unload()(x)
        theirs_merged = theirs.merge_and_unload()(x)
    assert_close(ours_merged, theirs_merged, scale=adapted_out.abs().max().item())


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: the adapter alone, loaded into a freshly quantized base.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ("hqq4_fp32", "hqq4_bf16", "ao_int8wo_bf16", "ao_int4wo_fp32"))
def test_saved_adapter_loads_into_a_fresh_quantized_model(case, tmp_path):
    model = adapted(case, dropout=0.1).eval()
    x = inputs(case)
    with torch.no_grad():
        expected = model(x)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(quantized_mlp(case), tmp_path).eval()
    saved = {n: p for n, p in model.named_parameters() if p.requires_grad}
    restored = dict(loaded.named_parameters())
    assert sum("lora_magnitude_vector" in n for n in saved) == 2
    for name, p in saved.items():
        assert torch.equal(restored[name], p), name
    with torch.no_grad():
        got = loaded(x)
        upstream = to_upstream(loaded)(x)
    assert_close(got, expected)
    assert_close(got, upstream)


@pytest.mark.skipif(INTERPRET, reason="this test starts the interpreter run itself")
def test_fused_tiers_under_interpreter():
    """The fp32 cases again with TRITON_INTERPRET=1, where training without dropout takes the fused backward tier
    (asserted above) and eval the small forward: the tiers a GPU runs on these bases."""
    pytest.importorskip("triton", reason="the fused kernels need Triton (pip install triton)")
    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_DORA_")}
    env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir",
           str(root), "-k", "(training or eval) and fp32 and not 0.1"]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# Quantizers whose LoRA layers refuse DoRA upstream.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lora_class", (GPTQLoraLinear, AwqLoraLinear, AqlmLoraLinear))
def test_dora_refused_as_upstream(lora_class):
    with pytest.raises(ValueError, match="does not support DoRA"):
        lora_class(nn.Linear(32, 32), "default", config=LoraConfig(r=4, use_dora=True), r=4, lora_alpha=8)
