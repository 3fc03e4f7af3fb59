"""Run the GPU test suite (``pytest -m gpu``) split over pairs of GPUs at once, and write one summary.

    PYTHONPATH=<our install> python3 tools/run_gpu_tests.py --out $OUT/gpu_tests_summary.txt [--groups N] [--plan]

A multi-GPU machine counts its whole held time, and one pytest process leaves all but two of its GPUs idle (the
two-process tests need two). Here each group gets two GPUs (``CUDA_VISIBLE_DEVICES`` "0,1", "2,3", ...; or one each
with ``--gpus-per-group 1``, for files without two-process tests) and a share
of the test files that hold GPU tests, and the groups run at once; ``torchrun --standalone`` in the multi-process
tests picks free ports, so their process groups never meet. Files are balanced by their durations in the newest
committed summary that lists them (pytest's ``--durations=0`` lines, which every run of this script keeps), else by
size. The summary names the command, each group's GPUs, files, last pytest lines, the gist of each failure and the
exit status, the per-file durations and the totals; the exit status is nonzero if any group failed or collected nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests" / "tuners" / "lora"
RESULTS = REPO / "benchmarks" / "results"
IGNORED = ("test_dora_other_quant.py",)  # hqq and torchao are not installed where the GPU tests run
PYTEST = ["-m", "gpu", "-v", "-rfE", "-p", "no:cacheprovider", "--durations=0", "--durations-min=0"]
_DURATION = re.compile(r"^\s*([\d.]+)s\s+(?:call|setup|teardown)\s+(\S+?\.py)::")
_TOTALS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected)")
_ERROR_AT = re.compile(r"^\S+\.py:\d+: \w+")
# pytest's last line, printed once every test has run: "==== 456 passed, 6 skipped ... in 539.53s (0:08:59) ===="
_FINAL = re.compile(r"^=+ .*\d+ (?:passed|failed|errors?|skipped|deselected).* in [\d.]+s\b.*=+$", re.M)


def gpu_test_files(root: Path = TESTS, ignored=IGNORED) -> list[Path]:
    """The test files under ``root`` that mark tests ``gpu`` (by their text), without ``ignored``."""
    return sorted(
        p for p in root.glob("test_*.py") if p.name not in ignored and "mark.gpu" in p.read_text(encoding="utf-8")
    )


def durations_by_file(text: str) -> dict[str, float]:
    """Seconds per test file (its basename) from pytest's ``--durations`` lines in ``text``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _DURATION.match(line)
        if m:
            name = Path(m.group(2)).name
            out[name] = out.get(name, 0.0) + float(m.group(1))
    return out


def known_durations(results: Path = RESULTS) -> dict[str, float]:
    """Per-file durations from the committed GPU test summaries: each file's longest (a fresh clone's files share
    one mtime, so "newest" cannot be told; the longest keeps a group from running past its limit)."""
    out: dict[str, float] = {}
    for path in sorted(results.glob("gpu_tests_*.txt")):
        for name, secs in durations_by_file(path.read_text(encoding="utf-8", errors="replace")).items():
            out[name] = max(secs, out.get(name, 0.0))
    return out


def split(files: list[Path], groups: int, weights: dict[str, float]) -> list[list[Path]]:
    """``files`` in ``groups`` lists of about equal weight (longest first, each to the lightest group). A file without
    a known duration weighs its size in bytes scaled to the known ones (or just its size where none is known)."""
    known = [weights[f.name] for f in files if f.name in weights]
    sizes = {f: f.stat().st_size for f in files}
    per_byte = sum(known) / max(1, sum(sizes[f] for f in files if f.name in weights)) if known else 1.0
    weight = {f: weights.get(f.name, sizes[f] * per_byte) for f in files}
    out: list[list[Path]] = [[] for _ in range(max(1, groups))]
    load = [0.0] * len(out)
    for f in sorted(files, key=lambda f: (-weight[f], f.name)):
        i = load.index(min(load))
        out[i].append(f)
        load[i] += weight[f]
    return [g for g in out if g]


def totals(text: str) -> dict[str, int]:
    """pytest's final counts (passed, failed, errors, skipped, deselected) from its output."""
    last = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    found: dict[str, int] = {}
    for n, what in _TOTALS.findall(last[-1] if last else ""):
        found["errors" if what.startswith("error") else what] = int(n)
    return found


def ran_to_end(code: int, text: str) -> bool:
    """Whether a group's pytest ran every test: its exit status says so (0 all passed, 1 some failed), or a signal
    (this script's limit) killed it after pytest printed its final line, when only the interpreter's exit was cut."""
    return code in (0, 1) or (code < 0 and _FINAL.search(text) is not None)


def completed_counts(summary: str) -> tuple[dict[str, int], int]:
    """The counts of the groups whose pytest ran to its end in one or more summaries of this script (concatenated, as
    when a group killed at its limit was run again), and how many groups did not (a killed group's counts are
    partial). A group killed after pytest printed its final line ran every test: only its interpreter's exit was
    cut, so it counts."""
    counts: dict[str, int] = {}
    incomplete = 0
    for block in re.split(r"^(?=## group \d+, )", summary, flags=re.M)[1:]:
        code = re.match(r"## group \d+, .*?exit (-?\d+)", block)
        output = block.split("## seconds per file")[0]
        if code is None or not ran_to_end(int(code.group(1)), output):
            incomplete += 1
            continue
        for k, v in totals(output).items():
            counts[k] = counts.get(k, 0) + v
    return counts, incomplete


def write_headline(summary_path: Path, headline: Path = RESULTS / "headline.json") -> dict:
    """``gpu_tests_passed``, ``gpu_tests_failed`` and ``gpu_tests_skipped`` in ``headline`` from a committed summary's
    completed groups (a machine with one GPU skips the two-GPU tests), and ``gpu_tests_summary`` naming it (through
    the benchmarks' own read-modify-write, ``bench_model.write_headline``)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_model  # standard library only at import

    counts, _ = completed_counts(summary_path.read_text(encoding="utf-8"))
    values = {
        "gpu_tests_passed": counts.get("passed", 0),
        "gpu_tests_failed": counts.get("failed", 0) + counts.get("errors", 0),
        "gpu_tests_skipped": counts.get("skipped", 0),
        "gpu_tests_summary": summary_path.name,
    }
    return bench_model.write_headline("gpu", values, headline)


def failure_lines(text: str, limit: int = 40) -> list[str]:
    """The gist of each failure in pytest's output: its header (``____ test ____``), its ``E`` lines and the
    ``file:line: Error`` line that ends it, at most ``limit`` lines in all (a summary must say why, not only what)."""
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"^=+ (FAILURES|ERRORS) =+$", line):
            inside = True
        elif re.match(r"^=+ .*(short test summary|warnings summary|slowest).*=+$", line):
            inside = False
        elif inside and (re.match(r"^_{3,} .* _{3,}$", line) or line.startswith("E ") or _ERROR_AT.match(line)):
            out.append(line)
    return out if len(out) <= limit else out[: limit - 1] + [f"... {len(out) - limit + 1} more failure lines"]


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="the summary file (default: print only)")
    p.add_argument("--groups", type=int, help="groups of GPUs (default: the GPUs here // --gpus-per-group, at least 1)")
    p.add_argument(
        "--gpus-per-group",
        type=int,
        choices=(1, 2),
        default=2,
        help="2 (default: the two-process tests need two) or 1, for files without two-process tests",
    )
    p.add_argument("--timeout-s", type=float, default=3000.0, help="per group")
    p.add_argument("--plan", action="store_true", help="print the groups and stop")
    p.add_argument(
        "--headline-of",
        metavar="SUMMARY",
        help="write gpu_tests_* into results/headline.json from this committed summary, and stop",
    )
    p.add_argument("--files", nargs="+", help="only these test files (names under tests/tuners/lora)")
    args = p.parse_args(argv)
    if args.headline_of:
        print(write_headline(Path(args.headline_of)))
        return 0
    files = gpu_test_files()
    if args.files:
        unknown = sorted(set(args.files) - {f.name for f in files})
        if unknown:
            p.error(f"not GPU test files: {' '.join(unknown)}")
        files = [f for f in files if f.name in args.files]
    per = args.gpus_per_group
    groups = args.groups or max(1, _gpu_count() // per)
    gpus = [",".join(str(per * i + j) for j in range(per)) for i in range(groups)]
    weights = known_durations()
    plan = split(files, groups, weights)
    for i, group in enumerate(plan):
        print(f"group {i} (GPUs {gpus[i]}): {' '.join(f.name for f in group)}")
    if args.plan:
        return 0
    logs, procs, start = [], [], time.monotonic()
    for i, group in enumerate(plan):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[i])
        log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_tests_group{i}.log", "w+", encoding="utf-8")
        cmd = [sys.executable, "-m", "pytest", *PYTEST, *(str(f.relative_to(REPO)) for f in group)]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, args.timeout_s - (time.monotonic() - start))))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    wall = time.monotonic() - start
    lines = [
        f"# python3 tools/run_gpu_tests.py: pytest {' '.join(PYTEST)}, {len(plan)} group(s) of {per} GPU(s) at once"
    ]
    grand: dict[str, int] = {}
    per_file: dict[str, float] = {}
    texts = []
    for i, (group, log, code) in enumerate(zip(plan, logs, codes)):
        log.seek(0)
        text = log.read()
        log.close()
        texts.append(text)
        counts = totals(text)
        for k, v in counts.items():
            grand[k] = grand.get(k, 0) + v
        per_file.update(durations_by_file(text))
        tail = [line for line in text.splitlines() if line.strip()][-6:]
        lines.append(f"## group {i}, GPUs {gpus[i]}, exit {code}: {' '.join(f.name for f in group)}")
        lines += tail
        lines += failure_lines(text)
    lines.append("## seconds per file (pytest --durations)")
    lines += [f"{per_file[name]:9.2f}s call {name}::(all)" for name in sorted(per_file, key=per_file.get, reverse=True)]
    summary = ", ".join(f"{v} {k}" for k, v in sorted(grand.items()))
    ok = (
        all(code == 0 or (code < 0 and ran_to_end(code, text)) for code, text in zip(codes, texts))
        and not grand.get("failed")
        and not grand.get("errors")
        and grand.get("passed", 0) > 0
    )
    lines.append(f"total: {summary} in {wall:.0f} s wall; {'ok' if ok else 'FAILED'}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
