"""The direct Triton launcher's host logic, with a stand-in for a JIT function and its compiled kernel (the direct
call needs CUDA; ``test_dora_launch_gpu.py`` runs the real kernels)."""

import types

import pytest
import torch

from peft.tuners.lora import dora_launch


class HookChain:
    """Triton's (3.5+) chain of launch hooks, empty unless a profiler adds one."""

    def __init__(self):
        self.calls = []


class FakeCompiled:
    def __init__(self, fail=False):
        self.calls = []
        self.function, self.packed_metadata = "fn", "meta"
        self.fail = fail

    def run(self, *args):
        if self.fail:
            raise TypeError("function takes exactly 9 arguments")
        self.calls.append(args)


class FakeJit:
    """``fn[grid](*args, **meta)`` records the launch and returns the compiled kernel, as Triton's JIT path does."""

    def __init__(self, names, compiled):
        self.params = [types.SimpleNamespace(name=n) for n in names]
        self.launches = []
        self.compiled = compiled

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append((grid, args, meta))
            return self.compiled

        return launch


@pytest.fixture
def direct(monkeypatch):
    """The direct path switched on, with the CUDA calls it makes replaced."""
    monkeypatch.setattr(dora_launch, "_direct", [True])
    monkeypatch.setattr(
        dora_launch,
        "knobs",
        types.SimpleNamespace(runtime=types.SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=None)),
        raising=False,
    )
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    return monkeypatch


def test_first_launch_through_triton_then_direct_with_every_argument(direct):
    compiled = FakeCompiled()
    fn = FakeJit(["x_ptr", "n", "scale", "FLAG", "BLOCK"], compiled)
    k = dora_launch.Launcher(fn)
    x = torch.zeros(8)
    k[(3,)](x, 64, 0.5, FLAG=True, BLOCK=128, num_warps=4)
    assert len(fn.launches) == 1 and compiled.calls == []
    k[(3,)](x, 64, 0.25, FLAG=True, BLOCK=128, num_warps=4)  # floats do not enter the signature
    assert len(fn.launches) == 1
    assert compiled.calls == [(3, 1, 1, 1234, "fn", "meta", None, None, None, x, 64, 0.25, True, 128)]


def test_signature_changes_take_triton_s_path(direct):
    compiled = FakeCompiled()
    fn = FakeJit(["x_ptr", "n", "BLOCK"], compiled)
    k = dora_launch.Launcher(fn)
    buf = torch.zeros(64)
    k[(1,)](buf, 64, BLOCK=16)
    k[(1,)](buf, 65, BLOCK=16)  # another integer value (Triton specialises on % 16 and == 1)
    k[(1,)](buf[1:], 64, BLOCK=16)  # a pointer off 16-byte alignment
    k[(1,)](buf.double(), 64, BLOCK=16)  # another dtype
    k[(1,)](buf, 64, BLOCK=32)  # another constexpr
    k[(1,)](buf, 64, BLOCK=16, num_warps=8)  # another launch option
    assert len(fn.launches) == 6 and compiled.calls == []
    for args, meta in (((buf, 64), {"BLOCK": 16}), ((buf[4:], 65), {"BLOCK": 16})):
        k[(1,)](*args, **meta)  # seen signatures (buf[4:] is 16-byte aligned like buf): direct
    assert len(fn.launches) == 6 and len(compiled.calls) == 2


def test_missing_constexpr_keeps_triton_s_path(direct):
    compiled = FakeCompiled()
    fn = FakeJit(["x_ptr", "BLOCK", "HAS_BIAS"], compiled)  # HAS_BIAS left to a default by the call site
    k = dora_launch.Launcher(fn)
    for _ in range(3):
        k[(1,)](torch.zeros(4), BLOCK=16)
    assert len(fn.launches) == 3 and compiled.calls == []


def test_launch_hook_or_failed_direct_call_fall_back(direct):
    compiled = FakeCompiled(fail=True)
    fn = FakeJit(["x_ptr", "BLOCK"], compiled)
    k = dora_launch.Launcher(fn)
    x = torch.zeros(4)
    k[(1,)](x, BLOCK=16)
    k[(1,)](x, BLOCK=16)  # the direct call raises TypeError: relaunched through Triton, direct path off
    assert len(fn.launches) == 2 and dora_launch._direct == [False]
    k[(1,)](x, BLOCK=16)
    assert len(fn.launches) == 3

    direct.setattr(dora_launch, "_direct", [True])
    dora_launch.knobs.runtime.launch_enter_hook.calls.append(lambda *a: None)  # a profiler's hook: Triton's path
    ok = FakeCompiled()
    fn2 = FakeJit(["x_ptr", "BLOCK"], ok)
    k2 = dora_launch.Launcher(fn2)
    for _ in range(3):
        k2[(1,)](x, BLOCK=16)
    assert len(fn2.launches) == 3 and ok.calls == []


def test_interpreter_and_no_triton_never_go_direct(monkeypatch):
    monkeypatch.setattr(dora_launch, "_direct", [False])
    compiled = FakeCompiled()
    fn = FakeJit(["x_ptr", "BLOCK"], compiled)
    k = dora_launch.Launcher(fn)
    for _ in range(3):
        k[(1,)](torch.zeros(4), BLOCK=16)
    assert len(fn.launches) == 3 and compiled.calls == []


class CudaLauncher:
    """Triton 3.6's launcher object (``kernel.run``): ``__call__`` adds the scratch buffers and forwards to the C
    ``launch``."""

    def __init__(self, scratch=0):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True
        self.launched, self.called = [], []

    def launch(self, *args):
        self.launched.append(args)

    def __call__(self, *args):
        self.called.append(args)


@pytest.mark.parametrize("version", [(3, 6), (3, 7)])
@pytest.mark.parametrize("scratch", [0, 64])
def test_c_launch_called_directly_only_where_verified(direct, version, scratch):
    direct.setattr(dora_launch, "_TRITON_VERSION", version)
    compiled = FakeCompiled()
    compiled.run = CudaLauncher(scratch)
    fn = FakeJit(["x_ptr", "n", "BLOCK"], compiled)
    k = dora_launch.Launcher(fn)
    x = torch.zeros(8)
    for _ in range(2):
        k[(5, 2)](x, 64, BLOCK=128)
    if version == (3, 6) and scratch == 0:  # the C function, with __call__'s arguments spelled out
        lead = (False, True, None, None, "meta", None, None, None)
        assert compiled.run.launched == [(5, 2, 1, 1234, "fn", *lead, x, 64, 128)]
        assert compiled.run.called == []
    else:  # through the launcher object, as kernel.run
        assert compiled.run.called == [(5, 2, 1, 1234, "fn", "meta", None, None, None, x, 64, 128)]
        assert compiled.run.launched == []


def test_signature_keys():
    x = torch.zeros(8)
    assert dora_launch._signature((x, 3, 0.5, None)) == (torch.float32, 0, 3, float, type(None))
    assert dora_launch._signature((x[1:],)) == (torch.float32, 4)


def test_launch_token_repeats_the_signature_directly(direct):
    """``launch`` returns a token for its signature (the decode plans keep it); ``repeat`` calls the compiled kernel
    with new arguments of that signature, through Triton's path while a launch hook is set, through ``launch`` on
    another current device, and a signature without its constexprs gets no token."""
    compiled = FakeCompiled()
    fn = FakeJit(["x_ptr", "n", "BLOCK"], compiled)
    k = dora_launch.Launcher(fn)
    x, y = torch.zeros(8), torch.ones(8)
    token = k.launch((2,), (x, 8), {"BLOCK": 16})
    assert token is not None and token[1] == 0 and len(fn.launches) == 1 and compiled.calls == []
    assert k.launch((2,), (x, 8), {"BLOCK": 16}) == token  # a cached signature returns the same token
    k.repeat(token, (2,), (y, 8), {"BLOCK": 16})
    assert compiled.calls[-1] == (2, 1, 1, 1234, "fn", "meta", None, None, None, y, 8, 16)
    hooks = dora_launch.knobs.runtime
    hooks.launch_exit_hook = lambda *a: None
    k.repeat(token, (2,), (y, 8), {"BLOCK": 16})
    assert len(fn.launches) == 2 and len(compiled.calls) == 2
    hooks.launch_exit_hook = None
    direct.setattr(torch.cuda, "current_device", lambda: 1)
    k.repeat(token, (2,), (y, 8), {"BLOCK": 16})  # a new signature on device 1: Triton's path, then cached
    assert len(fn.launches) == 3
    assert k.launch((2,), (x, 8), {}) is None  # BLOCK left to its default: no direct call, no token
