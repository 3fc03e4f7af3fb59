"""Train with ``examples/multi_gpu/train.py`` under each accelerate engine, then load every saved adapter on one
device with this package and with upstream PEFT, and check that both give the same logits.

    PEFT_OURS=/tmp/ours PEFT_UPSTREAM=/tmp/upstream python3 tools/engines_check.py \
        --engines fsdp1,zero2,zero3,fsdp2 --out $OUT/engines_check.txt

(``PEFT_OURS`` / ``PEFT_UPSTREAM``: ``pip install --no-deps --target`` directories of our wheel and the pinned
upstream wheel, each put first on ``PYTHONPATH`` for its own processes.) Per engine: ``accelerate launch
--config_file examples/multi_gpu/<engine>.yaml train.py`` with ours (``--size``, ``--layers``, ``--steps``,
``--seq-len``, ``--rank``; the config's process count unless ``--num-processes``), then ``load_check.py`` on the
adapter it saved, once with ours and once with upstream first on the path. A line per engine says the losses, both
logits sums and whether they agree (relative ``--rtol``); the exit status is nonzero if any engine failed to train,
to load or to agree. accelerate's FSDP and DeepSpeed engines need CUDA GPUs: this runs on the GPU machine.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "multi_gpu"
ENGINES = ("fsdp1", "zero2", "zero3", "fsdp2")
_LOGITS = re.compile(r"peft \S+ \((ours|upstream)\): logits sum (\S+) abs-sum (\S+)")
_LOSSES = re.compile(r"^losses: (\[.*\])$", re.M)


def parse_logits(text: str) -> dict | None:
    """``{"impl": ..., "sum": float, "abs_sum": float}`` from ``load_check.py``'s line, or None if it printed none."""
    m = _LOGITS.search(text)
    return None if m is None else {"impl": m.group(1), "sum": float(m.group(2)), "abs_sum": float(m.group(3))}


def agree(a: dict, b: dict, rtol: float) -> bool:
    """Both logits sums within ``rtol`` of each other, relative to the absolute sum (a signed sum can be near 0)."""
    scale = max(abs(a["abs_sum"]), abs(b["abs_sum"]), 1e-30)
    return abs(a["sum"] - b["sum"]) <= rtol * scale and abs(a["abs_sum"] - b["abs_sum"]) <= rtol * scale


def _env(install: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (install, env.get("PYTHONPATH", "")) if p)
    return env


def _run(cmd: list, env: dict, timeout: float) -> tuple[int, str]:
    try:
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # its output can arrive as bytes even with text=True
        out = e.stdout or ""
        return 124, out.decode(errors="replace") if isinstance(out, bytes) else out
    return done.returncode, done.stdout + done.stderr


def check_engine(engine: str, args, ours: str, upstream: str) -> tuple[bool, str]:
    """One engine: train, then the two loads; (ok, the report line and what failed)."""
    out_dir = Path(args.workdir) / engine
    model = ["--size", args.size, "--layers", str(args.layers), "--seed", "0"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(EXAMPLES / f"{engine}.yaml")]
    if args.num_processes:
        launch += ["--num_processes", str(args.num_processes)]
    train = launch + [str(EXAMPLES / "train.py"), *model, "--rank", str(args.rank), "--steps", str(args.steps),
                      "--seq-len", str(args.seq_len), "--output-dir", str(out_dir)]  # fmt: skip
    rc, text = _run(train, _env(ours), args.timeout_s)
    losses = _LOSSES.search(text)
    if rc != 0 or not (out_dir / "adapter_model.safetensors").exists():
        return False, f"{engine}: training failed (exit {rc})\n" + "\n".join(text.splitlines()[-15:])
    loads = {}
    for name, install in (("ours", ours), ("upstream", upstream)):
        check = [sys.executable, str(EXAMPLES / "load_check.py"), "--adapter", str(out_dir), *model]
        rc, text = _run(check, _env(install), args.timeout_s)
        loads[name] = parse_logits(text)
        if rc != 0 or loads[name] is None or loads[name]["impl"] != name:
            return False, f"{engine}: load with {name} failed (exit {rc})\n" + "\n".join(text.splitlines()[-15:])
    ok = agree(loads["ours"], loads["upstream"], args.rtol)
    line = (f"{engine}: {'ok' if ok else 'MISMATCH'}; losses {losses.group(1) if losses else '?'}; logits sum ours "
            f"{loads['ours']['sum']:.6e} upstream {loads['upstream']['sum']:.6e}; abs-sum ours "
            f"{loads['ours']['abs_sum']:.6e} upstream {loads['upstream']['abs_sum']:.6e}")  # fmt: skip
    return ok, line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--size", default="1b")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--num-processes", type=int, help="override the configs' process count")
    p.add_argument("--rtol", type=float, default=1e-5)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per launch")
    p.add_argument("--workdir", default="/tmp/engines_check")
    p.add_argument("--out", help="also write the report here")
    args = p.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not engines or set(engines) - set(ENGINES):
        raise SystemExit(f"--engines: choose from {', '.join(ENGINES)}")
    ours, upstream = os.environ.get("PEFT_OURS"), os.environ.get("PEFT_UPSTREAM")
    if not ours or not upstream:
        raise SystemExit("set PEFT_OURS and PEFT_UPSTREAM to the install directories of our wheel and upstream's")
    lines, all_ok = [], True
    for engine in engines:
        ok, line = check_engine(engine, args, ours, upstream)
        all_ok &= ok
        lines.append(line)
        print(line, flush=True)
    if args.out:
        head = f"# python3 tools/engines_check.py {' '.join(argv if argv is not None else sys.argv[1:])}"
        Path(args.out).write_text("\n".join([head, *lines]) + "\n")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
