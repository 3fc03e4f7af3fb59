"""DoRA under FSDP2 (and FSDP1) on CPU (gloo, two processes forked as ``torchrun`` would start them,
``fork_launcher.py``) against the same training in one process.

FSDP2 shards every parameter row-wise (DTensors) and gathers them for each layer's forward and backward, then frees
them again (``reshard_after_forward``). Our norm is then the sharded factored norm (``dora_dist``: each rank its own
rows, one all-gather), kept on the ranks' shards, so the checkpoint recompute reuses it and a frozen W's ``‖W‖²`` is
computed once; anything kept must still see an in-place edit between forwards. Twenty optimizer steps on a tiny
Llama give the same losses as one process on the whole batch; with SGD (an update linear in the gradient) the same
trained adapter (A, B and the magnitudes) too, which loads into an unsharded model with the same outputs. FSDP1
(``use_orig_params``, which hands DoRA plain tensor views instead of parameters) trains the same way. On CPU the
eager tier runs; the fused tiers, zero test and NCCL are ``test_dora_fsdp2_gpu.py``.
"""

import atexit
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from test_dora_interchange import upstream_env  # noqa: F401  (the fixture: a pure upstream install)


HERE = Path(__file__).resolve().parent
WORKER = HERE / "sharded_training_worker.py"


# A worker's native abort: "terminate called without an active exception" (a running std::thread destroyed) in one
# gloo process, no Python exception, the main thread with no Python frame left (faulthandler): the interpreter's
# finalization. Seen in CI under FSDP1 and FSDP2 and once in a local run of these tests; the worker now ends with
# os._exit (``exit_now``). A launch that still dies of it alone is started once more, with a warning carrying its
# output.
NATIVE_ABORT = "terminate called without an active exception"
_runs: dict = {}  # the runs of this session by what defines them: tests comparing with the same reference share it
SINGLE_PROCESS_IGNORES = ("--engine", "--reshard")  # sharding options; one process trains unsharded (no --fsdp 1)
LAUNCH_TIMEOUT_S = 600


def _train(tmp_path: Path, procs: int, *flags: str, env=None) -> dict:
    """The worker's results for ``procs`` processes (``env``: the processes' environment, e.g. upstream's install).

    One launch per distinct run and session, through the fork server of ``env`` (:class:`_Server`; on CUDA, where
    its forked processes cannot use CUDA, by ``torchrun``). A launch that died of ``NATIVE_ABORT`` alone (a signal,
    no Python exception in any process) is started once more, with a warning that carries its output; any other
    failure, and a second abort, fails the test."""
    pairs = sorted({flags[i : i + 2] for i in range(0, len(flags), 2)} - _defaults())
    unsharded = procs == 1 and ("--fsdp", "1") not in pairs  # no process group (``--fsdp 1``: FSDP2 in one process)
    if unsharded:
        pairs = [pair for pair in pairs if pair[0] not in SINGLE_PROCESS_IGNORES]
    flags = tuple(x for pair in pairs for x in pair)
    env = _worker_env(env)
    key = (procs, flags, tuple(sorted(env.items())))
    if key in _runs:
        return _runs[key]
    out = tmp_path / f"run_{procs}_{len(_runs)}.pt"
    server = _Server.of(env, cuda=("--device", "cuda") in pairs)
    for attempt in (1, 2):
        if server.usable:
            run = server.launch([str(out), *flags], procs, not unsharded, tmp_path / f"logs_{len(_runs)}")
        else:  # CUDA where a forked process cannot use it
            run = _torchrun(procs, unsharded, out, flags, env)
        log = run.stdout[-3000:] + run.stderr[-8000:]
        native_abort = NATIVE_ABORT in run.stderr and "Traceback (most recent call last)" not in _worker_lines(run)
        if run.returncode == 0 or attempt == 2 or not native_abort:
            break
        warnings.warn(f"relaunched {' '.join(flags)} ({procs} processes) after a native abort:\n{log}", stacklevel=2)
    assert run.returncode == 0, log
    _runs[key] = torch.load(out)
    return _runs[key]


def _worker_env(env=None) -> dict:
    """The workers' environment (``os.environ`` by default): an abort prints every thread's stack, and pytest's name of
    the running test is left out, so that runs and fork servers are shared between tests."""
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _torchrun(procs: int, unsharded: bool, out: Path, flags: tuple, env: dict) -> subprocess.CompletedProcess:
    # one unsharded process: the worker itself, without torchrun's agent
    launcher = [] if unsharded else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
    cmd = [sys.executable, *launcher, str(WORKER), str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, env=env)


class _Server:
    """A running ``fork_launcher.py`` for one environment (and for CPU or CUDA launches): it imported torch,
    transformers and (for CPU launches) PEFT once, and forks each launch's processes (an import took ~11 s per
    process on CI's two cores, most of a launch; ~13 s on the GPU host)."""

    _servers: dict = {}

    def __init__(self, env: dict, cuda: bool):
        self.errors = tempfile.NamedTemporaryFile("w+", prefix="fork_launcher_", suffix=".txt")
        cmd = [sys.executable, str(HERE / "fork_launcher.py"), *(["--cuda"] if cuda else [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
                                     text=True, env=env)  # fmt: skip
        self.usable = self._reply()["usable"]  # ready: its imports done

    @classmethod
    def of(cls, env: dict, cuda: bool = False) -> "_Server":
        key = (cuda, tuple(sorted(env.items())))
        server = cls._servers.get(key)
        if server is None or server.proc.poll() is not None:
            server = cls._servers[key] = cls(env, cuda)
        return server

    def _reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            self.errors.seek(0)
            raise RuntimeError(f"fork_launcher.py ended (exit {self.proc.returncode}):\n{self.errors.read()[-8000:]}")
        return json.loads(line)

    def launch(self, argv: list, procs: int, dist: bool, logs: Path) -> subprocess.CompletedProcess:
        request = {"argv": argv, "procs": procs, "dist": dist, "logs": str(logs), "timeout": LAUNCH_TIMEOUT_S}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        texts = {}
        for name in ("stdout", "stderr"):
            parts = [f"[rank {r}] " + (logs / f"{name}_{r}.txt").read_text(errors="replace") for r in range(procs)]
            texts[name] = "\n".join(parts)
        codes = reply["returncodes"]
        code = next((c for c in codes if c != 0), 0)
        if reply["timed_out"]:
            texts["stderr"] += f"\n(launch timed out after {LAUNCH_TIMEOUT_S} s; return codes {codes})"
        return subprocess.CompletedProcess(argv, code, texts["stdout"], texts["stderr"])

    @classmethod
    def close_all(cls) -> None:
        for server in cls._servers.values():
            with contextlib.suppress(Exception):
                server.proc.stdin.close()
                server.proc.wait(timeout=30)
            if server.proc.poll() is None:
                server.proc.kill()
        cls._servers.clear()


atexit.register(_Server.close_all)


def _worker_lines(run: subprocess.CompletedProcess) -> str:
    """The workers' own output: what torchrun's agent logs (then its ChildFailedError traceback) comes after it."""
    return run.stdout + run.stderr.split("elastic/multiprocessing/api.py")[0]


def _worker_module():
    sys.path.insert(0, str(HERE))
    try:
        import sharded_training_worker
    finally:
        sys.path.remove(str(HERE))
    return sharded_training_worker


@functools.cache
def _defaults() -> frozenset:
    """``(flag, value)`` of every worker option at its default: a run that names one is the run that does not."""
    args = vars(_worker_module().arguments().parse_args(["out"]))
    return frozenset((f"--{k.replace('_', '-')}", str(v)) for k, v in args.items() if k != "out" and v is not None)


def _build():
    return _worker_module().build()


@pytest.mark.parametrize(
    ("engine", "optim", "reshard", "checkpointing"),
    (
        ("fsdp2", "sgd", "1", "0"),
        ("fsdp2", "sgd", "0", "1"),
        ("fsdp2", "adamw", "1", "1"),  # the resume test's uninterrupted run
        ("fsdp1", "sgd", "1", "1"),
        ("fsdp1-peft", "sgd", "1", "1"),
        ("fsdp1-peft-flat", "sgd", "1", "1"),
    ),
    ids=(
        "sgd-reshard",
        "sgd-keep-checkpointing",
        "adamw-reshard-checkpointing",
        "fsdp1-sgd-checkpointing",
        "fsdp1-peft-policy",
        "fsdp1-peft-policy-flat-params",
    ),  # fmt: skip
)
def test_fsdp2_training_equals_one_process(tmp_path, request, engine, optim, reshard, checkpointing):
    """``fsdp1-peft``: FSDP1 with PEFT's ``fsdp_auto_wrap_policy`` (accelerate's and the Trainer's for a PEFT model),
    where every lora_A, lora_B and magnitude module is an FSDP unit of its own, whole only inside its own forward
    (before the fix our norm read their flat shards and raised; upstream's DoRA fails there too). ``-flat``: the same
    without ``use_orig_params`` (PEFT's documented FSDP recipe, which upstream trains), where outside the units'
    forwards the weights are views of freed storage (before the fix: a RuntimeError on CPU)."""
    flags = ("--optim", optim, "--reshard", reshard, "--checkpointing", checkpointing)
    policy = ("--fsdp1-policy", "peft") if "-peft" in engine else ()
    policy += ("--fsdp1-orig-params", "0") if engine.endswith("-flat") else ()
    engine = engine.split("-")[0]
    sharded = _train(tmp_path, 2, *flags, "--engine", engine, *policy)
    single = _train(tmp_path, 1, *flags)
    assert sharded["world"] == 2 and single["world"] == 1
    assert len(sharded["losses"]) == 20
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-5)
    a, b = sharded["adapter"], single["adapter"]
    assert sorted(a) == sorted(b) and any("lora_magnitude_vector" in k for k in a)
    initial = {k: v for k, v in _adapter_of(_build()).items()}
    assert max((b[k] - initial[k]).abs().max().item() for k in b) > 1e-3  # it trained
    if engine == "fsdp2":
        _check_sharded_norm(sharded, single, recompute=checkpointing == "1", same_params=optim == "sgd")
    else:  # FSDP1: the whole norm on its gathered views, kept on the flat shards for the recompute
        norms = [c.get("norm_computed", 0) + c.get("norm_reused", 0) for c in sharded["counts"]]
        assert norms == [2 * MODULES] * len(norms), sharded["counts"]
        if not policy:  # decoder-layer units (PEFT's policy gives the norm copies of A and B, kept nowhere)
            assert all(c.get("norm_reused") == MODULES for c in sharded["counts"]), sharded["counts"]
            # eval forwards: computed, then again after B's edit, then reused (m's edit and none leave it)
            evaluated = [(c.get("norm_computed", 0), c.get("norm_reused", 0)) for c in sharded["eval"]["counts"]]
            assert evaluated == [(MODULES, 0), (0, MODULES), (0, MODULES)], evaluated
        for a_, b_ in zip(sharded["eval"]["logits"], single["eval"]["logits"]):  # in-place edits between forwards
            torch.testing.assert_close(a_, b_, rtol=1e-4, atol=1e-4)
    if optim == "adamw":
        return  # Adam turns reduction-order noise in near-zero gradients into ~1e-3 parameter differences
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)

    # the adapter gathered under FSDP2 loads into an unsharded model and gives the single process's outputs
    from peft import set_peft_model_state_dict

    outputs = []
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
    for adapter in (a, b):
        model = _build().eval()
        result = set_peft_model_state_dict(model, adapter)
        assert not result.unexpected_keys
        with torch.no_grad():
            outputs.append(model(input_ids=ids).logits)
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-4)
    if engine == "fsdp2" and reshard == "1":
        _loads_in_upstream(tmp_path, request.getfixturevalue("upstream_env"), a, ids, outputs[0])


UPSTREAM_SIDE = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
import peft
from peft import set_peft_model_state_dict
from sharded_training_worker import build
adapter, ids = torch.load(sys.argv[2]), torch.load(sys.argv[3])
model = build().eval()
assert not set_peft_model_state_dict(model, adapter).unexpected_keys
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[4])
print(peft.__file__)
"""


def _loads_in_upstream(tmp_path: Path, upstream: tuple, adapter: dict, ids: torch.Tensor, ours: torch.Tensor) -> None:
    """The adapter trained under FSDP2 (gathered) loads in upstream PEFT 0.21.2 (``upstream``: the pure install of
    the ``upstream_env`` fixture, run in a subprocess) and gives the logits ours gives with it unsharded."""
    paths = [tmp_path / name for name in ("adapter.pt", "ids.pt", "logits.pt")]
    torch.save(adapter, paths[0])
    torch.save(ids, paths[1])
    script = tmp_path / "upstream_side.py"
    script.write_text(UPSTREAM_SIDE)
    cmd = [sys.executable, str(script), str(HERE), *map(str, paths)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=upstream[1], timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert Path(run.stdout.strip().splitlines()[-1]).resolve().is_relative_to(upstream[0].resolve())  # upstream's
    torch.testing.assert_close(torch.load(paths[2]), ours, rtol=1e-4, atol=1e-4)


LAYERS = 2  # decoder layers of the worker's model, each an FSDP2 unit
MODULES = 7 * LAYERS  # DoRA Linears of the worker's model: 7 projections in each layer


def _check_sharded_norm(sharded: dict, single: dict, recompute: bool, same_params: bool) -> None:
    """The sharded factored norm (``dora_dist``): each rank computes its own rows of every norm, which equal the
    whole norm of the gathered tensors; the norm is kept on the ranks' shards, so a checkpoint recompute reuses it
    and a frozen W's ``‖W‖²`` is computed once; an in-place edit of B and then of m between eval forwards (no
    optimizer step) is seen, as without FSDP2 (the eval logits equal the single process's where training gave the
    same parameters)."""
    check = sharded["norm_check"]
    assert check["modules"] == MODULES and check["row_sharded"] == MODULES  # every projection, odd d_out included
    assert check["max_rel_err"] <= 1e-6
    for step, counts in enumerate(sharded["counts"]):
        assert counts.get("norm_computed") == MODULES, (step, counts)
        assert counts.get("norm_reused", 0) == (MODULES if recompute else 0), (step, counts)
        assert counts.get("w_sq_computed", 0) == (MODULES if step == 0 else 0), (step, counts)
        # one all-gather per layer: its first DoRA Linear computes the rows of all (the first step learns the order)
        gathers, batched = (MODULES, 0) if step == 0 else (LAYERS, MODULES - LAYERS)
        assert (counts.get("norm_gathers"), counts.get("norm_batched", 0)) == (gathers, batched), (step, counts)
    for a, b in zip(sharded["eval"]["logits"], single["eval"]["logits"]):
        if same_params:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    after_b, after_m, repeat = sharded["eval"]["counts"]
    assert after_b.get("norm_computed") == MODULES  # B changed: every norm again
    assert after_b.get("norm_gathers") == LAYERS and after_b.get("norm_batched") == MODULES - LAYERS
    assert after_m.get("norm_reused") == MODULES and after_m.get("scale_computed") == MODULES  # m changed: g again
    # nothing changed: nothing computed (the fused tiers' small/decode factors, counted as scales, hold the norm)
    assert not repeat.get("norm_computed") and not repeat.get("scale_computed"), repeat
    assert repeat.get("norm_reused", 0) + repeat.get("scale_reused", 0) >= MODULES, repeat
    # every B scaled, then each value projection's again as its forward starts, after its layer's first DoRA Linear
    # computed the norms of all: the one waiting for it is stale, not taken (the single process edits alike)
    edited, reference = sharded["eval"]["edit_in_forward"], single["eval"]["edit_in_forward"]
    assert edited["hooks"] == reference["hooks"] == LAYERS
    counts = edited["counts"]
    assert (counts.get("norm_gathers"), counts.get("norm_batched")) == (2 * LAYERS, MODULES - 2 * LAYERS), counts
    if same_params:
        torch.testing.assert_close(edited["logits"], reference["logits"], rtol=1e-4, atol=1e-4)
        assert (edited["logits"] - sharded["eval"]["logits"][-1]).abs().max() > 1e-3  # the edit mattered


def _adapter_of(model) -> dict:
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model)


def test_fork_launcher_reports_each_process_and_serves_on(tmp_path):
    """A launch whose processes fail (here argparse's exit 2 on a bad option) comes back failed with each process's
    own stderr, and the same server then serves a good launch (its processes get torchrun's variables: a world of
    two)."""
    env = _worker_env()
    server = _Server.of(env)
    bad = server.launch([str(tmp_path / "bad.pt"), "--engine", "none"], 2, True, tmp_path / "bad")
    assert bad.returncode == 2 and bad.stderr.count("invalid choice: 'none'") == 2, bad.stderr[-2000:]
    assert "[rank 0]" in bad.stderr and "[rank 1]" in bad.stderr and not (tmp_path / "bad.pt").exists()
    assert _Server.of(env) is server and server.proc.poll() is None
    good = server.launch([str(tmp_path / "good.pt"), "--zero-test", "1"], 2, True, tmp_path / "good")
    assert good.returncode == 0, good.stderr[-4000:]
    assert torch.load(tmp_path / "good.pt")["world"] == 2


def test_zero_test_prefetch_never_reads_a_freed_parameter():
    """FSDP frees a gathered parameter by resizing its storage to nothing; the optimizer-step hook must drop such a
    magnitude from its watch instead of reading it (on a GPU that read was an illegal memory access)."""
    from torch import nn

    from peft.tuners.lora import dora_cache

    freed, live = nn.Parameter(torch.ones(6)), nn.Parameter(torch.ones(6))
    freed.untyped_storage().resize_(0)
    assert not dora_cache.storage_holds(freed) and dora_cache.storage_holds(live)
    memos = (dora_cache.Memo(), dora_cache.Memo())
    dora_cache._zero_watch[freed], dora_cache._zero_watch[live] = memos
    try:
        dora_cache.prefetch_zero_tests()
        assert freed not in dora_cache._zero_watch and live in dora_cache._zero_watch
    finally:
        dora_cache._zero_watch.pop(freed, None)
        dora_cache._zero_watch.pop(live, None)


def test_flat_magnitude_takes_the_world_only_where_it_is_the_shard_group():
    """``dora_dist.flat_magnitude`` on a stand-in of FSDP1's flat parameter (its fields as FSDP1 sets them: two
    originals of 4 and 8 elements with 2 of padding between): a flat parameter split into as many shards as the world
    has ranks is tested over the world; one not split (NO_SHARD) needs no collective; one split otherwise
    (HYBRID_SHARD across nodes, a subgroup; here: no process group at all) keeps the training nodes' own test (None),
    as does a view at no original's place."""
    from peft.tuners.lora import dora_dist

    def flat_of(shards: int):
        flat = torch.nn.Parameter(torch.zeros(14))
        flat._is_flat_param = True
        flat._numels_with_padding, flat._is_padding_mask, flat._numels = (4, 2, 8), [False, True, False], (4, 8)
        flat._local_shard = flat.data
        flat._sharded_size = torch.Size([14 // shards])
        flat._padded_unsharded_size = torch.Size([14])
        return flat

    flat = flat_of(1)
    found = dora_dist.flat_magnitude(flat[6:14])
    assert found is not None and found.index == 1 and found.group is None and found.orig is None
    assert found.param is flat and found.keys[0] is flat._local_shard
    assert dora_dist.flat_magnitude(flat[0:4]).index == 0
    assert dora_dist.flat_magnitude(flat[4:12]) is None  # no original starts there
    assert dora_dist.flat_magnitude(flat[6:10]) is None  # an original's place, not its size
    assert dora_dist.flat_magnitude(torch.nn.Parameter(torch.zeros(8))) is None  # not a view: no FSDP1
    assert not torch.distributed.is_initialized()
    assert dora_dist.flat_magnitude(flat_of(2)[6:14]) is None  # split, and the world is not its group
    keys, versions = dora_dist.flat_stand_ins((flat[0:4], torch.ones(2), flat[6:14]))
    assert keys[0] is keys[2] is flat._local_shard and versions == (0, flat._version, None, 1, flat._version, None)


@pytest.mark.parametrize("engine", ("fsdp2", "fsdp1"))
def test_sharded_magnitude_zero_test_started_by_the_step_hook(tmp_path, engine):
    """Under FSDP2 and FSDP1 the optimizer-step hook tests every rank's magnitude shards and all-reduces the answer,
    so the fused training nodes (GPU-only; asked here as they ask) find it instead of reading each gathered magnitude
    on the host once per module and step; a zero on one rank's shard reaches the other rank; an optimizer stepped on
    one rank only, holding none of the magnitudes, starts no collective (which would hang the next one) and keeps
    every answer (it wrote none of the magnitudes)."""
    out = _train(tmp_path, 2, "--zero-test", "1", "--engine", engine)["zero_test"]
    answers, reads = out["first"]
    assert answers == [True] * MODULES and reads == MODULES  # nothing started yet: read on the host
    answers, reads = out["after_step"]
    assert answers == [True] * MODULES and reads == 0
    answers, reads = out["after_zeroing_step"]  # rank 0's answers: the zero is in rank 1's shard
    assert answers == [False] * MODULES and reads == 0  # one test for all magnitudes: a zero anywhere counts
    # an optimizer that holds none of the magnitudes changed none of them: every kept answer still holds, the zeroing
    # step's one for all (it had made every DoRA module's next forward read its magnitude on the host, a sync each)
    answers, reads = out["after_other_optimizer"]
    assert answers == [False] * MODULES and reads == 0
    assert out["target_on_zero_rank"]  # the zeroed entry was on rank 1's shard, so rank 0 learned it from rank 1


@pytest.mark.parametrize("engine", ("fsdp2", "fsdp2-whole", "fsdp2-step", "fsdp1", "zero2", "zero3"))
def test_resume_from_a_sharded_checkpoint(tmp_path, engine):
    """Mid-run, a sharded checkpoint (``torch.distributed.checkpoint`` under FSDP2, DeepSpeed's own under ZeRO; model
    and AdamW state), three steps on other data, then the checkpoint loaded into the live model and optimizer: the
    next losses are the uninterrupted run's. Under FSDP2, loading writes the shards behind every kept norm and
    ``‖W‖²``, which must then be computed again (``fsdp2-whole``: with ``PEFT_DORA_SHARDED_NORM=0``, the whole
    ``‖W‖²`` kept on the same shard; ``fsdp2-step``: with ``PEFT_DORA_STEP_NORMS=1``, where the last detour step's
    hook left norms of the detour's values waiting, which the first forward after the load must not take). FSDP1
    (``use_orig_params``) goes through ``torch.distributed.checkpoint`` too."""
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    env = {"fsdp2-whole": {"PEFT_DORA_SHARDED_NORM": "0"}, "fsdp2-step": {"PEFT_DORA_STEP_NORMS": "1"}}.get(engine)
    env = None if env is None else dict(os.environ, **env)
    flags = ("--optim", "adamw", "--checkpointing", "1", "--engine", engine.split("-")[0])
    resumed = _train(tmp_path, 2, *flags, "--resume", "1", env=env)
    # the step norms are the forward's own (the test above): its straight run is the default one
    straight = _train(tmp_path, 2, *flags, env=None if engine == "fsdp2-step" else env)
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(straight["losses"]), rtol=0, atol=1e-6)
    if engine.startswith("fsdp2"):
        assert resumed["counts"][10].get("w_sq_computed") == MODULES  # the load wrote W's shards: ||W||^2 again
    if engine == "fsdp2-step":  # the waiting norms of the detour not taken after the load; the next step's are
        assert not resumed["counts"][10].get("norm_batched") and resumed["counts"][11]["norm_batched"] == MODULES


def test_fsdp2_fused_tiers_under_the_interpreter(tmp_path):
    """The fused tiers (Triton kernels under ``TRITON_INTERPRET=1`` on CPU tensors) under FSDP2: the training nodes
    with the sharded norm give the single process's losses, and after the first step no node tests its magnitude on
    the host: the step hook's one test per step is all (``dora_cache._has_zero`` calls counted per step)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    flags = ("--optim", "sgd", "--checkpointing", "1", "--steps", "8")  # the interpreter is slow; 8 steps tell
    sharded, single = _train(tmp_path, 2, *flags, env=env), _train(tmp_path, 1, *flags, env=env)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-5)
    _check_sharded_norm(sharded, single, recompute=True, same_params=True)  # the eval forwards on the fused tiers
    counts = sharded["counts"]
    assert all(c.get("tier_fused_backward") == 2 * MODULES for c in counts), counts[:2]  # forward and recompute
    assert counts[0]["zero_tests"] == MODULES + 1  # the first step: every node asks once (kept for the recompute)
    assert all(c["zero_tests"] == 1 for c in counts[1:]), [c["zero_tests"] for c in counts]  # the hook's only


def test_fsdp1_fused_tiers_test_the_magnitudes_once_per_step(tmp_path):
    """FSDP1 (a unit per decoder layer) on the fused tiers (``TRITON_INTERPRET=1``): FSDP1 hands each forward a new
    view of its unsharded flat parameter, and each recompute the same view over new storage, so a zero test kept on
    the view missed in every node: one host read of the GPU per module and forward (on 2x H200, 33 ms of host per
    4-layer step, FSDP1 at 1.29x LoRA). Kept on the flat parameter's local shard instead (``dora_dist.FlatMagnitude``)
    and started by the optimizer-step hook, every later step tests once (the hook's), and training still equals one
    process's. (Without ``use_orig_params`` a decoder-layer unit cannot hold frozen and trained parameters; PEFT's
    wrap policy makes the magnitudes units of their own, whose forwards take no fused node.)"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    flags = ("--optim", "sgd", "--checkpointing", "1", "--steps", "8")  # the interpreter is slow; 8 steps tell
    sharded = _train(tmp_path, 2, *flags, "--engine", "fsdp1", env=env)
    single = _train(tmp_path, 1, *flags, env=env)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-5)
    counts = sharded["counts"]
    assert all(c.get("tier_fused_backward") == 2 * MODULES for c in counts), counts[:2]  # forward and recompute
    assert counts[0]["zero_tests"] == MODULES + 1  # the first step: every node asks once (kept for the recompute)
    assert all(c["zero_tests"] == 1 for c in counts[1:]), [c["zero_tests"] for c in counts]  # the hook's only


def test_fsdp2_columns_of_b_take_the_whole_norm(tmp_path):
    """FSDP2 with B sharded over its columns (``shard_placement_fn``): W's and B's rows no longer split alike, so each
    rank computes the whole norm of the gathered tensors, still kept on the shards (the recompute reuses it), and the
    training equals one process's."""
    flags = ("--optim", "sgd", "--checkpointing", "1")
    sharded, single = _train(tmp_path, 2, *flags, "--b-columns", "1"), _train(tmp_path, 1, *flags)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-5)
    check = sharded["norm_check"]
    assert check["modules"] == MODULES and check["row_sharded"] == 0 and check["max_rel_err"] <= 1e-6
    _check_whole_norm_counts(sharded)
    for a, b in zip(sharded["eval"]["logits"], single["eval"]["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def _check_whole_norm_counts(run: dict) -> None:
    """Every rank computed the whole norm (no norm all-gather), kept on the shards: one per module and step (the
    recompute reuses it), and the frozen W's ``‖W‖²`` once per run, kept on its shard as for the sharded norm's rows."""
    for step, counts in enumerate(run["counts"]):
        assert counts["norm_computed"] == counts["norm_reused"] == MODULES and not counts.get("norm_gathers"), counts
        assert counts.get("w_sq_computed", 0) == (MODULES if step == 0 else 0), (step, counts)


def test_fsdp2_sharded_norm_off_takes_the_whole_norm(tmp_path):
    """``PEFT_DORA_SHARDED_NORM=0``: every rank computes the whole norm of the gathered tensors (no norm all-gather),
    still kept on the shards (the recompute reuses it, ``‖W‖²`` once per run), and the training equals one
    process's."""
    flags = ("--optim", "sgd", "--checkpointing", "1")
    sharded = _train(tmp_path, 2, *flags, env=dict(os.environ, PEFT_DORA_SHARDED_NORM="0"))
    single = _train(tmp_path, 1, *flags)
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-5)
    assert sharded["norm_check"]["row_sharded"] == 0
    _check_whole_norm_counts(sharded)
    for a, b in zip(sharded["eval"]["logits"], single["eval"]["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_fsdp2_step_norms_are_the_forwards_norms(tmp_path):
    """``PEFT_DORA_STEP_NORMS=1``: after each optimizer step the hook computes every sharded norm from the ranks'
    shards the step wrote (one all-gather of the A matrices, one of the rows), and the next forward takes them
    instead of one row all-gather per FSDP2 unit. The norms are the forward's own, bit for bit (with FSDP2's mixed
    precision too, whose gathers cast the fp32 shards to bf16): the same losses and trained adapter as without it,
    no norm all-gather inside a forward after the first step, and the edits between eval forwards still seen (the
    waiting norm is keyed on the shards' versions as the forward's own). Under mixed precision, where the hook casts
    the shards as FSDP2's gathers do; all-fp32 shards (no cast) in the resume test's ``fsdp2-step``."""
    _check_step_norms(tmp_path, "--optim", "sgd", "--checkpointing", "1", "--mp", "1")


def test_fsdp2_unit_row_graph_trains_as_the_launched_rows(tmp_path):
    """FSDP2's per-unit row graph (``DoraLinearLayer._unit_rows_graphed``) computes every rank's rows of a unit's norms
    from the local shards of W and B (cast as FSDP2's mixed precision casts them for its all-gather) and a copy of the
    gathered As, padded into the row all-gather's send buffer, where each layer otherwise launches its rows from the
    gathered tensors. On CPU, with the graphs emulated (each replay computing again from the captured tensors, as a
    CUDA graph reads their current values; ``sharded_training_worker._emulate_norm_graphs``): the same losses and
    trained adapter as the launched rows bit for bit through SGD steps, with every unit's rows from its graph from
    the third step on (the first computes them eagerly, the second captures); odd row counts pad the last rank's
    rows."""
    flags = ("--optim", "sgd", "--checkpointing", "1", "--mp", "1")
    graphed, launched = _train(tmp_path, 2, *flags, "--emulate-graphs", "1"), _train(tmp_path, 2, *flags)
    assert graphed["losses"] == launched["losses"]
    assert sorted(graphed["adapter"]) == sorted(launched["adapter"])
    for name, value in graphed["adapter"].items():
        assert torch.equal(value, launched["adapter"][name]), name
    assert not any(c.get("unit_rows") for c in launched["counts"])
    for step, counts in enumerate(graphed["counts"][2:], 2):
        assert counts["unit_rows"] == counts["norm_gathers"] == LAYERS, (step, counts)
        assert counts["graph_replayed"] == counts["unit_rows"], (step, counts)


def _check_step_norms(tmp_path, *flags: str) -> None:
    """Two processes trained with ``PEFT_DORA_STEP_NORMS=1`` and without it (otherwise ``flags``): the same losses,
    trained adapter and eval logits bit for bit, the hook's all-gathers in every step and none in a forward after the
    first (``test_dora_fsdp2_gpu`` runs the same on two GPUs)."""
    step = _train(tmp_path, 2, *flags, env=dict(os.environ, PEFT_DORA_STEP_NORMS="1"))
    ahead = _train(tmp_path, 2, *flags)
    assert step["losses"] == ahead["losses"]
    assert sorted(step["adapter"]) == sorted(ahead["adapter"])
    for name, value in step["adapter"].items():
        assert torch.equal(value, ahead["adapter"][name]), name
    for i, counts in enumerate(step["counts"]):
        # the hook's two all-gathers (A, the rows) in every step; inside the forward one row all-gather per module in
        # the first step (which learns the units' order), none later: every norm was waiting
        gathers, waiting = (MODULES + 1, 0) if i == 0 else (1, MODULES)
        assert (counts.get("norm_gathers"), counts.get("norm_batched", 0)) == (gathers, waiting), (i, counts)
        assert counts.get("step_norms") == MODULES and counts.get("step_gathers") == 1, (i, counts)
        assert counts.get("norm_computed") == counts.get("norm_reused") == MODULES, (i, counts)  # recompute reuses
    for a, b in zip(step["eval"]["logits"], ahead["eval"]["logits"]):
        assert torch.equal(a, b)


def test_fsdp2_four_processes_train_as_one(tmp_path):
    """Any N: four processes (FSDP2 shards of 25/25/25/24 rows for the odd ``d_out``, one row of each ``lora_A``)
    train as one process on the same global batch, with the sharded norm equal to the whole norm on every rank."""
    flags = ("--optim", "sgd", "--checkpointing", "1")
    sharded, single = _train(tmp_path, 4, *flags), _train(tmp_path, 1, *flags)
    assert sharded["world"] == 4
    torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=1e-5)
    _check_sharded_norm(sharded, single, recompute=True, same_params=True)
    for name, value in single["adapter"].items():
        torch.testing.assert_close(sharded["adapter"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_qdora_fsdp2_trains_as_one_process_and_as_upstream(tmp_path, upstream_env):  # noqa: F811
    """QDoRA under FSDP2 (bitsandbytes' FSDP recipe: 4-bit storage in a float dtype, here NF4 in fp32 storage and
    compute): FSDP2 shards and gathers the packed weights, whose quantization state the layer keeps. Two processes
    train as one and as upstream's DoRA under the same engine, and the eval logits around in-place edits of B and m
    equal upstream's. The norm and the frozen weight's ``‖W‖²`` are kept on the shards: bitsandbytes wraps the
    gathered packed weight in a new ``Params4bit`` in every forward, so a memo on it was never reused (before, every
    forward dequantized every weight for ``‖W‖²`` and the checkpoint recompute computed the norm again)."""
    pytest.importorskip("bitsandbytes")
    flags = ("--optim", "sgd", "--quant", "nf4", "--checkpointing", "1")
    sharded, single = _train(tmp_path, 2, *flags), _train(tmp_path, 1, *flags)
    theirs = _train(tmp_path, 2, *flags, env=upstream_env[1])
    assert sharded["world"] == theirs["world"] == 2 and sharded["counts"][0].get("norm_computed") == MODULES
    for other in (single, theirs):
        torch.testing.assert_close(torch.tensor(sharded["losses"]), torch.tensor(other["losses"]), rtol=1e-5, atol=1e-5)
        assert sorted(sharded["adapter"]) == sorted(other["adapter"])
        for name, value in other["adapter"].items():
            torch.testing.assert_close(sharded["adapter"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    for a, b in zip(sharded["eval"]["logits"], theirs["eval"]["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert (sharded["eval"]["logits"][0] - sharded["eval"]["logits"][1]).abs().max() > 1e-2  # the edits changed them
    for step, counts in enumerate(sharded["counts"]):
        assert counts.get("norm_computed") == counts.get("norm_reused") == MODULES, (step, counts)
        assert counts.get("w_sq_computed", 0) == (MODULES if step == 0 else 0), (step, counts)
    after_b, after_m, repeat = sharded["eval"]["counts"]
    assert after_b.get("norm_computed") == MODULES and after_m.get("scale_computed") == MODULES
    assert after_m.get("norm_reused") == MODULES
    assert not repeat.get("norm_computed") and not repeat.get("scale_computed")


def test_fsdp2_mixed_precision_as_close_to_fp32_as_upstream(tmp_path, upstream_env):  # noqa: F811
    """FSDP2 with fp32 parameters gathered and computed in bf16 (``MixedPrecisionPolicy(bf16, reduce fp32)``), the
    issue's second precision: the sharded norm reads bf16 gathered rows while its memos are keyed on fp32 shards.
    Against the fp32 run of one process, our losses are as close as upstream's under the same engine, and the norm
    is still one per module and step (the recompute reuses it) with ``‖W‖²`` once per run."""
    flags = ("--optim", "adamw", "--checkpointing", "1")
    ours = _train(tmp_path, 2, *flags, "--mp", "1")
    theirs = _train(tmp_path, 2, *flags, "--mp", "1", env=upstream_env[1])
    exact = _train(tmp_path, 1, *flags)

    def err(run):
        return max(abs(a - b) for a, b in zip(run["losses"], exact["losses"]))

    assert 0 < err(ours) <= 1.5 * err(theirs) + 1e-4 and err(ours) < 5e-3, (err(ours), err(theirs))
    assert ours["norm_check"]["row_sharded"] == MODULES and ours["norm_check"]["max_rel_err"] <= 1e-6
    for step, counts in enumerate(ours["counts"]):
        assert counts.get("norm_computed") == counts.get("norm_reused") == MODULES, (step, counts)
        assert counts.get("w_sq_computed", 0) == (MODULES if step == 0 else 0), (step, counts)


def test_unit_norms_keep_the_forward_order():
    """``dora_dist.UnitNorms``: the members after a leader, in the order they first asked; a dropped member (its
    waiting norm never taken) is left out but keeps its place, and is back once it leads again; a deleted layer
    leaves."""
    from torch import nn

    from peft.tuners.lora import dora_dist

    unit = dora_dist.UnitNorms()
    layers = [nn.Module() for _ in range(4)]
    tensors = [[torch.zeros(1) for _ in range(3)] for _ in layers]

    def followers(i):
        return [layers.index(f[0]) for f in unit.followers(layers[i], *tensors[i], 0.5)]

    assert [followers(i) for i in range(4)] == [[], [], [], []]  # the first forward: each leads alone, in order
    assert followers(0) == [1, 2, 3] and followers(2) == [3]
    unit.drop(layers[1])
    assert followers(0) == [2, 3]
    assert followers(1) == [2, 3] and followers(0) == [1, 2, 3]  # led again: back, in its place
    layers[2] = nn.Module()  # the old layer 2 is gone; the new one joins at the end when it asks
    assert followers(0) == [1, 3] and followers(2) == [] and followers(0) == [1, 3, 2]


def test_layer_keeps_its_norm_shards_while_they_hold(monkeypatch):
    """A DoRA Linear keeps the ``NormShards`` its norm is keyed on between forwards (``LayerReuse.shards``) only while
    they hold: the same gathered W, A and B, the same sharded parameters under FSDP2's ``FSDPParam`` and the same
    local shards under them (FSDP2 swaps both where it loads a state dict with ``assign``), the same settings, FSDP2
    still present. Stand-ins for FSDP2's objects; each failed check makes the layer find its shards anew."""
    from types import SimpleNamespace

    from torch import nn

    from peft.tuners.lora import dora_dist, dora_settings
    from peft.tuners.lora.dora import DoraLinearLayer

    monkeypatch.setattr(dora_dist, "_module_state_mapping", {"fsdp2": "present"})
    gathered = [nn.Parameter(torch.zeros(4, 4)) for _ in range(3)]
    locals_ = [torch.zeros(2, 4) for _ in range(3)]
    params = [SimpleNamespace(_local_tensor=t) for t in locals_]
    fps = [SimpleNamespace(sharded_param=p) for p in params]
    found = []

    def norm_shards(weight, lora_A, lora_B):
        found.append(1)
        keys = tuple(p._local_tensor for p in params)
        env = dora_settings.current()
        return dora_dist.NormShards(keys, tuple(params), (weight, lora_A, lora_B), env=env, fsdp_params=tuple(fps))

    monkeypatch.setattr(dora_dist, "norm_shards", norm_shards)
    layer = DoraLinearLayer(fan_in_fan_out=False)

    def ask(*tensors):
        shards = layer._norm_shards(*(tensors or gathered))
        return len(found), shards

    n, first = ask()
    assert n == 1 and first.holds(*gathered)
    assert ask() == (1, first)  # kept
    assert not first.holds(gathered[0], gathered[1], nn.Parameter(torch.zeros(4, 4)))
    assert ask(gathered[0], gathered[1], nn.Parameter(torch.zeros(4, 4)))[0] == 2  # another B: found anew
    _, kept = ask()
    assert len(found) == 3 and ask() == (3, kept)
    params[2]._local_tensor = torch.zeros(2, 4)  # a new local shard under the same DTensor
    assert not kept.holds(*gathered) and ask()[0] == 4
    _, kept = ask()
    params[1] = SimpleNamespace(_local_tensor=locals_[1])  # a new DTensor with the old local shard
    fps[1].sharded_param = params[1]
    assert not kept.holds(*gathered) and ask()[0] == 5
    _, kept = ask()
    with dora_settings.override(sharded_norm=False):  # other settings: found anew
        assert not kept.holds(*gathered) and ask()[0] == 6
    monkeypatch.setattr(dora_dist, "_module_state_mapping", {})
    assert not ask()[1].holds(*gathered)  # FSDP2 gone
    layer._reuse.clear()
    assert layer._reuse.shards is None


_FREED_SCRIPT = r"""
import gc, os, weakref
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import dora_dist

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["FREED_PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1)


def trained(dora):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         vocab_size=64, num_hidden_layers=2)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                               use_dora=dora, init_lora_weights=False))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    ids = torch.randint(0, 64, (1, 8))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    return weakref.ref(model), weakref.ref(next(model.parameters()))


for dora in (False, True):
    model, param = trained(dora)
    gc.collect()
    print("use_dora", dora, "model freed", model() is None, "parameter freed", param() is None)
    assert model() is None and param() is None, "the model outlived its last reference"
assert not dora_dist._params and not dora_dist._units and not dora_dist._owners
dist.destroy_process_group()
print("ok")
"""


def test_fsdp2_dora_model_is_freed_once_deleted():
    """``dora_dist``'s tables of FSDP2's objects hold them weakly on both sides: with an FSDPParam (which holds its
    gathered parameter and its module) as a value under its own gathered parameter, a deleted FSDP2 DoRA model, its
    shards included, stayed alive for the rest of the process (LoRA's was freed). One gloo process, two steps."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, FREED_PORT=str(port))
    run = subprocess.run([sys.executable, "-c", _FREED_SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-4000:]
    assert "use_dora True model freed True parameter freed True" in run.stdout


def test_gather_rows_assembles_each_norm_from_every_ranks_rows(monkeypatch):
    """``dora_dist.gather_rows``: three norms of d_out 5, 4 and 7 over three ranks (torch.chunk's rows: 2, 2 and 3 per
    rank, the last ranks' short or empty, padded in the all-gather), with a stand-in all-gather that hands out every
    rank's rows (rank p's row i of norm k is 100·k + chunk_k·p + i): each norm comes back whole, in row order."""
    from types import SimpleNamespace

    from peft.tuners.lora import dora_dist

    world, d_outs = 3, (5, 4, 7)
    chunks = [-(-d // world) for d in d_outs]

    def rows_of(k, p):
        start, stop = min(d_outs[k], p * chunks[k]), min(d_outs[k], (p + 1) * chunks[k])
        return torch.arange(start, stop, dtype=torch.float32) + 100 * k

    def all_gather_into_tensor(out, send, group=None):
        for p in range(world):
            parts = [torch.cat([rows_of(k, p), torch.zeros(chunks[k] - rows_of(k, p).numel())]) for k in range(3)]
            out[p * send.numel() : (p + 1) * send.numel()] = torch.cat(parts)

    monkeypatch.setattr(dora_dist.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dora_dist.dist, "all_gather_into_tensor", all_gather_into_tensor)
    shards = [SimpleNamespace(group="g", chunk=c, d_out=d) for c, d in zip(chunks, d_outs)]
    parts = [rows_of(k, 1) for k in range(3)]  # this rank's own rows (rank 1: 2, 2 and 3 of them)
    norms = dora_dist.gather_rows(parts, shards)
    for k, norm in enumerate(norms):
        assert torch.equal(norm, torch.arange(d_outs[k], dtype=torch.float32) + 100 * k)
        assert norm.is_contiguous()
    short = [rows_of(k, 2) for k in range(3)]  # rank 2's rows: 1, 0 and 1 of them, padded into the send buffer
    assert [p.numel() for p in short] == [1, 0, 1]
    assert all(torch.equal(n, m) for n, m in zip(dora_dist.gather_rows(short, shards), norms))


def test_gather_whole_rows_assembles_each_matrix_from_every_ranks_rows(monkeypatch):
    """``dora_dist.gather_whole_rows`` (``PEFT_DORA_STEP_NORMS``' A matrices): matrices of 5, 2 and 7 rows (of 4, 3
    and 2 columns) over three ranks, each rank holding ``torch.chunk``'s rows (``own_row_range``: 2, 1 and 3 per
    rank, the last ranks' short or empty, padded in the all-gather), with a stand-in all-gather that hands out every
    rank's padded rows: each matrix comes back whole, in row order, from any rank's own rows."""
    from peft.tuners.lora import dora_dist

    world, shapes = 3, ((5, 4), (2, 3), (7, 2))
    whole = [torch.arange(n * d, dtype=torch.float32).view(n, d) + 100 * k for k, (n, d) in enumerate(shapes)]

    def own(k, p):
        return whole[k][slice(*dora_dist.own_row_range(shapes[k][0], p, world))]

    def all_gather_into_tensor(out, send, group=None):
        for p in range(world):
            padded = []
            for k, (n, d) in enumerate(shapes):
                rows = torch.zeros(-(-n // world), d)
                rows[: own(k, p).shape[0]] = own(k, p)
                padded.append(rows.view(-1))
            out[p * send.numel() : (p + 1) * send.numel()] = torch.cat(padded)

    monkeypatch.setattr(dora_dist.dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dora_dist.dist, "all_gather_into_tensor", all_gather_into_tensor)
    assert [own(k, 2).shape[0] for k in range(3)] == [1, 0, 1]  # rank 2: short and empty shards
    for p in range(world):
        got = dora_dist.gather_whole_rows([own(k, p) for k in range(3)], [n for n, _ in shapes], "g")
        assert all(torch.equal(g, w) for g, w in zip(got, whole))


def test_own_rows_are_computed_as_launched_norms(monkeypatch):
    """A rank's own rows of the sharded norm are launched anew every step (FSDP2's gathered W and A move), so
    ``_own_rows`` asks whether ``||W_p||²`` is kept and computes the rows inside ``dora_norm.eager_norms()``, where
    the one-pass kernel takes half adapters up to ``_KERNEL_MAX_RANK_EAGER``: both see the same rule."""
    from types import SimpleNamespace

    from peft.tuners.lora import dora, dora_norm
    from peft.tuners.lora.dora import DoraLinearLayer

    depths = []
    real_reusable, real_norm = dora_norm.w_sq_reusable, dora.factored_row_norm

    def reusable(*args):
        depths.append(("w_sq_reusable", dora_norm._eager.depth))
        return real_reusable(*args)

    def norm(*args, **kwargs):
        depths.append(("factored_row_norm", dora_norm._eager.depth))
        return real_norm(*args, **kwargs)

    monkeypatch.setattr(dora_norm, "w_sq_reusable", reusable)
    monkeypatch.setattr(dora, "factored_row_norm", norm)
    torch.manual_seed(0)
    weight, lora_A, lora_B = torch.randn(6, 5), torch.randn(3, 5), torch.randn(6, 3)
    shards = SimpleNamespace(start=2, stop=5, keys=(weight, lora_A, lora_B), versions=lambda: (0, 0, 0))
    rows = DoraLinearLayer(fan_in_fan_out=False)._own_rows(weight, lora_A, lora_B, 0.5, shards)
    assert [d for _, d in depths] == [1, 1] and [n for n, _ in depths] == ["w_sq_reusable", "factored_row_norm"]
    assert dora_norm._eager.depth == 0
    torch.testing.assert_close(rows, (weight + 0.5 * lora_B @ lora_A)[2:5].norm(dim=1))
