"""tools/engines_check.py's host logic (the engines themselves run on GPUs): reading load_check.py's line, the
agreement rule, and one engine's flow of a training launch and two loads, with the launches stubbed."""

import pytest

from tools import engines_check as E


LINE = "peft 0.21.2 ({}): logits sum {} abs-sum {} first [1.0, 2.0]"


def test_reads_load_check_s_line_and_compares_relative_to_the_absolute_sum():
    ours = E.parse_logits("noise\n" + LINE.format("ours", "3.499688e+03", "2.959818e+06"))
    assert ours == {"impl": "ours", "sum": 3499.688, "abs_sum": 2959818.0}
    assert E.parse_logits("Traceback ...") is None
    same = dict(ours, sum=3499.7)  # 0.012 apart on an absolute sum of 3e6
    assert E.agree(ours, same, 1e-5)
    assert not E.agree(ours, dict(ours, sum=3600.0), 1e-5)
    assert not E.agree(ours, dict(ours, abs_sum=2.96e6 * 1.001), 1e-5)


def _args(tmp_path, **kw):
    base = dict(workdir=str(tmp_path), size="tiny", layers=1, rank=4, steps=2, seq_len=16, num_processes=2,
                timeout_s=5.0, rtol=1e-5)  # fmt: skip
    return type("Args", (), dict(base, **kw))


@pytest.mark.parametrize("upstream_sum", ["1.000000e+01", "2.000000e+01"])
def test_one_engine_trains_then_loads_with_each_package(tmp_path, monkeypatch, upstream_sum):
    calls = []

    def fake_run(cmd, env, timeout):
        calls.append((cmd, env["PYTHONPATH"].split(":")[0]))
        if any(str(c).endswith("train.py") for c in cmd):
            out = tmp_path / "fsdp2"
            out.mkdir(exist_ok=True)
            (out / "adapter_model.safetensors").write_bytes(b"")
            return 0, "engine: FSDP\nlosses: [1.0, 0.9]\n"
        impl = "ours" if env["PYTHONPATH"].startswith("/o") else "upstream"
        return 0, LINE.format(impl, "1.000000e+01" if impl == "ours" else upstream_sum, "5.000000e+02")

    monkeypatch.setattr(E, "_run", fake_run)
    ok, line = E.check_engine("fsdp2", _args(tmp_path), "/o", "/u")
    assert ok == (upstream_sum == "1.000000e+01") and line.startswith("fsdp2: ") and "[1.0, 0.9]" in line
    train, load_ours, load_upstream = calls
    assert "--num_processes" in train[0] and str(E.EXAMPLES / "fsdp2.yaml") in train[0] and train[1] == "/o"
    assert load_ours[1] == "/o" and load_upstream[1] == "/u" and "load_check.py" in load_ours[0][1]


def test_a_failed_launch_is_reported_with_its_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "_run", lambda cmd, env, timeout: (1, "RuntimeError: no CUDA GPUs are available"))
    ok, line = E.check_engine("zero3", _args(tmp_path), "/o", "/u")
    assert not ok and "training failed (exit 1)" in line and "no CUDA GPUs" in line
    with pytest.raises(SystemExit, match="choose from"):
        E.main(["--engines", "fsdp3"])
