"""Predict the published peak GPU memories of training runs, and compare.

    python scripts/validate_memory.py                                   # every row, a table on stdout
    python scripts/validate_memory.py --only tt2412 --json out.json
    python scripts/validate_memory.py --markdown docs/validation.md     # rewrite the generated block

The rows, what each measured and the comparison are simexec.validation.memory (the mapping: simexec.validation.modern).
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
from simexec.validation.memory import memory_rows, summary, summary_lines, to_markdown, update_markdown  # noqa: E402


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated row names or prefixes (e.g. mb2511-h100,tt2412)")
    ap.add_argument("--json", help="write {'rows': [...], 'summary': {...}} here")
    ap.add_argument("--markdown", help="write the table into this file (between its validate_memory markers)")
    args = ap.parse_args(argv)
    if outputs_refused("validate_memory.py", {"--json": args.json, "--markdown": args.markdown}):
        return 2
    keys = [k.strip() for k in args.only.split(",") if k.strip()] if args.only else None
    only = (lambda name: any(name == k or name.startswith(k) for k in keys)) if keys else None
    t0 = time.perf_counter()
    print(f"  {'row':<46} {'device':<6} {'stack':<19} {'measured':<10} {'pred':>7} {'meas':>7} {'error':>8}  plan")
    rows = memory_rows(only)
    s = summary(rows)
    for text in summary_lines(s):
        print(text)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        write_atomic(args.json, json.dumps({"rows": rows, "summary": s}, indent=1).encode())
    if args.markdown:
        cmd = "python scripts/validate_memory.py" + "".join(
            f" {flag} {val}" for flag, val in (("--only", args.only), ("--markdown", args.markdown)) if val)
        update_markdown(Path(args.markdown), to_markdown(rows, cmd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
