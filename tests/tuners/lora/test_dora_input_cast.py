"""A DoRA Linear casts its own input (``DoraLinearVariant.casts_own_input``, the overlay's one-line change to
upstream's ``layer.py``): under autocast without dropout it skips upstream's cast of x to the adapters' fp32 and
autocast's cast back, an exact round trip, so outputs and gradients are bitwise those of the cast path with two
ATen copies fewer per module in the forward; with dropout, or without autocast, it casts as upstream does."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora
from peft.tuners.lora.layer import Linear as LoraLinear


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _model(dropout: float):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16, bias=False)).to(torch.bfloat16)
    config = LoraConfig(r=4, target_modules=["0", "2"], use_dora=True, init_lora_weights=False, lora_dropout=dropout)
    model = get_peft_model(base, config)
    assert model.base_model.model[0].lora_A["default"].weight.dtype == torch.float32  # PEFT's autocast default
    return model


def _step(model, x, train: bool, autocast: bool):
    """(output, gradients by name, ATen copies) of one forward (and backward in training) under CPU autocast."""
    model.train(train)
    x = x.clone().requires_grad_(train)
    counter = _Count()
    torch.manual_seed(1)  # dropout's mask
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), counter:
        out = model(x)
        if train:
            out.float().square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if train:
        grads["x"] = x.grad.clone()
    model.zero_grad(set_to_none=True)
    return out.detach(), grads, counter.ops["aten._to_copy.default"]


@pytest.mark.parametrize("train", (False, True), ids=("eval", "train"))
@pytest.mark.parametrize("dropout", (0.0, 0.1))
@pytest.mark.parametrize("autocast", (True, False), ids=("autocast", "no_autocast"))
def test_own_cast_is_bitwise_upstreams_and_skips_the_round_trip(monkeypatch, train, dropout, autocast):
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    model = _model(dropout)
    if not autocast:  # without autocast upstream's cast is needed: adapters in x's dtype, as users run bf16 models
        model = model.to(torch.bfloat16)
    for _ in range(2):  # the second calls find every kept value
        ours = _step(model, x, train, autocast)
    monkeypatch.setattr(dora.DoraLinearVariant, "casts_own_input", False)  # upstream's layer.py casts
    for _ in range(2):
        theirs = _step(model, x, train, autocast)
    assert torch.equal(ours[0], theirs[0])
    assert ours[1].keys() == theirs[1].keys() and all(torch.equal(ours[1][k], theirs[1][k]) for k in ours[1])
    skipped = autocast and (dropout == 0.0 or not train)
    # two copies of x per adapted Linear in the forward (to fp32, back to bf16), and their backward's two
    assert theirs[2] - ours[2] == (2 * (2 if train else 1) * 2 if skipped else 0), (ours[2], theirs[2])


def test_other_lora_layers_still_cast():
    """A plain LoRA adapter on the same kind of layer keeps upstream's cast (the attribute is DoRA's variant's)."""
    assert not getattr(LoraLinear, "casts_own_input", False)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["0"], init_lora_weights=False))
    counter = _Count()
    with torch.autocast("cpu", dtype=torch.bfloat16), counter:
        model(torch.randn(2, 8, dtype=torch.bfloat16))
    seen = [k for k in counter.ops if "_to_copy" in k]
    assert seen and counter.ops["aten._to_copy.default"] >= 2  # x to fp32, and autocast's casts
