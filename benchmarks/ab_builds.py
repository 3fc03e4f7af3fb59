"""Two (or more) builds of this package timed against each other at host-bound grid points, in one device call.

A change to DoRA's per-module host work moves the small steps' DoRA/LoRA ratio by less than the host's drift between
device calls, so the builds run in alternating ``profile_step.py`` subprocesses on one machine (build A, build B,
build A, build B, ... for ``--rounds`` rounds), each with its own install first on ``PYTHONPATH``; every subprocess
times LoRA, DoRA and LoRA again in one process, so each run's ratio is paired within its own process. The summary
gives, per point and build, every run's DoRA/LoRA wall ratio and DoRA's extra host time per module, and their medians.

    python3 benchmarks/ab_builds.py --builds old=/tmp/old,new=/tmp/ours --rounds 2 \\
        --points "llama3b bf16 r16 seq512 b1 all drop0;qwen1.5b bf16 r16 seq512 b1 all drop0" --out-dir $OUT
    python3 benchmarks/ab_builds.py --summarize benchmarks/results/profile/profile_step_record_ab_*.json

Each run writes ``<prefix>ab_<build>_<round>.json`` (``--summarize`` reads the build's name and the round from that
name) and the summary ``ab_builds.json``. A build directory holds an install made with ``pip install --no-deps
--target DIR``; the first directory on ``PYTHONPATH`` wins, so nothing else on it may hold a ``peft``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent
_NAME = re.compile(r"ab_(?P<build>[A-Za-z0-9.-]+)_(?P<round>\d+)\.json$")


def parse_builds(spec: str) -> list[tuple[str, str]]:
    """``name=dir,name=dir`` as ``[(name, dir)]``: at least two, names unique and fit for a file name."""
    builds = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        name, sep, path = part.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9.-]+", name) or not path:
            raise SystemExit(f"--builds: {part!r} is not name=dir (name of letters, digits, '.' or '-')")
        builds.append((name, path))
    if len(builds) < 2 or len({n for n, _ in builds}) != len(builds):
        raise SystemExit(f"--builds: two or more builds with different names are needed, got {spec!r}")
    return builds


def run(builds, points: str, rounds: int, out_dir: Path, extra: list[str]) -> list[Path]:
    """``profile_step.py`` per round and build, alternating; the JSONs written."""
    written = []
    for r in range(1, rounds + 1):
        for name, path in builds:
            out = out_dir / f"ab_{name}_{r}.json"
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
            cmd = [sys.executable, str(HERE / "profile_step.py"), "--points", points, "--out", str(out), *extra]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"build {name}, round {r}: profile_step.py failed\n{done.stderr[-3000:]}")
            for line in done.stdout.splitlines():
                if "DoRA/LoRA" in line:
                    print(f"{name} {r}: {line}", flush=True)
            written.append(out)
    return written


def summarize(paths) -> dict:
    """Per point and build: the runs' DoRA/LoRA wall ratios and extra host µs per module, in round order, with
    their medians, and which installed package each build imported (``profile_step``'s ``env.peft``)."""
    runs: dict = {}
    for path in sorted(Path(p) for p in paths):
        m = _NAME.search(path.name)
        if m is None:
            raise SystemExit(f"{path}: not an ab_<build>_<round>.json file")
        doc = json.loads(path.read_text())
        for label, point in doc["points"].items():
            entry = runs.setdefault(label, {}).setdefault(m["build"], {"rounds": [], "ratio": [], "extra_host_us": []})
            entry["rounds"].append(int(m["round"]))
            entry["ratio"].append(round(point["dora_over_lora_wall"], 4))
            entry["extra_host_us"].append(round(point["dora_extra_host_us_per_module"], 1))
            entry.setdefault("peft", doc["env"].get("peft"))
            entry.setdefault("gpu", doc["env"].get("gpu"))
    for builds in runs.values():
        for entry in builds.values():
            entry["ratio_median"] = round(statistics.median(entry["ratio"]), 4)
            entry["extra_host_us_median"] = round(statistics.median(entry["extra_host_us"]), 1)
    return runs


def table(summary: dict) -> str:
    names = sorted({b for builds in summary.values() for b in builds})
    head = "| point | " + " | ".join(f"{n}: DoRA/LoRA (median), extra host µs/module (median)" for n in names) + " |"
    lines = [head, "|" + " --- |" * (len(names) + 1)]
    for label, builds in summary.items():
        cells = []
        for n in names:
            e = builds.get(n)
            cells.append(
                "–"
                if e is None
                else f"{', '.join(f'{x:.2f}' for x in e['ratio'])} ({e['ratio_median']:.2f}); "
                f"{', '.join(f'{x:.0f}' for x in e['extra_host_us'])} ({e['extra_host_us_median']:.0f})"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--builds", help="name=install_dir,name=install_dir[,...]")
    p.add_argument("--points", help="';'-separated grid point labels (profile_step.py's --points)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-dir", default=".")
    p.add_argument("--summarize", nargs="+", metavar="JSON", help="only summarize these ab_<build>_<round>.json")
    p.add_argument("extra", nargs="*", help="after --: more profile_step.py arguments (e.g. --repeats 3)")
    args = p.parse_args(argv)
    if args.summarize:
        paths = args.summarize
    else:
        if not args.builds or not args.points:
            p.error("--builds and --points are needed unless --summarize")
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = run(parse_builds(args.builds), args.points, args.rounds, out_dir, args.extra)
    summary = summarize(paths)
    print(table(summary))
    if not args.summarize:
        (Path(args.out_dir) / "ab_builds.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
