"""Outputs are refused before the work that makes them, in one line, and never left half-written."""
import os
import sys

import pytest

from simexec.cli import main
from simexec.errors import OutputError, SimexecError
from simexec.outputs import check_output, write_atomic
from simexec.trace.schema import save_json

SIMULATE = ["simulate", "--model", "gpt-tiny", "--cluster", "local", "--plan", "dp=2,gbs=8"]


def test_check_output_accepts_new_files_and_folders_under_a_writable_folder(tmp_path):
    assert check_output(tmp_path / "a" / "b" / "out.json", "--json") == tmp_path / "a" / "b" / "out.json"
    assert check_output(tmp_path / "new-folder", "--out", folder=True) == tmp_path / "new-folder"
    (tmp_path / "old.json").write_text("{}")
    check_output(tmp_path / "old.json", "--json")  # replaced when written
    check_output(tmp_path, "--out", folder=True)


@pytest.mark.parametrize("case, folder, words", [
    ("dir", False, "is a folder, not a file"),
    ("file", True, "is a file, not a folder"),
    ("under-file", False, "is a file, not a folder"),
])
def test_check_output_refuses_what_cannot_be_written(tmp_path, case, folder, words):
    (tmp_path / "f").write_text("x")
    path = {"dir": tmp_path, "file": tmp_path / "f", "under-file": tmp_path / "f" / "deeper" / "out.json"}[case]
    with pytest.raises(OutputError, match=words) as exc:
        check_output(path, "--flag", folder=folder)
    assert str(exc.value).startswith(f"--flag {path}") and "\n" not in str(exc.value)
    assert issubclass(OutputError, SimexecError)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_check_output_refuses_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="not writable"):
            check_output(ro / "x" / "out.json", "--json")
    finally:
        ro.chmod(0o700)


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="cannot write"):
        write_atomic(tmp_path / "f" / "out.json", b"{}")
    with pytest.raises(OutputError, match="cannot write"):
        save_json({"a": 1}, tmp_path)  # a folder: the rename fails after the temporary file is written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]
    save_json({"a": 1}, tmp_path / "sub" / "ok.json.gz")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["ok.json.gz"]


@pytest.mark.parametrize("argv", [
    SIMULATE + ["--json", "{tmp}"],
    SIMULATE + ["--trace", "{tmp}/f/trace.json"],
    ["plot", "traces/local/dp1.r0.json.gz", "-o", "{tmp}"],
    ["compare", "traces/local/dp1.r0.json.gz", "traces/local/dp1.r1.json.gz", "--plot", "{tmp}"],
    ["compare", "traces/local/dp1.r0.json.gz", "traces/local/dp1.r1.json.gz", "--plot", "{tmp}/timelines.txt"],
    ["plot", "traces/local/dp1.r0.json.gz", "-o", "{tmp}/timeline.jpg"],
    ["calibrate", "traces", "traces/local/dp1.r0.json.gz", "--out", "{tmp}/f/p.json"],
    ["demo", "--out", "{tmp}/f"],
])
def test_commands_refuse_a_bad_output_before_they_run(tmp_path, capsys, monkeypatch, argv):
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    (tmp_path / "f").write_text("x")
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing simulated, compared, plotted or fitted first
    assert err.startswith("simexec: error: ") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


@pytest.mark.parametrize("script, argv", [
    ("validate_search", ["--json", "{tmp}"]),
    ("validate_published", ["--markdown", "{tmp}/f/table.md"]),
    ("validate_sweeps", ["--markdown", "{tmp}"]),
    ("validate_topologies", ["--json", "{tmp}"]),
    ("validate_calibration", ["--out", "{tmp}/f"]),
    ("bench_exec", ["--json", "{tmp}"]),
    ("record_traces", ["--from", "{tmp}", "--out", "{tmp}/f"]),
])
def test_long_scripts_refuse_a_bad_output_before_they_run(tmp_path, script, argv):
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "f").write_text("x")
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", f"{script}.py"),
                          *[a.replace("{tmp}", str(tmp_path)) for a in argv]],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 2
    assert out.stdout == "" and out.stderr.count("\n") == 1 and ": error: " in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_written_files_take_the_umask_like_open(tmp_path):
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "a.json", b"{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "a.json").read_bytes() == b"{}"


def test_knob_cost_refuses_a_bad_knob_in_one_line_before_it_runs():
    """`probe_host.py knob-cost` checks its plans with the simulator before it starts any rank."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def knob_cost(*args):
        return subprocess.run([sys.executable, os.path.join(root, "scripts", "probe_host.py"), "knob-cost", *args],
                              capture_output=True, text=True, timeout=120, cwd=root)

    out = knob_cost("--knob", "param_overlap=1", "dp=2,zero=3,gbs=8")
    assert out.returncode == 2
    assert out.stdout == "" and out.stderr.count("\n") == 1
    assert "param_overlap=1 needs zero=1 or 2, got zero=3" in out.stderr
    out = knob_cost("--knob", "mbs=2")  # no default plans for it
    assert out.returncode == 2 and "no default plans for --knob mbs=2" in out.stderr
