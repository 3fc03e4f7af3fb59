"""DoRA under ``torch.func`` transforms (``grad``, ``vmap``, through ``functional_call``): per-sample gradients,
functional training. Their wrapped tensors have no storage, so a memo's key or a kernel's pointer cannot be read;
the DoRA forward then takes upstream's path (``dora_settings.plain``: the norm computed afresh with PyTorch ops, the
composition eager) and gives what autograd gives without the transforms."""

import pytest
import torch
from dora_testing import assert_close
from test_dora_parity import build

from peft.tuners.lora import dora, dora_settings


def _loss_fn(model):
    def loss(params, *inputs):
        out = torch.func.functional_call(model, params, inputs)
        return out.float().square().mean()

    return loss


def _trainable(model):
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("kind", ["linear", "gpt2_conv1d", "embedding", "conv2d"])
def test_per_sample_gradients_equal_autograd(kind, train):
    model = build(kind, bias=True, dropout=0.0)
    model.train(train)
    inputs = model.get_base_model().inputs(torch.Generator().manual_seed(1))
    params = _trainable(model)
    loss = _loss_fn(model)

    grads = torch.func.grad(loss)(params, *inputs)  # the whole batch
    model.zero_grad()
    loss(dict(model.named_parameters()), *inputs).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert_close(grads[name], p.grad)

    # one gradient per sample (vmap over the batch), against a loop of autograd's
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None,) + (0,) * len(inputs))(
        params, *(x.unsqueeze(1) for x in inputs)
    )
    for i in range(inputs[0].shape[0]):
        model.zero_grad()
        loss(dict(model.named_parameters()), *(x[i : i + 1] for x in inputs)).backward()
        for name, p in model.named_parameters():
            if p.requires_grad:
                assert_close(per_sample[name][i], p.grad)
    assert dora_settings._plain[0] == 0  # the transforms' path ends with them


def test_reuse_resumes_after_the_transforms():
    """After a ``torch.func`` call the same model reuses its eval norm again, as before it."""
    model = build("linear", bias=True, dropout=0.0)
    model.eval()
    x = torch.randn(3, 5, 24)
    torch.func.grad(_loss_fn(model))(_trainable(model), x)
    with torch.no_grad():
        model(x)
        dora.norm_counts.clear()
        out = model(x)
    assert dora.norm_counts["norm_reused"] == 2 and dora.norm_counts["norm_computed"] == 0
    with torch.no_grad(), dora_settings.plain():
        assert_close(out, model(x), scale=0)
