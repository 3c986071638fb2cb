"""The published measured peak memories (simexec/validation/data/published_memory.csv) parse, and every row
is a layout a simulator can place: a known device, a parallel layout that divides the GPUs, a positive peak
and notes that say which peak it is (allocator's allocated or reserved, or nvidia-smi)."""
import re

import pytest

from simexec.validation.published import DATA, read_published_csv

CSV = DATA / "published_memory.csv"
MODERN_COLUMNS = list(read_published_csv(DATA / "modern_runs.csv")[0])
DEVICES = {"a100", "h100", "h200", "b200", "gb200", "mi300x"}


@pytest.fixture(scope="module")
def rows():
    return read_published_csv(CSV)


def test_same_columns_as_modern_runs_and_sources_named(rows):
    assert rows and list(rows[0]) == MODERN_COLUMNS
    header = CSV.read_text()
    assert all(f"# {r['source'].split(':')[0]}:" in header for r in rows)
    names = [r["name"] for r in rows]
    assert len(names) == len(set(names))


def test_every_row_is_a_placeable_layout_with_a_measured_peak(rows):
    for r in rows:
        assert r["device"] in DEVICES, r["name"]
        assert float(r["peak_mem_gib"]) > 0, r["name"]
        gpus, tp, pp, cp, mbs, gbs = (int(r[c]) for c in ("gpus", "tp", "pp", "cp", "mbs", "gbs"))
        assert gpus % (tp * pp * cp) == 0, r["name"]
        assert gbs % (gpus // (tp * pp * cp) * mbs) == 0, r["name"]
        assert re.match(r"(allocated|reserved|nvidia-smi)\b", r["notes"]), r["name"]
        assert bool(r["metric"]) == bool(r["value"]), r["name"]
