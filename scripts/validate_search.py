"""Does the plan search find published plans (Megatron-LM SC'21 Tables 1 and 2, BLOOM-176B), and do at least as well?

    python scripts/validate_search.py                                 # every row, a table on stdout
    python scripts/validate_search.py --rows 1.7b,3.6b,7.5b           # a few rows
    python scripts/validate_search.py --json out.json --markdown docs/validation.md

The rows and their checks are simexec.validation.plan_search (criteria (a) and (b) in its doc).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.outputs import outputs_refused, write_atomic  # noqa: E402
from simexec.validation.plan_search import (MARKERS, TOLERANCE, check_row, plan_rank, rows_all, short_plan,  # noqa: E402
                                            to_markdown, update_markdown)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated rows, by name or size (megatron-18.4b or 18.4b); default all")
    ap.add_argument("--json", help="write {'rows': [...]} here")
    ap.add_argument("--markdown", help="write the table into this file (between its markers)")
    ap.add_argument("--workers", type=int, default=1, help="local processes per search (default 1)")
    args = ap.parse_args(argv)
    if outputs_refused("validate_search.py", {"--json": args.json, "--markdown": args.markdown}):
        return 2
    rows = rows_all()
    if args.rows:
        keys = {k.strip().removeprefix("megatron-") for k in args.rows.split(",")}
        rows = [r for r in rows if r["name"].removeprefix("megatron-") in keys]
        if not rows:
            print(f"no row matches {args.rows!r}", file=sys.stderr)
            return 2
    results = []
    for row in rows:
        r = check_row(row, args.workers)
        results.append(r)
        if not r["fits"]:
            print(f"{r['name']:16s} published {r['tp']}x{r['pp']} does not fit  ({r['wall_s']:.0f} s)", flush=True)
            continue
        print(f"{r['name']:16s} published {r['tp']}x{r['pp']}: rank {r['rank']}/{r['pairs']} (plan {plan_rank(r)}), "
              f"{r['published_plan']['step_time_s']:.4g} s vs best {r['best_2021']['step_time_s']:.4g} s "
              f"({short_plan(r['best_2021']['plan'])}), gap {100 * r['gap']:.1f}%; all knobs free "
              f"{r['unconstrained']['step_time_s']:.4g} s; {'PASS' if r['pass'] else 'FAIL'}  "
              f"({r['simulated']} simulated, {r['wall_s']:.0f} s)", flush=True)
    if args.json:
        write_atomic(args.json, json.dumps({"tolerance": TOLERANCE, "rows": results}, indent=1, default=str).encode())
    if args.markdown:
        cmd = "python scripts/validate_search.py" + (f" --rows {args.rows}" if args.rows else "") \
            + f" --markdown {args.markdown}"
        for group in MARKERS:
            ran = [r for r in results if r["group"] == group]
            if ran:
                update_markdown(Path(args.markdown), to_markdown(ran, cmd, group), group)
    return 0 if all(r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
