"""The one-pass Triton row norm on CPU: the support rules and the launch policy here, the kernels against an fp64
reference under the Triton interpreter (dora_norm_triton_cases.py, in a child process)."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from peft.tuners.lora import dora_norm_triton as N


HERE = Path(__file__).resolve().parent


def _run(cmd, env):
    return subprocess.run(cmd, env=env, cwd=HERE.parents[1], capture_output=True, text=True, timeout=600)


def test_kernels_under_interpreter():
    pytest.importorskip("triton", reason="the row norm kernels need Triton (pip install triton)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEFT_DORA_")}
    env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, "-m", "pytest", str(HERE / "dora_norm_triton_cases.py"), "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", "--rootdir", str(HERE.parents[1])]  # fmt: skip
    proc = _run(cmd, env)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_imports_and_declines_without_triton():
    hide = (
        "import importlib.util, sys; find = importlib.util.find_spec; sys.modules['triton'] = None; "
        "importlib.util.find_spec = lambda name, *a: None if name.split('.')[0] == 'triton' else find(name, *a); "
    )
    probe = (
        "import torch; from peft.tuners.lora import dora_norm_triton as N; t = torch.empty(2, 2); "
        "assert not N.HAS_TRITON and not N.row_norm_supported(t, t, t)\n"
        "try: N.triton_row_norm(t, t, t, 1.0)\n"
        "except RuntimeError as e: print('declined:', e)"
    )
    proc = _run([sys.executable, "-c", hide + probe], dict(os.environ, TRITON_INTERPRET="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "declined: triton_row_norm: Triton is not installed" in proc.stdout, proc.stdout


@pytest.fixture
def interpret(monkeypatch):
    """``interpret(flag)`` makes the module believe TRITON_INTERPRET was (not) set; only the host logic runs."""
    return lambda flag: monkeypatch.setattr(N, "INTERPRET", flag)


@pytest.mark.skipif(not N.HAS_TRITON, reason="needs Triton")
def test_supported_rules(interpret):
    interpret(True)
    w, a, b = torch.empty(6, 8), torch.empty(3, 8), torch.empty(6, 3)
    assert N.row_norm_supported(w, a, b)
    assert N.row_norm_supported(w.bfloat16().t().contiguous().t(), a.half(), b.bfloat16())  # any strides, mixed
    assert N.row_norm_supported(torch.empty(6, 0), torch.empty(3, 0), b)  # d_in == 0 is a zero-launch case
    assert not N.row_norm_supported(w.double(), a, b)  # fp64 stays in PyTorch
    assert not N.row_norm_supported(w, a.double(), b)
    assert not N.row_norm_supported(w, a, b.double())
    assert not N.row_norm_supported(w, torch.empty(0, 8), torch.empty(6, 0))  # r == 0
    assert not N.row_norm_supported(torch.empty(0, 8), a, torch.empty(0, 3))  # d_out == 0
    assert not N.row_norm_supported(w, a, torch.empty(6, 4))  # shapes do not chain
    assert not N.row_norm_supported(w[None], a, b)
    assert not N.row_norm_supported(w.to("meta"), a, b)
    interpret(False)
    assert not N.row_norm_supported(w, a, b)  # CPU tensors need the interpreter


@pytest.mark.parametrize("flag", [True, False])
def test_shape_errors_raise_value_error(interpret, flag):
    interpret(flag)
    w, a, b = torch.randn(6, 8), torch.randn(3, 8), torch.randn(6, 3)
    for args in ((w, a, torch.randn(6, 4)), (w, torch.randn(3, 7), b), (w, a, torch.randn(5, 3)), (w[None], a, b)):
        with pytest.raises(ValueError, match="triton_row_norm: shapes"):
            N.triton_row_norm(*args, 1.0)


@pytest.mark.skipif(not N.HAS_TRITON, reason="needs Triton")
def test_unsupported_device_or_dtype_raises_runtime_error(interpret):
    interpret(False)
    w, a, b = torch.randn(6, 8), torch.randn(3, 8), torch.randn(6, 3)
    with pytest.raises(RuntimeError, match="CUDA"):
        N.triton_row_norm(w, a, b, 1.0)
    interpret(True)
    with pytest.raises(RuntimeError, match="dtypes"):
        N.triton_row_norm(w.double(), a, b, 1.0)


def test_dot_mode(interpret):
    f32, bf16, f16 = torch.empty(0, dtype=torch.float32), torch.empty(0, dtype=torch.bfloat16), torch.empty(0).half()
    interpret(False)
    assert N._dot_mode(f32, f32, f32) == (False, False, "tf32x3")
    assert N._dot_mode(bf16, f32, f32) == (False, True, "ieee")  # autocast: half W, fp32 adapter -> bf16 hi/lo
    assert N._dot_mode(f16, f32, f32) == (False, True, "ieee")
    assert N._dot_mode(f32, bf16, bf16)[0] and N._dot_mode(bf16, f16, f16)[0]  # same-dtype half pairs: native
    assert N._dot_mode(bf16, bf16, f16) == (False, True, "ieee")  # mixed pair: split fp32 operands
    interpret(True)
    assert N._dot_mode(bf16, bf16, bf16) == (False, False, "ieee")  # the interpreter cannot multiply bf16 tiles
    assert N._dot_mode(bf16, f32, f32) == (False, False, "ieee")
    assert N._dot_mode(bf16, f16, f16)[0]


@pytest.mark.parametrize(
    "d_out, d_in, r",
    [(4096, 4096, 768), (14336, 4096, 384), (4096, 14336, 384), (28672, 4096, 64), (4096, 28672, 16), (64, 64, 1)],
)
def test_launch_policy(d_out, d_in, r):
    cfg = N._launch_config(d_out, d_in, N._next_pow2(r), 132)
    policy = N._RESIDENT if r <= 64 else N._RANK_LOOP
    assert (cfg.block_m, cfg.block_k, cfg.num_warps, cfg.num_stages) == policy[:4]
    tiles = -(-d_in // cfg.block_k)
    splits, row_blocks = -(-d_in // cfg.cols_per_split), -(-d_out // cfg.block_m)
    assert cfg.cols_per_split % cfg.block_k == 0 and min(cfg.block_m, cfg.block_k, cfg.block_r) >= 16
    assert cfg.block_r == min(64, max(16, N._next_pow2(r)))
    assert splits == 1 or cfg.cols_per_split // cfg.block_k >= policy.min_tiles_per_split
    # Splits asked for: enough for the policy's programs per SM, unless the columns are already split as finely as
    # allowed; the split width rounds up to whole tiles, so fewer may come of it, never more.
    programs = policy.programs_per_sm * 132
    asked = max(1, min(tiles // policy.min_tiles_per_split, -(-programs // row_blocks)))
    assert cfg.cols_per_split // cfg.block_k == -(-tiles // asked) and splits <= asked
    assert splits == 1 or row_blocks * (splits - 1) < programs  # no more splits than needed


def test_norm_kernel_dispatch_follows_dtypes_and_switch(dora_env, monkeypatch):
    """Auto: the kernel for a half weight with same-dtype half adapters up to rank ``_KERNEL_MAX_RANK``
    (``_KERNEL_MAX_RANK_EAGER`` inside ``eager_norms``) and with fp32 adapters (autocast) up to
    ``_KERNEL_MAX_RANK_MIXED`` (above them the cuBLAS split norm; an fp32 weight the PyTorch form) unless
    PEFT_DORA_NORM_KERNEL=1; 0 or PEFT_DORA_FUSED=0 turn it off."""
    from peft.tuners.lora import dora, dora_norm_triton

    monkeypatch.setattr(dora_norm_triton, "row_norm_supported", lambda *t: True)
    applies = dora.dora_norm._norm_kernel_applies
    bf16, f32 = torch.empty(2, 3, dtype=torch.bfloat16), torch.empty(2, 3)

    def adapters(r, dtype):
        return torch.empty(r, 3, dtype=dtype), torch.empty(2, r, dtype=dtype)

    a_bf16, b_bf16 = adapters(1, torch.bfloat16)
    a_f32, b_f32 = adapters(1, torch.float32)
    assert applies(bf16, a_bf16, b_bf16) and applies(bf16, a_f32, b_f32) and applies(bf16, a_f32, b_bf16)
    assert not applies(f32, a_f32, b_f32)
    assert not applies(bf16, *adapters(1, torch.float16))  # half adapters of another dtype: the PyTorch form
    big = dora.dora_norm._KERNEL_MAX_RANK + 1
    a_big, b_big = adapters(big, torch.bfloat16)
    assert applies(bf16, a_big[:-1], b_big[:, :-1]) and not applies(bf16, a_big, b_big)
    mixed = dora.dora_norm._KERNEL_MAX_RANK_MIXED
    assert applies(bf16, *adapters(mixed, torch.float32)) and not applies(bf16, *adapters(mixed + 1, torch.float32))
    # norms launched every time (FSDP2's sharded rows): the kernel up to _KERNEL_MAX_RANK_EAGER for half adapters,
    # where its fewer launches save more host time than its products cost; fp32 adapters as before
    eager = dora.dora_norm._KERNEL_MAX_RANK_EAGER
    assert eager > big
    with dora.dora_norm.eager_norms():
        assert applies(bf16, a_big, b_big) and applies(bf16, *adapters(eager, torch.bfloat16))
        assert not applies(bf16, *adapters(eager + 1, torch.bfloat16))
        assert not applies(bf16, *adapters(mixed + 1, torch.float32))
        assert not dora.dora_norm.w_sq_reusable(bf16, a_big, b_big)  # the kernel reads W for ||W||² in its pass
    assert not applies(bf16, a_big, b_big) and dora.dora_norm._eager.depth == 0
    seen = []
    with dora.dora_norm.eager_norms():  # per thread: DataParallel's replicas run in threads of their own
        other = threading.Thread(target=lambda: seen.append(applies(bf16, a_big, b_big)))
        other.start()
        other.join()
    assert seen == [False]
    dora_env("PEFT_DORA_NORM_KERNEL", "1")
    applies = dora.dora_norm._norm_kernel_applies
    assert applies(bf16, a_f32, b_f32) and applies(f32, a_f32, b_f32) and applies(bf16, a_big, b_big)
    dora_env("PEFT_DORA_NORM_KERNEL", "0")
    assert not dora.dora_norm._norm_kernel_applies(bf16, a_bf16, b_bf16)
    dora_env("PEFT_DORA_NORM_KERNEL", None)
    dora_env("PEFT_DORA_FUSED", "0")
    assert not dora.dora_norm._norm_kernel_applies(bf16, a_bf16, b_bf16)
    dora_env("PEFT_DORA_FUSED", None)
    dora_env("PEFT_DORA_NORM_KERNEL", "maybe")
    with pytest.raises(ValueError, match="PEFT_DORA_NORM_KERNEL"):
        dora.dora_norm._norm_kernel_applies(bf16, a_bf16, b_bf16)
