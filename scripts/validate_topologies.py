"""Does the simulator rank 3D topologies the way BigScience measured them for BLOOM-176B?

    python scripts/validate_topologies.py                                  # every run, a table on stdout
    python scripts/validate_topologies.py --markdown docs/validation.md    # and the table in the docs
    python scripts/validate_topologies.py --json out.json

The runs, their simulation and the checks are simexec.validation.topologies.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.outputs import outputs_refused, write_atomic  # noqa: E402
from simexec.validation.markdown import replace_block  # noqa: E402
from simexec.validation.topologies import (BEGIN, END, TIE, order_checks, read_runs, simulate_run, split,  # noqa: E402
                                           to_markdown)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", help="write the tables into this file (between their markers)")
    ap.add_argument("--json", help="write {'runs': [...], 'orders': [...]} here")
    args = ap.parse_args(argv)
    if outputs_refused("validate_topologies.py", {"--markdown": args.markdown, "--json": args.json}):
        return 2
    results = []
    for run in read_runs():
        r = simulate_run(run)
        results.append(r)
        measured = "OOM" if run["oom"] else f"{run['sec_per_it']:.2f} s"
        print(f"{r['model']:22s} {split(run):28s} measured {measured:>9s}  predicted {r['predicted_s']:7.2f} s"
              f"  peak {r['peak_gib']:5.1f} GiB {'fits' if r['fits'] else 'OOM '}"
              f"{'' if r['fit_agrees'] else '  (fit disagrees)'}  ({r['wall_s']:.0f} s)", flush=True)
    checks = order_checks(results)
    for c in checks:
        print(f"{c['model']}: {c['faster']} before {c['slower']}: measured {c['measured_ratio']:.3f}, "
              f"predicted {c['predicted_ratio']:.3f} {'holds' if c['holds'] else 'FAILS'}")
    if args.json:
        write_atomic(args.json, json.dumps({"tie": TIE, "runs": results, "orders": checks}, indent=1).encode())
    if args.markdown:
        replace_block(Path(args.markdown), to_markdown(results, checks, "python scripts/validate_topologies.py "
                                                                        f"--markdown {args.markdown}"),
                      BEGIN, END, new_doc="")
    ok = all(r["fit_agrees"] for r in results) and all(c["holds"] for c in checks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
