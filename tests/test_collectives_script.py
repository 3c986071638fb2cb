"""scripts/collectives.py: a table or JSON of predicted collectives; bad flags are one line, exit 2."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "collectives.py"), *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)


def test_json_rows_have_algorithm_and_nccl_tests_bandwidths():
    p = run("--cluster", "dgx-h100", "--ranks", "8,16", "--verbs", "allreduce,allgather", "--sizes", "1M,1G", "--json")
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        n = r["ranks"]
        f = 2 * (n - 1) / n if r["collective"] == "allreduce" else (n - 1) / n
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * f)
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert "/" in r["algorithm"]


def test_table():
    p = run("--cluster", "dgx-a100-80g", "--ranks", "8")
    assert p.returncode == 0, p.stderr
    assert "busbw" in p.stdout and "ring/Simple" in p.stdout


@pytest.mark.parametrize("args", [
    ("--cluster", "nope", "--ranks", "8"),
    ("--cluster", "dgx-h100", "--ranks", "1"),
    ("--cluster", "dgx-h100", "--ranks", "8", "--verbs", "gather"),
    ("--cluster", "dgx-h100", "--ranks", "8", "--sizes", "lots"),
    ("--cluster", "dgx-h100", "--bogus"),
])
def test_bad_flags_are_one_line(args):
    p = run(*args)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""
