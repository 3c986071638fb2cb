"""The device memory file (traces/gpu/device_memory.json): one row per GPU model of what CUDA reports
and what the runtime, cuBLAS and NCCL take before any tensor (`scripts/device_memory.py` measures a row)."""
from __future__ import annotations

import json
from pathlib import Path

COMMAND = "python scripts/device_memory.py --out FILE"


def read_rows(path: Path) -> list[dict]:
    """The rows already in `path` (none if it is missing); ValueError names a file not in this shape."""
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())["rows"]
        if not all(isinstance(r, dict) and "gpu" in r for r in rows):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{path} is not a device memory file (a JSON object whose \"rows\" each name a \"gpu\")")
    return rows


def keep_row(path: Path, row: dict) -> None:
    """Add `row` to the rows of `path` (made if missing), replacing an earlier row of the same GPU."""
    rows = [r for r in read_rows(path) if r["gpu"] != row["gpu"]] + [row]
    path.write_text(json.dumps({"command": COMMAND, "rows": rows}, indent=1) + "\n")
