"""Predict published training runs (modern_runs.csv, sharded_dp_runs.csv), and compare.

The rows: the H100/H200/B200/GB200 runs of simexec/validation/data/modern_runs.csv, then the pure
sharded-data-parallel runs of data/sharded_dp_runs.csv (family sharded-dp, with its scaling trend).

    python scripts/validate_modern.py                                   # every row, a table on stdout
    python scripts/validate_modern.py --only mb2511-h100,tt2412 --json out.json
    python scripts/validate_modern.py --only megsc21,mpt-h100-7b          # some sharded-dp rows
    python scripts/validate_modern.py --markdown docs/validation.md     # rewrite the generated block

The rules mapping a row to a model, cluster, stack and plan, and the comparison, are simexec.validation.modern
and (sharded-dp rows) simexec.validation.sharded_dp.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.validation.modern import TABLE  # noqa: E402
from simexec.validation.table_script import run_table  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_table(TABLE, __doc__.splitlines()[0]))
