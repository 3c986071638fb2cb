"""Predict the published peak GPU memories of training runs, and compare.

    python scripts/validate_memory.py                                   # every row, a table on stdout
    python scripts/validate_memory.py --only tt2412 --json out.json
    python scripts/validate_memory.py --markdown docs/validation.md     # rewrite the generated block

The rows, what each measured and the comparison are simexec.validation.memory (the mapping:
simexec.validation.modern).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.validation.memory import TABLE  # noqa: E402
from simexec.validation.table_script import run_table  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_table(TABLE, __doc__.splitlines()[0]))
