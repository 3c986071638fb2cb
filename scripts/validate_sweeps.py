"""Does the simulator rank parallel configurations the way Megatron-LM SC'21 §5.4 measured them?

    python scripts/validate_sweeps.py                                  # every sweep, a table on stdout
    python scripts/validate_sweeps.py --markdown docs/validation.md    # and the table in the docs

The sweeps and their orderings are simexec.validation.sweeps.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.outputs import outputs_refused  # noqa: E402
from simexec.validation.markdown import replace_block  # noqa: E402
from simexec.validation.sweeps import BEGIN, END, SWEEPS, label, run_sweep, to_markdown  # noqa: E402


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", help="write the table into this file (between its markers)")
    args = ap.parse_args(argv)
    if outputs_refused("validate_sweeps.py", {"--markdown": args.markdown}):
        return 2
    results = []
    for s in SWEEPS:
        for gbs in s.batches:
            t0 = time.perf_counter()
            r = run_sweep(s, gbs)
            results.append(r)
            cells = ", ".join(f"{label(s, x['degree'])} {x['tflops']:.1f}" for x in r["rows"])
            print(f"figure {s.figure} batch {gbs:4d}: {cells}  [{s.expect}: {'holds' if r['holds'] else 'FAILS'}]"
                  f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    if args.markdown:
        replace_block(Path(args.markdown), to_markdown(results, f"python scripts/validate_sweeps.py --markdown "
                                                                f"{args.markdown}"), BEGIN, END, new_doc="")
    return 0 if all(r["holds"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
