"""Several GPUs: DoRA layers on a CUDA device that is not the current one.

A model split over GPUs (``device_map="auto"``, pipeline stages) runs layers on cuda:1 while cuda:0 is current.
Triton launches, the decode plan's raw stream and the norm graphs' capture and replay act on the current device, so
these tests run the fused tiers there – training steps (the fused node, norm graphs captured and replayed), inference,
1-token decode steps (the decode plan and its direct launches) – and compare them with the same model on the current
device, and a model split over two GPUs with the same model on one.

Needs two CUDA devices (the device tool's ``nvidia-h200-x2``):
``pytest -m gpu tests/tuners/lora/test_dora_multi_gpu.py``.
"""

import contextlib

import pytest
import torch
from dora_testing import assert_close
from torch import nn

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


class ToDevice(nn.Module):
    """Moves the activation to the next stage's device, as accelerate's hooks do for ``device_map`` models."""

    def __init__(self, device: str):
        super().__init__()
        self.device = device

    def forward(self, x):
        return x.to(self.device)


def _model(mode: str, hop: str):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(640, 1536, bias=True), ToDevice(hop), nn.GELU(), nn.Linear(1536, 640, bias=False))
    config = LoraConfig(r=64, lora_alpha=32, target_modules=["0", "3"], use_dora=True, init_lora_weights=False)
    model = get_peft_model(base.to(torch.bfloat16), config, autocast_adapter_dtype=mode == "autocast")
    return model.to(torch.bfloat16) if mode == "bf16" else model


def _place(model, first: str, second: str):
    layers = model.base_model.model
    layers[0].to(first)
    layers[3].to(second)
    return model


def _run(model, first: str, mode: str) -> dict:
    """Two training steps (the second replays the norm graphs), an inference forward and four decode steps."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 33, 640, generator=gen).to(first, torch.bfloat16)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext
    model.train()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with ctx():
            y = model(x)
        y.float().square().mean().backward()
    out = {"train": y.detach()}
    out.update({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    model.eval()
    with torch.no_grad(), ctx():
        out["infer"] = model(x)
        out["decode"] = torch.cat([model(x[:1, t : t + 1]) for t in range(4)], dim=1)
    return {k: v.cpu() for k, v in out.items()}


def _tiers_of(fn) -> tuple:
    dora.tier_counts.clear()
    graphs = dict(dora.graph_counts)
    result = fn()
    replayed = dora.graph_counts["replayed"] - graphs.get("replayed", 0)
    return result, dict(dora.tier_counts), replayed


@pytest.mark.parametrize("mode", ("autocast", "bf16"))
@pytest.mark.parametrize("placement", ("both_on_1", "split_0_1"))
def test_layers_off_the_current_device_match_the_current_device(mode, placement):
    torch.cuda.set_device(0)
    want, want_tiers, want_replays = _tiers_of(
        lambda: _run(_place(_model(mode, "cuda:0"), "cuda:0", "cuda:0"), "cuda:0", mode)
    )
    first = "cuda:1" if placement == "both_on_1" else "cuda:0"
    model = _place(_model(mode, "cuda:1"), first, "cuda:1")
    got, got_tiers, got_replays = _tiers_of(lambda: _run(model, first, mode))
    assert torch.cuda.current_device() == 0  # the forward switched devices for its launches only
    # the same tiers ran (the fused node in training, the decode launches), and the norm graphs were replayed
    assert got_tiers == want_tiers and got_replays == want_replays > 0, (got_tiers, got_replays)
    assert want_tiers.get(dora.TIER_DECODE, 0) > 0 and want_tiers.get(dora.TIER_FUSED_BACKWARD, 0) > 0, want_tiers
    assert got.keys() == want.keys()
    for key in want:
        assert_close(got[key], want[key])


@pytest.mark.parametrize("mode", ("autocast", "bf16"))
def test_data_parallel_replicas_train_as_one_gpu(mode):
    """``nn.DataParallel`` over two GPUs (what the transformers Trainer wraps a model in when it sees several GPUs and
    was not started by a launcher): each forward replicates the DoRA layers, whose replicas share the layers' own
    state (records, memos, norm graphs) and run in a thread per GPU at once, with the parameters as broadcast copies
    made afresh per forward. Four AdamW steps on two halves of a batch: the losses, the trained adapter and an eval
    forward equal the same model trained on one GPU on the whole batch (bf16 noise), and nothing the replicas keep
    is read across devices or steps (a stale norm would drift the trained magnitudes apart)."""
    torch.cuda.set_device(0)

    def model_of():
        return _place(_model(mode, "cuda:0"), "cuda:0", "cuda:0")

    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 33, 640, generator=gen).to("cuda:0", torch.bfloat16) for _ in range(4)]
    runs = {}
    for name, wrap in (("one", lambda m: m), ("dp", lambda m: nn.DataParallel(m, device_ids=[0, 1]))):
        model = model_of().train()
        net = wrap(model)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        losses = []
        for x in batches:
            opt.zero_grad(set_to_none=True)
            with ctx():
                loss = net(x).float().square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad(), ctx():
            infer = net(batches[0]).float().cpu()
        trained = {n: p.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
        runs[name] = (losses, trained, infer)
    (l1, t1, i1), (l2, t2, i2) = runs["one"], runs["dp"]
    assert l1 == pytest.approx(l2, rel=2e-2), (l1, l2)
    assert t1.keys() == t2.keys() and any("magnitude" in n for n in t1)
    for n in t1:
        assert_close(t2[n], t1[n])
    assert_close(i2, i1)
