"""Published peak GPU memories of training runs, predicted from their configurations, and compared.

Rows: the runs of `modern_runs.csv` that publish a peak (`peak_mem_gib`), and `published_memory.csv`, rows in
the same columns whose notes open with what was measured: `allocated` (torch.cuda.max_memory_allocated),
`reserved` (max_memory_reserved) or `nvidia-smi`. torchtitan's benchmark peaks are reserved: its metrics
log `torch.cuda.max_memory_reserved` (torchtitan/components/metrics.py, `DeviceMemoryMonitor`).

Each row is mapped to a model, cluster, stack and plan by `simexec.validation.modern`'s one rule. A reserved
or nvidia-smi peak is held against the predicted peak (`SimResult.peak_memory_bytes`: tensors, the caching
allocator's share and the runtime's workspace); an allocated one against the tensors alone
(`peak_tensor_bytes`). A published run trained, so it fit: a prediction that it does not fit is a wrong
verdict, counted apart.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable, Optional

from simexec.errors import SpecError
from simexec.validation.markdown import replace_block
from simexec.validation.modern import CSV as MODERN_CSV, simulate_row
from simexec.validation.published import DATA, read_published_csv
from simexec.validation.table_script import Table, predicted_rows

CSV = DATA / "published_memory.csv"
KINDS = ("allocated", "reserved", "nvidia-smi")
TORCHTITAN_KIND = "reserved"
GiB = 2**30


def measured_kind(r: dict) -> str:
    """What a row's peak is: the first word of its notes in published_memory.csv; torchtitan's is reserved."""
    first = r["notes"].split(";")[0].split()[0].lower() if r["notes"].strip() else ""
    if first in KINDS:
        return first
    if r["stack"].startswith("torchtitan"):
        return TORCHTITAN_KIND
    raise SpecError(f"row {r['name']}: notes must open with one of {', '.join(KINDS)}, got {r['notes'][:40]!r}")


def memory_rows_from_files(paths: tuple[Path, ...] = (MODERN_CSV, CSV)) -> list[dict]:
    """The rows of `paths` (those that exist) with a published peak."""
    return [r for p in paths if Path(p).is_file() for r in read_published_csv(p) if r.get("peak_mem_gib")]


def predict_memory(r: dict) -> dict:
    """One result row: status ok | refused, the mapping, predicted and measured GiB, and the verdicts."""
    out = {"name": r["name"], "source": r["source"], "device": r["device"], "stack": r["stack"],
           "measured_gib": float(r["peak_mem_gib"]), "kind": "", "status": "ok", "reason": "", "plan": "",
           "predicted_gib": None, "error": None, "fits": None}
    try:
        out["kind"] = measured_kind(r)
    except SpecError as exc:
        out.update(status="refused", reason=str(exc))
        return out
    t0 = time.perf_counter()
    res = simulate_row(r, out)
    if res is None:
        return out
    predicted = res.peak_tensor_bytes if out["kind"] == "allocated" else res.peak_memory_bytes
    out.update(predicted_gib=predicted / GiB, error=predicted / GiB / out["measured_gib"] - 1.0, fits=res.fits,
               capacity_gib=res.memory_capacity_bytes / GiB, sim_wall_s=time.perf_counter() - t0,
               breakdown_gib={k: round(v / GiB, 2) for k, v in res.memory_breakdown_bytes.items()})
    return out


def memory_rows(only: Optional[Callable[[str], bool]] = None, log=print,
                paths: tuple[Path, ...] = (MODERN_CSV, CSV)) -> list[dict]:
    return predicted_rows(memory_rows_from_files(paths), predict_memory, line, only, log)


def line(o: dict) -> str:
    if o["status"] != "ok":
        return f"  {o['name']:<46} {o['device']:<6} {o['stack']:<19} {o['status']}: {o['reason']}"
    verdict = "" if o["fits"] else "  WRONG VERDICT: predicted not to fit"
    return (f"  {o['name']:<46} {o['device']:<6} {o['stack']:<19} {o['kind']:<10} {o['predicted_gib']:7.1f} "
            f"{o['measured_gib']:7.1f} {100 * o['error']:+7.1f}%  {o['plan']}{verdict}")


def summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return {}
    errors = [r["error"] for r in ok]
    return {"rows": len(ok), "refused": len(rows) - len(ok),
            "median_abs_error": statistics.median(abs(e) for e in errors),
            "within_10pct": sum(abs(e) <= 0.10 for e in errors) / len(errors),
            "median_error": statistics.median(errors),
            "wrong_verdicts": [r["name"] for r in ok if not r["fits"]]}


def summary_lines(s: dict) -> list[str]:
    if not s:
        return ["no row compared"]
    wrong = s["wrong_verdicts"]
    return [f"{s['rows']} rows compared ({s['refused']} refused): median |error| {100 * s['median_abs_error']:.1f}%, "
            f"{100 * s['within_10pct']:.0f}% within 10%, median error {100 * s['median_error']:+.1f}%; "
            f"wrong fits verdicts: {len(wrong)}" + (f" ({', '.join(wrong)})" if wrong else "")]


BEGIN, END = "<!-- validate_memory:begin -->", "<!-- validate_memory:end -->"


def to_markdown(rows: list[dict], command: str) -> str:
    lines = [BEGIN, "", f"Generated by `{command}`.", "",
             "| row | device | stack | measured | plan | predicted (GiB) | measured (GiB) | error |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: |"]
    for r in rows:
        plan = f"`{r['plan']}`" if r["plan"] else ""
        if r["status"] == "ok":
            nums = f"{r['predicted_gib']:.1f} | {r['measured_gib']:.1f} | {100 * r['error']:+.1f}%"
            if not r["fits"]:
                nums += " (predicted not to fit)"
        else:
            nums = f" | {r['measured_gib']:.1f} | {r['status']}: {r['reason']}"
        lines.append(f"| {r['name']} | {r['device']} | {r['stack']} | {r['kind']} | {plan} | {nums} |")
    lines += ["", summary_lines(summary(rows))[0] + ".", "", END]
    return "\n".join(lines)


def update_markdown(path: Path, block: str) -> None:
    replace_block(path, block, BEGIN, END, new_doc="# Validation against published results\n\n")


TABLE = Table("validate_memory.py", f"  {'row':<46} {'device':<6} {'stack':<19} {'measured':<10} {'pred':>7} {'meas':>7} "
              f"{'error':>8}  plan", lambda only: memory_rows(only), summary, summary_lines, to_markdown, update_markdown)
