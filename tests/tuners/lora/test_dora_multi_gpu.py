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
    """Moves the activation to the next stage's device, as accelerate's hooks do for ``device_map`` models (``None``:
    stays where it is, for a model that is replicated whole)."""

    def __init__(self, device: str | None):
        super().__init__()
        self.device = device

    def forward(self, x):
        return x if self.device is None else x.to(self.device)


def _model(mode: str, hop: str | None):
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
    made afresh per forward. Four SGD steps on two halves of a batch against the same model on one GPU on the whole
    batch: the losses, each trained parameter's update and an eval forward agree to bf16 noise, and nothing the
    replicas keep is read across devices or steps. SGD, not Adam: its update is linear in the gradient, so the two
    runs' bf16 reduction orders stay at their noise, where Adam's sign-like first steps turn a near-zero gradient's
    noise into a whole step. The learning rate makes the largest first update 10 % of its parameter's scale. Measured
    on 2×H200: losses within 4e-4 (relative), updates of A and B within 2.5 %, of the magnitudes within 1 %."""
    torch.cuda.set_device(0)

    def model_of():  # no hop: each replica's activation stays on its own GPU
        return _place(_model(mode, None), "cuda:0", "cuda:0")

    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if mode == "autocast" else contextlib.nullcontext
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(4, 33, 640, generator=gen).to("cuda:0", torch.bfloat16) for _ in range(4)]
    runs, lrs = {}, {}
    for name, wrap in (("one", lambda m: m), ("dp", lambda m: nn.DataParallel(m, device_ids=[0, 1]))):
        model = model_of().train()
        net = wrap(model)
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        start = {n: p.detach().float().clone() for n, p in params.items()}
        losses = []
        for x in batches:
            for p in params.values():
                p.grad = None
            with ctx():
                loss = net(x).float().square().mean()
            loss.backward()
            with torch.no_grad():
                for n, p in params.items():
                    # one learning rate per parameter, set by the one-GPU run's first gradient, used by both runs
                    lrs.setdefault(n, 0.1 * p.abs().max().item() / p.grad.abs().max().item())
                    p.sub_(lrs[n] * p.grad)
            losses.append(loss.item())
        model.eval()
        with torch.no_grad(), ctx():
            infer = net(batches[0]).float().cpu()
        updates = {n: (p.detach().float() - start[n]).cpu() for n, p in params.items()}
        runs[name] = (losses, updates, infer)
    (l1, u1, i1), (l2, u2, i2) = runs["one"], runs["dp"]
    assert l1 == pytest.approx(l2, rel=3e-3), (l1, l2)
    assert u1.keys() == u2.keys() and any("magnitude" in n for n in u1)
    for n in u1:
        assert u1[n].norm() > 0, n  # every trained parameter moved
        err = ((u2[n] - u1[n]).norm() / u1[n].norm()).item()
        assert err <= (2.5e-2 if "magnitude" in n else 5e-2), (n, err)
    assert_close(i2, i1, dtype=torch.bfloat16)
