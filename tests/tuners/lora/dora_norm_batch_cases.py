"""``PEFT_DORA_NORM_BATCH=1`` (``dora_batch``) under the Triton interpreter, where training forwards take the fused
training node that asks the batch for its norm; ``test_dora_norm_batch.py`` runs this file in a child process with
TRITON_INTERPRET=1. The first DoRA Linear of a device to ask in a forward pass computes the training norms of all of
them, the others take theirs. On a CPU the batch computes eagerly (a GPU replays one CUDA graph for all), so these
cases check what it hands out: the same norms, bitwise, as each layer computing its own, and never a norm older than
the pass or of other values (skipped layers, writes through ``.data`` between passes, in-place edits between the
leader's forward and a member's, members that come and go).

Run directly: TRITON_INTERPRET=1 python -m pytest tests/tuners/lora/dora_norm_batch_cases.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora, dora_fused


if not dora_fused.kernels_available(torch.empty(0)):
    raise RuntimeError("dora_norm_batch_cases.py needs TRITON_INTERPRET=1 set before peft is imported")


class Chain(nn.Module):
    def __init__(self, n: int = 4, d: int = 24):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(n))
        self.skip: set = set()
        self.checkpointed = False

    def _run(self, x):
        for i, layer in enumerate(self.layers):
            if i not in self.skip:
                x = torch.tanh(layer(x))
        return x

    def forward(self, x):
        return checkpoint(self._run, x, use_reentrant=False) if self.checkpointed else self._run(x)


def build(seed: int = 0):
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["layers.0", "layers.1", "layers.2", "layers.3"],
                        use_dora=True, init_lora_weights=False)  # fmt: skip
    model = get_peft_model(Chain(), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.1 * torch.rand_like(p))
    return model.train()


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def passes(model, n: int, seed: int, update, skips=lambda k: set()) -> torch.Tensor:
    """``n`` training passes (forward, backward, ``update(params)``), pass ``k`` leaving out the layers ``skips(k)``;
    their outputs, concatenated."""
    chain, params = model.get_base_model(), trainable(model)
    gen = torch.Generator().manual_seed(seed)
    outs = []
    for k in range(n):
        chain.skip = skips(k)
        y = model(torch.randn(4, 24, generator=gen))
        y.square().mean().backward()
        update(params)
        outs.append(y.detach())
    return torch.cat(outs)


def optimizer_update(params, kind=torch.optim.AdamW):
    opt = kind(params, lr=1e-2)

    def update(_params):
        opt.step()
        opt.zero_grad()

    return update


def assert_batched_as_alone(dora_env, steps) -> None:
    """``steps(model)`` (a fresh model, the same seed) gives bitwise the same with the batch on as off, and the batch
    handed out norms."""
    results, batched = [], []
    for batch in (False, True):
        dora_env("PEFT_DORA_NORM_BATCH", "1" if batch else None)
        dora.norm_counts.clear()
        dora.tier_counts.clear()
        results.append(steps(build()))
        assert dora.tier_counts[dora.TIER_FUSED_BACKWARD] > 0, dict(dora.tier_counts)
        batched.append(dora.norm_counts.get("norm_batched", 0))
    assert batched[0] == 0 and batched[1] > 0, batched
    for ours, alone in zip(results[1], results[0]):
        assert torch.equal(ours, alone)


@pytest.mark.parametrize("checkpointed", (False, True))
def test_batch_trains_bitwise_as_each_layer_alone(dora_env, checkpointed):
    def steps(model):
        model.get_base_model().checkpointed = checkpointed
        params = trainable(model)
        out = passes(model, 5, 1, optimizer_update(params))
        return [out, *(p.detach().clone() for p in params)]

    assert_batched_as_alone(dora_env, steps)


def test_batch_never_stale_with_skipped_layers_and_data_writes(dora_env):
    """A hand-written optimizer writes through ``.data`` (no version counter moves, no optimizer hook runs) and the
    leader of the earlier passes is skipped in some: every member's norm must still be of its current values."""

    def data_writes(params):
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.data -= 0.05 * p.grad  # untracked: the norms must follow anyway
                p.grad = None

    def skips(k):
        return {0} if k % 3 == 2 else ({1, 3} if k % 3 == 1 and k > 2 else set())

    assert_batched_as_alone(dora_env, lambda model: [passes(model, 8, 2, data_writes, skips)])


def test_batch_member_edited_in_place_after_the_leader_computes_its_own(dora_env):
    """An in-place edit of a member's B after the leader's forward (a pre-hook on that member) moves its version: the
    member computes its own norm of the edited values, as without the batch."""

    def edit(module, args):
        with torch.no_grad():
            module.lora_B["default"].weight.mul_(1.01)

    def steps(model):
        model.base_model.model.layers[2].register_forward_pre_hook(edit)
        return [passes(model, 4, 3, optimizer_update(trainable(model), torch.optim.SGD))]

    assert_batched_as_alone(dora_env, steps)


def test_batch_follows_new_and_deleted_members(dora_env):
    """A second model on the same device joins the batch (the batch is dropped and built again), a deleted one
    leaves it; every pass of both trains as without the batch."""

    def steps(first):
        out = []
        for model in (first, build(5)):
            out.append(passes(model, 3, 4, optimizer_update(trainable(model))))
            del model
        return out

    assert_batched_as_alone(dora_env, steps)
