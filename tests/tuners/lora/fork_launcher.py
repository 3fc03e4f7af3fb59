"""A fork server for the runs of ``sharded_training_worker.py``: imports once, forks every launch's processes.

Each CPU launch of the worker (``torchrun`` with N gloo processes, or one plain process) spent most of its time
importing torch, transformers, PEFT and DeepSpeed in every process (~11 s each on CI's two cores, for a training run
of a few seconds): the sharded-training test files were two thirds of CI's time. This server does those imports
once, in the environment it was started with (so ``TRITON_INTERPRET``, ``PEFT_DORA_*`` and an upstream install's
``PYTHONPATH`` take effect at import as in a fresh process; one server per distinct environment), and then serves
launches: for each it forks N processes that run the worker's ``main()`` as ``torchrun`` would have started it
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of a free port, one intra-op thread per
process when N > 1, as torchrun sets ``OMP_NUM_THREADS``), each with its stdout and stderr in a file of its own.

Nothing but imports runs before the fork: no op has started an intra-op thread pool, no process group exists, and
the worker's module state is its import-time state in every launch. A server for CUDA launches (``--cuda``, the GPU
tests) imports torch and transformers only (on the 2x H200 host 5-7 s and 5-6 s per process; PEFT's 3 s import
initializes CUDA through bitsandbytes, after which a forked process cannot use CUDA), and first asks a forked child
whether it can use CUDA: where it cannot, the server says so and the tests launch with ``torchrun``.

Protocol (the test side is ``test_dora_fsdp2_cpu._Server``): the server's first line is ``{"ready": PID, "usable":
bool}``; then one JSON object per line on stdin, ``{"argv": [...],
"procs": N, "dist": torchrun's or not, "logs": DIR, "timeout": S}``; one JSON line back on the server's own stdout,
``{"returncodes": [...], "timed_out": bool}``, where a process killed by a signal has minus the signal's number, as
``subprocess`` reports it. A launch whose process fails gives the others ``GRACE_S`` to end (they may wait in a
collective for it), then kills them, as torchrun's agent does. The server ends when its stdin closes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
import traceback
from pathlib import Path


HERE = Path(__file__).resolve().parent
GRACE_S = 20.0


def _warm(cuda: bool) -> None:
    """What every launch imports, imported here once (nothing run). For CUDA launches torch and transformers only:
    PEFT imports bitsandbytes, whose import initializes CUDA, which a forked process cannot use then."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    if not cuda:
        import peft  # noqa: F401

        try:
            import deepspeed  # noqa: F401
        except ImportError:
            pass
    sys.path.insert(0, str(HERE))
    import sharded_training_worker  # noqa: F401


def _cuda_forks() -> bool:
    """Whether a process forked from here can use CUDA (nothing here has initialized it): asked of a forked child."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            import torch

            torch.zeros(1, device="cuda").add_(1).cpu()
            code = 0
        finally:
            os._exit(code)
    return os.waitpid(pid, 0)[1] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(argv: list, rank: int, procs: int, dist: bool, port: int, logs: Path) -> None:
    """In the forked process: the worker's main as rank ``rank`` of ``procs``; never returns."""
    code = 1
    try:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            out = os.open(logs / f"{name}_{rank}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, fd)
            os.close(out)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        sys.stdin = open(os.devnull)
        if dist:  # what torchrun sets (the launches without torchrun: one unsharded process)
            os.environ.update(
                RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(procs), LOCAL_WORLD_SIZE=str(procs),
                GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            )  # fmt: skip
        if procs > 1:
            import torch

            torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 for several processes per node
        import sharded_training_worker as worker

        sys.argv = [str(HERE / "sharded_training_worker.py"), *argv]
        code = worker.main()
    except SystemExit as e:  # argparse's errors, an explicit exit
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # the worker's own end (exit_now): no interpreter finalization


def _status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def launch(argv: list, procs: int, dist: bool, logs: Path, timeout: float) -> dict:
    logs.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    pids = []
    for rank in range(procs):
        pid = os.fork()
        if pid == 0:
            _child(argv, rank, procs, dist, port, logs)
        pids.append(pid)
    codes: dict = {}
    start, failed_at = time.monotonic(), None
    while len(codes) < procs:
        for rank, pid in enumerate(pids):
            if rank in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[rank] = _status(status)
                if codes[rank] != 0 and failed_at is None:
                    failed_at = time.monotonic()
        now = time.monotonic()
        if len(codes) < procs and (now - start > timeout or (failed_at is not None and now - failed_at > GRACE_S)):
            for rank, pid in enumerate(pids):
                if rank not in codes:
                    os.kill(pid, signal.SIGKILL)
                    codes[rank] = _status(os.waitpid(pid, 0)[1])
            return {"returncodes": [codes[r] for r in range(procs)], "timed_out": now - start > timeout}
        time.sleep(0.02)
    return {"returncodes": [codes[r] for r in range(procs)], "timed_out": False}


def serve(cuda: bool) -> None:
    # the protocol's channel is the original stdout; anything the imports or the server print goes to stderr
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    _warm(cuda)
    # a CUDA server whose children cannot use CUDA says so: its launches go to torchrun instead
    channel.write(json.dumps({"ready": os.getpid(), "usable": not cuda or _cuda_forks()}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        procs, dist = int(request["procs"]), bool(request["dist"])
        reply = launch(request["argv"], procs, dist, Path(request["logs"]), float(request["timeout"]))
        channel.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve(cuda="--cuda" in sys.argv[1:])
