"""Predict published large-scale training results from their configurations alone, and compare.

    python scripts/validate_published.py                                  # every row, a table on stdout
    python scripts/validate_published.py --json out.json --markdown docs/validation.md
    python scripts/validate_published.py --only megatron-1.7b,megatron-18.4b,zero
    python scripts/validate_published.py --megatron-csv table.csv         # other GPT runs, same rule
    python scripts/validate_published.py --authors                        # Table 1 with the authors' mbs and vpp

The rows, the rule for what a paper leaves out and the comparison are simexec.validation.predictions;
the published tables and recipes simexec.validation.published.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.outputs import outputs_refused, write_atomic  # noqa: E402
from simexec.validation.predictions import all_rows, authors_table, summary, to_markdown, update_markdown  # noqa: E402


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write {'rows': [...]} here")
    ap.add_argument("--markdown", help="write the table into this file (between its markers)")
    ap.add_argument("--only", help="comma-separated row names or prefixes (e.g. megatron-1.7b,zero)")
    ap.add_argument("--megatron-csv", help="Megatron-style rows to predict instead of the built-in tables")
    ap.add_argument("--authors", action="store_true",
                    help="Table 1 with the authors' micro-batch sizes and interleaving instead of the rule")
    args = ap.parse_args(argv)
    if outputs_refused("validate_published.py", {"--json": args.json, "--markdown": args.markdown}):
        return 2
    if args.authors:
        authors_table()
        return 0
    keys = [k.strip() for k in args.only.split(",")] if args.only else None
    only = (lambda name: any(name == k or name.startswith(k) for k in keys)) if keys else None
    t0 = time.perf_counter()
    rows = all_rows(only, args.megatron_csv)
    s = summary(rows)
    if s:
        print(f"Megatron rows: median |error| {100 * s['median_abs_error']:.1f}%, "
              f"largest {100 * s['max_abs_error']:.1f}%  ({time.perf_counter() - t0:.0f} s)")
    if args.json:
        write_atomic(args.json, json.dumps({"rows": rows, "summary": s}, indent=1).encode())
    if args.markdown:
        cmd = "python scripts/validate_published.py" + "".join(
            f" {flag} {val}" for flag, val in (("--only", args.only), ("--megatron-csv", args.megatron_csv),
                                               ("--markdown", args.markdown)) if val)
        update_markdown(Path(args.markdown), to_markdown(rows, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
