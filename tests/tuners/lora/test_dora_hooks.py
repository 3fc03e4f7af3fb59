"""Forward hooks on a DoRA Linear's ``lora_A`` / ``lora_B`` act as in upstream's DoRA: upstream computes the norm
from ``lora_B(lora_A(I))`` run through the modules, so a hook that changes their outputs changes the norm too (and
fires once for that call, before the input's). A hook that doubles ``lora_A``'s output is then the same adapter as
``lora_B`` doubled, in the output and in the magnitude's gradient, in training and in eval."""

import pytest
import torch
from dora_testing import assert_close
from test_dora_parity import build


def _layer(model):
    return model.base_model.model.lin0


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_hook_on_lora_A_acts_as_upstream(train, dropout):
    x = torch.randn(3, 5, 24)

    def run(hooked):
        model = build("linear", bias=True, dropout=dropout)
        model.train(train)
        layer = _layer(model)
        calls = []
        if hooked:
            layer.lora_A["default"].register_forward_hook(lambda m, i, o: (calls.append(i[0].shape), o * 2)[1])
        else:
            with torch.no_grad():
                layer.lora_B["default"].weight.mul_(2)
        torch.manual_seed(7)  # the same dropout mask
        out = model(x)
        out.square().mean().backward()
        return out, layer.lora_magnitude_vector["default"].weight.grad, calls

    out, grad, calls = run(hooked=True)
    out_b, grad_b, _ = run(hooked=False)
    assert_close(out, out_b)
    assert_close(grad, grad_b)
    assert calls[0] == (24, 24)  # the identity first, for the norm, as upstream's forward runs it
    assert calls[1][-1] == 24 and len(calls) == 2


def test_a_counting_hook_sees_upstreams_calls():
    """An observing hook (it returns nothing) fires for the norm's identity and for the input, as in upstream."""
    model = build("linear", bias=True, dropout=0.0)
    model.eval()
    seen = []
    for name in ("lora_A", "lora_B"):
        getattr(_layer(model), name)["default"].register_forward_hook(
            lambda m, i, o, name=name: seen.append((name, tuple(i[0].shape)))
        )
    with torch.no_grad():
        model(torch.randn(2, 24))
    assert seen == [("lora_A", (24, 24)), ("lora_B", (24, 4)), ("lora_A", (2, 24)), ("lora_B", (2, 4))]
