"""tools/run_gpu_tests.py's host logic (the GPU runs themselves happen on the device): which files it runs, how it
balances them over groups of GPUs, and what it reads back from pytest's output."""

from pathlib import Path

from tools import run_gpu_tests as R


def test_gpu_test_files_are_the_marked_ones():
    files = R.gpu_test_files()
    names = {f.name for f in files}
    assert "test_dora_norm_triton_gpu.py" in names and "test_dora_fsdp2_gpu.py" in names
    assert "test_dora_norm.py" not in names  # CPU tests only
    assert not names & set(R.IGNORED)
    assert all("mark.gpu" in f.read_text() for f in files)


def test_split_balances_by_known_durations_and_keeps_every_file(tmp_path):
    files = []
    for name, size in (("a.py", 10), ("b.py", 10), ("c.py", 10), ("d.py", 4000)):
        path = tmp_path / name
        path.write_text("x" * size)
        files.append(path)
    groups = R.split(files, 2, {"a.py": 100.0, "b.py": 60.0, "c.py": 50.0})
    assert sorted(f.name for g in groups for f in g) == ["a.py", "b.py", "c.py", "d.py"]
    # d.py has no duration: 4000 bytes at the known files' 7 s per byte outweighs the rest, so it runs alone
    assert [sorted(f.name for f in g) for g in groups] == [["d.py"], ["a.py", "b.py", "c.py"]]
    assert R.split(files, 8, {}) and len(R.split(files, 8, {})) == 4  # no empty groups
    assert len(R.split(files, 0, {})) == 1


def test_reads_durations_and_totals_back():
    out = """
============================= slowest durations ==============================
12.50s call     tests/tuners/lora/test_dora_gpu.py::test_one[bf16]
0.50s setup    tests/tuners/lora/test_dora_gpu.py::test_one[bf16]
3.00s call     tests/tuners/lora/test_dora_fsdp2_gpu.py::test_two
1 failed, 40 passed, 3 skipped, 12 deselected, 2 errors in 20.1s
"""
    assert R.durations_by_file(out) == {"test_dora_gpu.py": 13.0, "test_dora_fsdp2_gpu.py": 3.0}
    assert R.totals(out) == {"failed": 1, "passed": 40, "skipped": 3, "deselected": 12, "errors": 2}
    # the summary's own per-file lines parse back the same way (the next run balances by them)
    assert R.durations_by_file("    13.00s call test_dora_gpu.py::(all)") == {"test_dora_gpu.py": 13.0}
    assert R.totals("no tests ran") == {}


def test_keeps_the_gist_of_each_failure():
    out = """
.F.
=================================== FAILURES ===================================
______________ test_direct_launches[bf16] ______________

    def test_direct_launches(adapters):
>       assert set(used) == expected, used
E       AssertionError: ['output', 'split']
E       assert {'split'} == {'one_pass_norm'}

tests/tuners/lora/test_dora_launch_gpu.py:53: AssertionError
============================ slowest durations =============================
E  not a failure line
=========================== short test summary info ============================
FAILED tests/tuners/lora/test_dora_launch_gpu.py::test_direct_launches[bf16]
1 failed, 2 passed in 3.0s
"""
    assert R.failure_lines(out) == [
        "______________ test_direct_launches[bf16] ______________",
        "E       AssertionError: ['output', 'split']",
        "E       assert {'split'} == {'one_pass_norm'}",
        "tests/tuners/lora/test_dora_launch_gpu.py:53: AssertionError",
    ]
    assert R.failure_lines("3 passed in 1.0s") == []
    many = "=== FAILURES ===\n" + "\n".join(f"E line {i}" for i in range(100))
    cut = R.failure_lines(many, limit=5)
    assert cut[:4] == [f"E line {i}" for i in range(4)] and cut[4] == "... 96 more failure lines"


def test_plan_runs_without_gpus(capsys):
    assert R.main(["--plan", "--groups", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("group ") == 2 and "test_dora_compile_gpu.py" in printed
    assert Path(R.__file__).parent.name == "tools"


def test_completed_counts_skip_a_killed_group_and_add_its_rerun():
    summary = """# first call
## group 0, GPUs 0,1, exit -9: a.py b.py
....................
## group 1, GPUs 2,3, exit 0: c.py
283 passed, 2 warnings in 335.79s (0:05:35)
## seconds per file (pytest --durations)
total: 283 passed in 500 s wall; FAILED
# second call
## group 0, GPUs 0,1, exit 0: a.py
======== 3 passed in 322.94s ========
## group 1, GPUs 2,3, exit 1: b.py
======== 1 failed, 133 passed in 130.91s ========
## seconds per file (pytest --durations)
total: 1 failed, 136 passed in 326 s wall; FAILED
"""
    counts, incomplete = R.completed_counts(summary)
    assert counts == {"passed": 419, "failed": 1} and incomplete == 1


def test_completed_counts_keep_a_group_killed_after_pytests_final_line():
    killed_in_exit = """## group 0, GPUs 0,1, exit -9: a.py
0.00s teardown tests/a.py::test_x
============ 456 passed, 6 skipped, 3 warnings in 539.53s (0:08:59) ============
## seconds per file (pytest --durations)
   204.48s call a.py::(all)
total: 456 passed, 6 skipped in 545 s wall; FAILED
"""
    assert R.completed_counts(killed_in_exit) == ({"passed": 456, "skipped": 6}, 0)
    # killed mid-run: the per-test lines hold counts-like text, but pytest's final line is missing
    killed_mid_run = "## group 0, GPUs 0,1, exit -9: a.py\ntests/a.py::test_y[3 passed] PASSED\n"
    assert R.completed_counts(killed_mid_run) == ({}, 1)
