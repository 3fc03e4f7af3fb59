"""``benchmarks/ab_builds.py``: builds alternate round by round, each with its own install first on PYTHONPATH, and
the summary keeps every run's ratio and extra host time per point and build, with their medians."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from dora_testing import REPO_ROOT


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import ab_builds  # noqa: E402


def _fake_profile(calls):
    """``subprocess.run`` for profile_step.py: writes a record whose ratio says which build and round ran."""

    def fake(cmd, env, capture_output, text):
        out = cmd[cmd.index("--out") + 1]
        build = env["PYTHONPATH"].split(":")[0]
        calls.append((build, out, cmd[cmd.index("--points") + 1], cmd[cmd.index("--out") + 2 :]))
        n = len(calls)
        points = {"p1": {"dora_over_lora_wall": 1.0 + n / 10, "dora_extra_host_us_per_module": 100.0 * n}}
        doc = {"env": {"peft": build.rsplit("/", 1)[-1], "gpu": None}, "points": points}
        with open(out, "w") as f:
            json.dump(doc, f)
        return subprocess.CompletedProcess(cmd, 0, "p1: DoRA/LoRA wall 1.1, extra host 100 us per module\n", "")

    return fake


def test_builds_alternate_and_the_summary_keeps_every_run(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(ab_builds.subprocess, "run", _fake_profile(calls))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    ab_builds.main(["--builds", "old=/b/old,new=/b/new", "--points", "p1", "--rounds", "2",
                    "--out-dir", str(tmp_path), "--", "--repeats", "3"])  # fmt: skip
    assert [c[0] for c in calls] == ["/b/old", "/b/new", "/b/old", "/b/new"]  # alternating, each first on the path
    assert all(c[2] == "p1" and c[3] == ["--repeats", "3"] for c in calls)
    summary = json.loads((tmp_path / "ab_builds.json").read_text())
    assert summary["p1"]["old"]["ratio"] == [1.1, 1.3] and summary["p1"]["new"]["ratio"] == [1.2, 1.4]
    assert summary["p1"]["old"]["extra_host_us"] == [100.0, 300.0]
    assert summary["p1"]["new"]["ratio_median"] == 1.3 and summary["p1"]["old"]["extra_host_us_median"] == 200.0
    assert summary["p1"]["new"]["peft"] == "new"
    # the committed runs' files summarize the same way, by the build and round in their names
    again = ab_builds.summarize(sorted(tmp_path.glob("ab_*_*.json")))
    assert again["p1"]["new"]["extra_host_us"] == summary["p1"]["new"]["extra_host_us"]
    assert "| p1 |" in ab_builds.table(again)


@pytest.mark.parametrize("spec", ["old=/a", "old=/a,old=/b", "old/x=/a,new=/b", "old,new=/b"])
def test_bad_build_lists_are_refused(spec):
    with pytest.raises(SystemExit, match="--builds"):
        ab_builds.parse_builds(spec)


def test_a_file_not_named_by_build_and_round_is_refused(tmp_path):
    path = tmp_path / "profile_step.json"
    path.write_text("{}")
    with pytest.raises(SystemExit, match="ab_<build>_<round>"):
        ab_builds.summarize([path])
