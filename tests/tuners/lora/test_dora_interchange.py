"""Checkpoint interchange with upstream PEFT: a DoRA adapter saved by ours loads in a pure upstream install and gives
the same outputs, and the other way round.

Upstream runs in a subprocess from the pinned wheel installed with `pip install --no-deps --target`, put first on
PYTHONPATH so it shadows ours (the subprocess reports which `peft` it imported and we check it). Both sides build the
base models from the same source text (`MODELS`), so only the adapter files cross the process boundary.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dora_testing import assert_close
from safetensors import safe_open

import peft.tuners.lora.dora as our_dora
from tools import upstream


# Shared by both processes. `init_lora_weights=False` makes B non-zero, and the magnitude is scaled away from the
# weight norm it is initialised to, so the checkpoint's lora_A, lora_B and magnitude all change the output.
MODELS = r"""
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D
from peft import LoraConfig, PeftModel, get_peft_model


class Net(nn.Module):
    def __init__(self, layer, head_in):
        super().__init__()
        self.layer = layer
        self.head = nn.Linear(head_in, 5)

    def forward(self, x):
        return self.head(self.layer(x).flatten(1) if x.is_floating_point() and x.dim() > 3 else self.layer(x))


def build_base(kind):
    torch.manual_seed(0)
    if kind == "linear":
        return Net(nn.Linear(16, 24, bias=True), 24), torch.randn(3, 7, 16)
    if kind == "embedding":
        return Net(nn.Embedding(50, 16), 16), torch.randint(0, 50, (3, 7))
    if kind == "conv2d":
        return Net(nn.Conv2d(3, 6, 3, bias=True), 6 * 6 * 6), torch.randn(2, 3, 8, 8)
    if kind == "conv1d":
        return Net(nn.Conv1d(4, 6, 3, bias=True), 5), torch.randn(2, 4, 7)
    if kind == "conv3d":
        return Net(nn.Conv3d(2, 4, 2, bias=False), 4 * 3 * 3 * 3), torch.randn(2, 2, 4, 4, 4)
    if kind == "gpt2_conv1d":
        return Net(Conv1D(24, 16), 24), torch.randn(3, 7, 16)
    if kind == "linear_nf4":  # QDoRA: a bitsandbytes 4-bit base, quantized on the CPU from the seeded weights
        import bitsandbytes as bnb

        dense = nn.Linear(16, 24, bias=True).to(torch.bfloat16)
        layer = bnb.nn.Linear4bit(16, 24, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type="nf4")
        layer.bias = nn.Parameter(dense.bias.data.float(), requires_grad=False)
        layer.support_avx512bf16_for_cpu = False  # as on every CPU (bitsandbytes' repacking wants 32 | d_out)
        net = Net(layer.to("cpu"), 24)
        net.is_loaded_in_4bit = True  # how PEFT learns to dispatch to its bitsandbytes LoRA layer
        return net, torch.randn(3, 7, 16)
    raise ValueError(kind)


def make_adapter(kind):
    base, x = build_base(kind)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["layer"], use_dora=True, init_lora_weights=False,
                        fan_in_fan_out=kind == "gpt2_conv1d")
    torch.manual_seed(1)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_magnitude_vector" in name:
                param.mul_(1 + 0.3 * torch.randn_like(param))
    return model.eval(), x


def load_adapter(kind, path):
    base, x = build_base(kind)
    return PeftModel.from_pretrained(base, path).eval(), x


@torch.no_grad()
def output(model, x):
    return model(x)
"""

# The upstream side: `save` makes and saves adapters, `load` loads ours; both write their outputs.
UPSTREAM_SCRIPT = (
    MODELS
    + r"""
import json, sys
from pathlib import Path
import peft, peft.tuners.lora.dora as dora

mode, workdir, kinds = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
for kind in kinds:
    d = workdir / kind
    if mode == "save":
        model, x = make_adapter(kind)
        model.save_pretrained(d / "adapter")
        if kind != "linear_nf4":  # the adapted layer pickled whole (torch.save(module)), with its output
            torch.save(model.base_model.model.layer, d / "layer.pt")
            torch.save(output(model.base_model.model.layer, x), d / "upstream_layer_out.pt")
    else:
        model, x = load_adapter(kind, d / "adapter")
    torch.save(output(model, x), d / "upstream_out.pt")
print(json.dumps({"peft": peft.__file__, "dora": dora.__file__, "version": peft.__version__}))
"""
)

KINDS = ["linear", "embedding", "conv1d", "conv2d", "conv3d", "gpt2_conv1d", "linear_nf4"]
_models: dict = {}
exec(MODELS, _models)


@pytest.fixture(scope="session")
def upstream_env(tmp_path_factory):
    """Environment whose PYTHONPATH starts with a pure install of the pinned upstream wheel."""
    target = tmp_path_factory.mktemp("upstream_peft")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(upstream.wheel())]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    return target, env


def _run_upstream(upstream_env, mode: str, workdir: Path) -> None:
    target, env = upstream_env
    script = workdir / "upstream_side.py"
    script.write_text(UPSTREAM_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), mode, str(workdir), *KINDS],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    # It really was upstream: imported from the target dir, without our factored norm.
    assert Path(info["peft"]).resolve().is_relative_to(target.resolve()), info
    assert info["version"] == upstream.UPSTREAM_VERSION, info
    assert "factored_row_norm" not in Path(info["dora"]).read_text()


@pytest.fixture(scope="session")
def saved_by_ours(tmp_path_factory, upstream_env):
    workdir = tmp_path_factory.mktemp("saved_by_ours")
    for kind in KINDS:
        model, x = _models["make_adapter"](kind)
        model.save_pretrained(workdir / kind / "adapter")
        torch.save(_models["output"](model, x), workdir / kind / "ours_out.pt")
    _run_upstream(upstream_env, "load", workdir)
    return workdir


@pytest.fixture(scope="session")
def saved_by_upstream(tmp_path_factory, upstream_env):
    workdir = tmp_path_factory.mktemp("saved_by_upstream")
    for kind in KINDS:
        (workdir / kind).mkdir()
    _run_upstream(upstream_env, "save", workdir)
    return workdir


def _adapter_tensors(path: Path) -> dict:
    with safe_open(path / "adapter_model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_ours_is_under_test():
    assert hasattr(our_dora, "factored_row_norm"), our_dora.__file__
    assert "+dora." in importlib.metadata.version("peft")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_saved_by_ours_loads_in_upstream(saved_by_ours, kind):
    d = saved_by_ours / kind
    ours, theirs = torch.load(d / "ours_out.pt"), torch.load(d / "upstream_out.pt")
    assert ours.dtype == torch.float32
    assert_close(theirs, ours)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_saved_by_upstream_loads_in_ours(saved_by_upstream, kind):
    d = saved_by_upstream / kind
    model, x = _models["load_adapter"](kind, d / "adapter")
    assert any(isinstance(m, our_dora.DoraLinearLayer) for m in model.modules())
    assert_close(_models["output"](model, x), torch.load(d / "upstream_out.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_both_sides_write_the_same_checkpoint(saved_by_ours, saved_by_upstream, kind):
    ours = _adapter_tensors(saved_by_ours / kind / "adapter")
    theirs = _adapter_tensors(saved_by_upstream / kind / "adapter")
    assert any("lora_magnitude_vector" in k for k in ours)
    assert ours.keys() == theirs.keys()
    for key in ours:
        # Same seeds and init code on both sides: A and B agree exactly; the magnitude is each side's weight norm.
        if "lora_magnitude_vector" in key:
            # On a bitsandbytes base PEFT creates the adapters in the compute dtype (bf16) and upcasts them after the
            # magnitude's initialisation: upstream forms B·A and W + s·B·A in bf16 there, ours in fp32.
            assert_close(ours[key], theirs[key], dtype=torch.bfloat16 if kind == "linear_nf4" else None)
        else:
            assert torch.equal(ours[key], theirs[key]), key
    # auto_mapping names the module that defined the test's `Net` (exec'd here, __main__ there), not the adapter.
    ours_cfg, theirs_cfg = (
        json.loads((root / kind / "adapter" / "adapter_config.json").read_text())
        for root in (saved_by_ours, saved_by_upstream)
    )
    ours_cfg.pop("auto_mapping"), theirs_cfg.pop("auto_mapping")
    assert ours_cfg == theirs_cfg


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "linear_nf4"])
def test_whole_model_pickled_by_upstream_runs_in_ours(saved_by_upstream, kind):
    """``torch.save(module)`` under upstream, ``torch.load`` under ours: upstream's DoRA modules unpickle into ours
    without the attributes ours adds (``DoraLinearLayer.__setstate__`` fills them in) and give upstream's output."""
    layer = torch.load(saved_by_upstream / kind / "layer.pt", weights_only=False)
    assert type(layer.lora_magnitude_vector["default"]).__module__ == our_dora.__name__
    _, x = _models["build_base"](kind)
    assert_close(_models["output"](layer, x), torch.load(saved_by_upstream / kind / "upstream_layer_out.pt"))
    layer.train()
    layer(x).sum().backward()  # and trains on: a training forward keeps norms in what __setstate__ made


@pytest.mark.parametrize("kind", ["linear", "embedding", "conv2d", "gpt2_conv1d"])
def test_upstreams_norm_methods(kind):
    """Outside code calls upstream's ``get_weight_norm(weight, lora_weight, scaling)`` (positionally or by name) and
    ``get_lora_weight(lora_A, lora_B)`` on a DoRA module: ours answers both, with the norm its factored form gives."""
    model, _ = _models["make_adapter"](kind)
    layer = model.base_model.model.layer
    dora_layer, s = layer.lora_magnitude_vector["default"], layer.scaling["default"]
    weight = layer.get_base_layer().weight
    if kind == "embedding":
        a, b = layer.lora_embedding_A["default"].T, layer.lora_embedding_B["default"].T
        factors = (a.T, b.T)
    else:
        a, b = layer.lora_A["default"], layer.lora_B["default"]
        factors = (a.weight, b.weight)
    lora_weight = dora_layer.get_lora_weight(a, b)
    factored = dora_layer.get_weight_norm(weight, *factors, s)
    for dense in (dora_layer.get_weight_norm(weight, lora_weight, s),
                  dora_layer.get_weight_norm(weight=weight, lora_weight=lora_weight, scaling=s)):  # fmt: skip
        assert_close(dense.reshape(-1), factored.reshape(-1).to(dense.dtype))
