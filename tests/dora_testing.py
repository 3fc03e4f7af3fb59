"""Shared test helpers: upstream PEFT's own DoRA as an in-process oracle, and the tolerance table.

The oracle loads upstream's original ``dora.py`` and ``variants.py`` from the pinned wheel as private modules of the
installed package (everything else in upstream and ours is the same code), then swaps them into a copy of a model:
same weights, upstream's DoRA math.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch
from torch import nn


REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tools import upstream  # noqa: E402


# One tolerance table for every comparison: (atol, rtol) per dtype. Half precisions are judged against the error
# the same-dtype computation makes anyway; the numbers are a few ulps of the output scale.
TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (3e-2, 3e-2),
    torch.float16: (4e-3, 4e-3),
}


def run_under_interpreter(path: Path, *pytest_args: str) -> None:
    """pytest on ``path`` in a child process with TRITON_INTERPRET=1 (Triton fixes interpretation when a kernel is
    decorated, i.e. when peft is first imported) and no ``PEFT_DORA_*`` variable; it must pass and skip nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_DORA_")}
    env["TRITON_INTERPRET"] = "1"
    tests = Path(__file__).resolve().parent
    cmd = [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "--rootdir", str(tests), *pytest_args]  # fmt: skip
    proc = subprocess.run(cmd, env=env, cwd=tests, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def assert_close(actual, expected, dtype=None, scale=1.0, equal_nan=False):
    atol, rtol = TOL[dtype or expected.dtype]
    torch.testing.assert_close(
        actual, expected, atol=atol * scale, rtol=rtol * scale, check_dtype=False, equal_nan=equal_nan
    )


_ORACLE = {}


def upstream_modules():
    """(upstream dora module, upstream variants module), loaded from the pinned wheel once."""
    if _ORACLE:
        return _ORACLE["dora"], _ORACLE["variants"]
    with zipfile.ZipFile(upstream.wheel()) as zf:
        dora_src = zf.read("peft/tuners/lora/dora.py").decode()
        variants_src = zf.read("peft/tuners/lora/variants.py").decode()
    variants_src = variants_src.replace("from .dora import", "from ._upstream_dora import")
    for name, src in (("_upstream_dora", dora_src), ("_upstream_variants", variants_src)):
        full = f"peft.tuners.lora.{name}"
        spec = importlib.util.spec_from_loader(full, loader=None)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = "peft.tuners.lora"
        sys.modules[full] = mod
        exec(compile(src, f"<upstream {name}>", "exec"), mod.__dict__)
        _ORACLE[name.removeprefix("_upstream_")] = mod
    return _ORACLE["dora"], _ORACLE["variants"]


def to_upstream(model: nn.Module) -> nn.Module:
    """A deep copy of a PEFT model whose DoRA variants and magnitude layers are upstream's, same weights."""
    up_dora, up_variants = upstream_modules()
    clone = copy.deepcopy(model)
    for module in clone.modules():
        variants = getattr(module, "lora_variant", None)
        if not variants:
            continue
        for name, variant in list(variants.items()):
            variants[name] = getattr(up_variants, type(variant).__name__)()
            ours = module.lora_magnitude_vector[name]
            theirs = getattr(up_dora, type(ours).__name__)(fan_in_fan_out=ours.fan_in_fan_out)
            theirs.weight = nn.Parameter(ours.weight.detach().clone(), requires_grad=ours.weight.requires_grad)
            theirs.train(ours.training)
            module.lora_magnitude_vector[name] = theirs
    return clone


@torch.no_grad()
def perturb_magnitudes(model: nn.Module, spread: float = 0.3) -> nn.Module:
    """Every DoRA magnitude scaled by ``1 + spread·N(0, 1)``: away from the norm it is initialised to, as after
    training, so that a wrong norm or magnitude changes the output."""
    for name, param in model.named_parameters():
        if "lora_magnitude_vector" in name:
            param.mul_(1 + spread * torch.randn_like(param))
    return model


def assert_initial_magnitude_is_upstreams(base_layer: nn.Module, d_in: int, d_out: int) -> None:
    """The magnitude is the checkpoint's content: ``update_layer`` on ``base_layer`` with seeded A [8, d_in] and
    B [d_out, 8] gives ours the same values and dtype as upstream's initialisation."""
    from peft.tuners.lora import dora

    up_dora, _ = upstream_modules()
    torch.manual_seed(0)
    lora_A, lora_B = torch.randn(8, d_in) * 0.1, torch.randn(d_out, 8) * 0.1
    ours, theirs = dora.DoraLinearLayer(False), up_dora.DoraLinearLayer(False)
    ours.update_layer(base_layer=base_layer, lora_A=lora_A, lora_B=lora_B, scaling=2.0)
    theirs.update_layer(base_layer=base_layer, lora_A=lora_A, lora_B=lora_B, scaling=2.0)
    assert ours.weight.dtype == theirs.weight.dtype
    assert_close(ours.weight, theirs.weight)


def bnb_linear(kind: str, d_in: int, d_out: int, bias: bool = False, seed: int = 0, device: str = "cpu") -> nn.Module:
    """A bitsandbytes Linear of ``kind`` (``nf4`` with double quantization, ``fp4``, ``int8``), quantized on
    ``device`` from a seeded bf16 Linear; the bias (if any) stays fp32."""
    import bitsandbytes as bnb

    torch.manual_seed(seed)
    dense = nn.Linear(d_in, d_out, bias=bias).to(torch.bfloat16)
    if kind == "int8":
        layer = bnb.nn.Linear8bitLt(d_in, d_out, bias=bias, has_fp16_weights=False)
        layer.weight = bnb.nn.Int8Params(dense.weight.data, requires_grad=False, has_fp16_weights=False)
    else:
        nested = kind == "nf4"
        layer = bnb.nn.Linear4bit(d_in, d_out, bias=bias, compute_dtype=torch.bfloat16, quant_type=kind,
                                  compress_statistics=nested)  # fmt: skip
        layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, quant_type=kind,
                                         compress_statistics=nested)  # fmt: skip
        # the same layout on every CPU: bitsandbytes repacks 4-bit weights in place in CPU inference where the CPU has
        # AVX512-BF16 (test_dora_quant.py's cpu_repacked tests), and only for d_out a multiple of 32
        layer.support_avx512bf16_for_cpu = False
    if bias:
        layer.bias = nn.Parameter(dense.bias.data.float(), requires_grad=False)
    return layer.to(device)


def edit_scales_in_place(base_layer: nn.Module) -> None:
    """Change a bitsandbytes layer's quantization scales in place (its W with them): the blocks' scales of a 4-bit
    weight (nested: their uint8 codes) or LLM.int8's row scales, the tensors DoRA's kept ``||W||²`` is keyed on."""
    from peft.tuners.lora import dora_quant

    weight = base_layer.weight
    scales = dora_quant.QuantizedWeight(base_layer, weight, dora_quant.quantized_kind(weight)).sources[1]
    with torch.no_grad():
        scales.add_(1) if scales.dtype == torch.uint8 else scales.mul_(1.25)


class BnbNet(nn.Module):
    """Two bitsandbytes projections (``dims`` = in, middle, out) with an fp32 LayerNorm between them: the QLoRA
    recipe's fp32 hidden states in small."""

    def __init__(self, kind: str, dims=(64, 96, 40), bias: bool = False, device: str = "cpu"):
        super().__init__()
        d_in, d_mid, d_out = dims
        self.up = bnb_linear(kind, d_in, d_mid, bias=bias, seed=1, device=device)
        self.norm = nn.LayerNorm(d_mid, device=device)
        self.down = bnb_linear(kind, d_mid, d_out, bias=bias, seed=2, device=device)
        self.is_loaded_in_4bit = kind != "int8"  # how PEFT learns to dispatch to its bitsandbytes LoRA layers
        self.is_loaded_in_8bit = kind == "int8"

    def forward(self, x):
        return self.down(self.norm(self.up(x)))


class StandInNormGraph:
    """A captured norm graph on the CPU (CUDA graphs need a GPU) for a layer's record (``dora_norm.eager_record``):
    ``replay`` writes the norm of the tensors' current values (with ``w_sq`` as the kept ``||W||²``, which it then
    reads too) into its one output buffer behind the buffer's version counter, as a replay reads the captured
    addresses; ``inference``: captured under torch.inference_mode, so the buffer is an inference tensor."""

    def __init__(self, weight, lora_A, lora_B, scaling, w_sq=None, inference=False):
        import weakref

        self.args, self.w_sq, self.replays = (weight, lora_A, lora_B, scaling), w_sq, 0
        self.graph, self.failed = self, False
        tensors = (weight, lora_A, lora_B) if w_sq is None else (weight, lora_A, lora_B, w_sq)
        self.refs = tuple(weakref.ref(t) for t in tensors)
        with torch.inference_mode(inference):
            self.out = torch.empty(weight.shape[0])
        self.written = [None]  # the input versions of out's last write, as a NormGraph keeps them

    def replay(self):
        from peft.tuners.lora.dora_norm import factored_row_norm

        self.replays += 1
        norm = factored_row_norm(*self.args, w_sq=self.w_sq)
        if self.out.is_inference():
            with torch.inference_mode():
                self.out.copy_(norm)
        else:
            self.out.data.copy_(norm)


def dropout_step(layer: nn.Module, x: torch.Tensor, weights: torch.Tensor, seed: int = 7) -> dict:
    """One training step of a DoRA LoRA Linear with LoRA dropout: its output, its input's gradient and the adapter's
    gradients, the dropped-out input its ``lora_dropout`` module returned (``dropped``), and how many times
    ``dora_fused.DroppedHalfBase`` ran (``half_bases``). The loss is ``sum(y·weights)``."""
    from peft.tuners.lora import dora_fused

    seen, calls = [], []
    handle = layer.lora_dropout["default"].register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    original = dora_fused.DroppedHalfBase.forward

    def counted(*args):
        calls.append(1)
        return original(*args)

    dora_fused.DroppedHalfBase.forward = staticmethod(counted)
    try:
        layer.train().zero_grad(set_to_none=True)
        x = x.detach().requires_grad_()
        torch.manual_seed(seed)
        y = layer(x)
        (y.double() * weights).sum().backward()
    finally:
        handle.remove()
        dora_fused.DroppedHalfBase.forward = staticmethod(original)
    grads = {
        name: getattr(layer, name)["default"].weight.grad for name in ("lora_A", "lora_B", "lora_magnitude_vector")
    }
    return {"y": y.detach(), "dx": x.grad, "grads": grads, "dropped": seen[-1], "half_bases": len(calls)}


def dropout_reference_fp64(layer: nn.Module, x: torch.Tensor, dropped: torch.Tensor, weights: torch.Tensor) -> dict:
    """:func:`dropout_step`'s output and gradients in fp64 from DoRA's definition under upstream's dropout semantics
    (``y = W·x + b + (g - 1)·W·d + g·s·B·A·d``, ``d`` the dropped-out input with ``dropped``'s mask, the norm of
    ``W + s·B·A`` detached)."""
    keep = 1.0 - layer.lora_dropout["default"].p
    W = layer.base_layer.weight.detach().double()
    b = layer.base_layer.bias
    b = 0.0 if b is None else b.detach().double()
    A, B, m = (
        getattr(layer, name)["default"].weight.detach().double().requires_grad_()
        for name in ("lora_A", "lora_B", "lora_magnitude_vector")
    )
    s = layer.scaling["default"]
    xd = x.detach().double().requires_grad_()
    d = xd * (dropped != 0) / keep
    g = m / (W + s * B @ A).norm(dim=1).detach()
    y = xd @ W.T + b + (g - 1) * (d @ W.T) + g * (s * (d @ A.T @ B.T))
    (y * weights).sum().backward()
    return {
        "y": y.detach(),
        "dx": xd.grad,
        "grads": {"lora_A": A.grad, "lora_B": B.grad, "lora_magnitude_vector": m.grad},
    }


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()
