"""The command line the validation scripts over published rows share: `--only`, `--json`, `--markdown`.

A script names its table (`Table`: how to predict the rows and how to summarise and print them) and
calls `run_table`; `predicted_rows` is the loop every table predicts its rows with.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from simexec.outputs import outputs_refused, write_atomic

Only = Optional[Callable[[str], bool]]


@dataclass(frozen=True)
class Table:
    """One validation table: its script's name, the header line its rows print under, and its functions."""

    script: str  # e.g. "validate_modern.py"
    header: str
    rows: Callable[[Only], list[dict]]
    summary: Callable[[list[dict]], dict]
    summary_lines: Callable[[dict], list[str]]
    to_markdown: Callable[[list[dict], str], str]
    update_markdown: Callable[[Path, str], None]


def predicted_rows(rows: Iterable[dict], predict: Callable[[dict], dict], line: Callable[[dict], str],
                   only: Only = None, log=print) -> list[dict]:
    """`predict` of every row whose name `only` keeps, each printed (`line`) as it comes."""
    out = []
    for r in rows:
        if only and not only(r["name"]):
            continue
        o = predict(r)
        out.append(o)
        log(line(o))
    return out


def run_table(table: Table, description: str, argv: Optional[list[str]] = None) -> int:
    """Parse the flags, predict the rows, print them and their summary, write what was asked for."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--only", help="comma-separated row names or prefixes")
    ap.add_argument("--json", help="write {'rows': [...], 'summary': {...}} here")
    ap.add_argument("--markdown", help="write the table into this file (between its markers)")
    args = ap.parse_args(argv)
    if outputs_refused(table.script, {"--json": args.json, "--markdown": args.markdown}):
        return 2
    keys = [k.strip() for k in args.only.split(",") if k.strip()] if args.only else None
    only = (lambda name: any(name == k or name.startswith(k) for k in keys)) if keys else None
    t0 = time.perf_counter()
    print(table.header)
    rows = table.rows(only)
    s = table.summary(rows)
    for text in table.summary_lines(s):
        print(text)
    print(f"({time.perf_counter() - t0:.0f} s)")
    if args.json:
        write_atomic(args.json, json.dumps({"rows": rows, "summary": s}, indent=1).encode())
    if args.markdown:
        cmd = f"python scripts/{table.script}" + "".join(
            f" {flag} {val}" for flag, val in (("--only", args.only), ("--markdown", args.markdown)) if val)
        table.update_markdown(Path(args.markdown), table.to_markdown(rows, cmd))
    return 0
