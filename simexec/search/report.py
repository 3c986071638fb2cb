"""What a search reports: `SearchResult` (JSON and text table), the Pareto front, why the best wins."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from simexec.specs.cluster import GiB
from simexec.specs.plan import Plan, parse_plan
from simexec.search.space import AnyOf


def objective_attr(objective: str) -> str:
    """The result field an objective ranks plans by."""
    return "peak_memory_bytes" if objective == "memory" else "step_time_s"


def _bottleneck(breakdown: dict, step: float) -> str:
    """The largest share of the step that is not useful compute (compute if there is none)."""
    over = {k: v for k, v in breakdown.items() if k != "compute" and v > 0}
    if not over:
        return "compute"
    k = max(sorted(over), key=lambda x: over[x])
    if step <= 0:
        return k
    share = 100 * over[k] / step
    return f"{k} {share:.0f}%" if share >= 1 else f"{k} {share:.1f}%"


def entry(r: dict) -> dict:
    """A reported plan: a simulation's numbers and its bottleneck."""
    return {"plan": r["plan"], "step_time_s": r["step_time_s"], "tokens_per_s": r["tokens_per_s"],
            "tflops_per_gpu": r.get("tflops_per_gpu"), "mfu": r["mfu"],
            "peak_memory_bytes": r["peak_memory_bytes"], "fits": r["fits"],
            "bottleneck": _bottleneck(r.get("breakdown_s", {}), r["step_time_s"]),
            "breakdown_s": r.get("breakdown_s", {}), "memory_breakdown_bytes": r.get("memory_breakdown_bytes", {}),
            **{k: r[k] for k in ("days", "time_to_train") if k in r}}


def sort_key(objective: str):
    """Best first under `objective`; ties break on the other figure, then the plan string."""
    if objective == "memory":
        return lambda r: (r["peak_memory_bytes"], r["step_time_s"], r["plan"])
    return lambda r: (r["step_time_s"], r["peak_memory_bytes"], r["plan"])


def pareto_front(results: list[dict]) -> list[dict]:
    """Fitting plans no other fitting plan beats in both step time and peak memory (ties kept),
    fastest first."""
    pts = sorted((r for r in results if r.get("fits")), key=sort_key("throughput"))
    front: list[dict] = []
    best_mem = math.inf
    for r in pts:
        dominated = any(
            f["step_time_s"] <= r["step_time_s"] and f["peak_memory_bytes"] <= r["peak_memory_bytes"]
            and (f["step_time_s"] < r["step_time_s"] or f["peak_memory_bytes"] < r["peak_memory_bytes"])
            for f in front
        ) if r["peak_memory_bytes"] >= best_mem else False
        if not dominated:
            front.append(r)
            best_mem = min(best_mem, r["peak_memory_bytes"])
    return front


def _plan_diff(a: str, b: str) -> list[str]:
    pa, pb = parse_plan(a), parse_plan(b)
    out = []
    for name in Plan.model_fields:
        if name == "schedule":  # unset means the default for the plan's vpp: say which
            va, vb = pa.schedule_name, pb.schedule_name
        else:
            va, vb = getattr(pa, name), getattr(pb, name)
        if va != vb:
            out.append(f"{name} {_fmt_val(vb)} -> {_fmt_val(va)}")
    return out


def _fmt_val(v) -> str:
    if v is None:
        return "none"
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, tuple) and v and all(isinstance(x, str) for x in v):  # recompute_modules, as plans write it
        return "+".join(map(str, v))
    return str(v)


def explain(best: Optional[dict], runner: Optional[dict], objective: str = "throughput",
            other: str = "the runner-up") -> dict:
    """Why `best` beats `runner` (called `other` in the text): the difference of their breakdowns,
    largest first."""
    if best is None:
        return {"text": "no plan fits"}
    if runner is None:
        return {"best": best["plan"], "text": f"{best['plan']} is the only plan that fits"}
    keys = sorted(set(best["breakdown_s"]) | set(runner["breakdown_s"]))
    delta = {k: best["breakdown_s"].get(k, 0.0) - runner["breakdown_s"].get(k, 0.0) for k in keys}
    tiny = 1e-9 * max(best["step_time_s"], runner["step_time_s"], 1e-9)  # float rounding, not a difference
    delta = {k: v for k, v in sorted(delta.items(), key=lambda kv: (-abs(kv[1]), kv[0])) if abs(v) > tiny}
    dt = best["step_time_s"] - runner["step_time_s"]
    dm = best["peak_memory_bytes"] - runner["peak_memory_bytes"]
    changes = _plan_diff(best["plan"], runner["plan"])
    parts = [f"{k} {v:+.3g} s" for k, v in list(delta.items())[:4]]
    if objective == "memory":
        head = (f"best uses {-dm / GiB:.3g} GiB less peak memory than {other}"
                if dm < 0 else f"best ties {other} on peak memory and is faster")
    else:
        rel = -dt / runner["step_time_s"] if runner["step_time_s"] > 0 else 0.0
        head = (f"best is {-dt:.4g} s ({100 * rel:.2f}%) faster per step than {other}"
                if dt < 0 else f"best ties {other} on step time and needs less memory")
    short = other.removeprefix("the ")
    text = f"{head}; plan: {', '.join(changes) or 'same'}; breakdown (best - {short}): {', '.join(parts) or 'equal'}"
    return {"best": best["plan"], "runner_up": runner["plan"], "delta_step_time_s": dt,
            "delta_peak_memory_bytes": dm, "plan_changes": changes, "delta_breakdown_s": delta, "text": text}


def against_report(yours: dict, ok: list[dict], top: int, objective: str, complete: bool = True) -> dict:
    """A plan of the user's against the search's fitting plans `ok` (sorted, best first): its numbers,
    its rank where it is exact (the search ran to the end, `complete`, and fewer than `top` plans beat
    it: it simulated every plan that could), and why the best beats it."""
    key = sort_key(objective)
    mine = entry(yours)
    if not mine["fits"]:  # every plan that fits does better
        out = {**mine, "rank": None, "better_plans": len(ok) if len(ok) < top else f">= {top}"}
        if not ok:
            out["text"] = "no plan of the space fits either"
        else:
            best = entry(ok[0])
            out["explanation"] = explain(best, mine, objective, other="yours")
            out["text"] = (f"the best plan that fits takes {best['step_time_s']:.4g} s and "
                           f"{best['peak_memory_bytes'] / GiB:.2f} GiB; plan: "
                           f"{', '.join(out['explanation']['plan_changes']) or 'same'}")
        return out
    better = [r for r in ok if key(r) < key(yours) and r["plan"] != yours["plan"]]
    exact = len(better) < top and complete
    out = {**mine, "rank": len(better) + 1 if exact else None,
           "better_plans": len(better) if exact else f">= {min(len(better), top)}"}
    if not better:
        out["text"] = "no plan of the space beats it"
    else:
        out["explanation"] = explain(entry(better[0]), mine, objective, other="yours")
        out["text"] = out["explanation"]["text"]
    return out


@dataclass
class SearchResult:
    """What a search found. `plans`: the top fitting plans, best first (numbers as `simulate` gives them)."""

    model: str
    cluster: str
    gbs: int
    seq_len: int
    world: int
    objective: str
    top: int
    fix: dict
    plans: list[dict]
    pareto: list[dict]
    space: int  # combinations enumerated
    invalid: int  # refused by resolve
    candidates: int  # valid plans
    evaluated: int  # simulated
    pruned: int  # skipped by the time bound (and not on the Pareto front)
    oom: int  # known not to fit: by the memory bound or simulated
    oom_bound: int
    errors: int
    interrupted: bool
    explanation: dict
    capacity_bytes: float
    pareto_limit: Optional[float] = None  # the front covers plans up to this step time (peak memory)
    closest: Optional[dict] = None  # when nothing fits: the plan that comes closest
    error_examples: list = field(default_factory=list)  # the first plans the simulator refused, and why
    wall_s: float = 0.0
    bound_s: float = 0.0  # enumerating and bounding the space
    backend: str = ""
    workers: int = 1
    against: Optional[dict] = None  # the user's plan against the best (`against_report`)
    refusals: list = field(default_factory=list)  # the rules of `resolve` that refused the most (`SpaceStats`)
    robust: Optional[dict] = None  # the best plans re-ranked under a straggler (`simexec.search.robust`)
    time_to_train: Optional[dict] = None  # objective time-to-train: its pool and exactness (search/time_to_train.py)

    def to_json(self) -> dict:
        """JSON-ready; the same for the same inputs, whatever the backend (wall time left out)."""
        return {
            "model": self.model, "cluster": self.cluster, "gbs": self.gbs, "seq_len": self.seq_len,
            "world": self.world, "objective": self.objective, "top": self.top,
            "fix": {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.fix.items()},
            "plans": self.plans, "evaluated": self.evaluated, "pruned": self.pruned, "oom": self.oom,
            "oom_by_bound": self.oom_bound, "invalid": self.invalid, "space": self.space,
            "candidates": self.candidates, "errors": self.errors, "interrupted": self.interrupted,
            "refusals": self.refusals,
            "pareto": [{k: r[k] for k in ("plan", "step_time_s", "tokens_per_s", "peak_memory_bytes", "fits")}
                       for r in self.pareto],
            "pareto_limit": self.pareto_limit,
            "explanation": self.explanation, "closest": self.closest, "error_examples": self.error_examples,
            **({"against": self.against} if self.against is not None else {}),
            **({"robust": self.robust} if self.robust is not None else {}),
            **({"time_to_train": self.time_to_train} if self.time_to_train is not None else {}),
        }

    def format(self) -> str:
        lines = [
            f"search: {self.model} on {self.cluster} ({self.world} ranks), gbs {self.gbs}, seq {self.seq_len}, "
            f"objective {self.objective}" + (f", fixed {_fix_str(self.fix)}" if self.fix else ""),
            f"  {self.space:,} combinations, {self.invalid:,} invalid, {self.candidates:,} valid plans: "
            f"{self.oom_bound:,} cannot fit (bound), {self.pruned:,} pruned (time bound), "
            f"{self.evaluated:,} simulated ({self.oom - self.oom_bound:,} of them OOM)"
            + (f" in {self.wall_s:.1f} s ({self.backend}, {self.workers} workers)" if self.wall_s else ""),
        ]
        if self.interrupted:
            lines.append("  INTERRUPTED: the best plans found so far")
        if self.errors:
            first = self.error_examples[0] if self.error_examples else {}
            lines.append(f"  {self.errors} plan(s) failed to simulate, e.g. {first.get('plan')}: {first.get('error')}")
        if not self.candidates and not self.interrupted:
            lines.append(f"  no valid plan: every split of the {self.world} ranks breaks a rule of `resolve` (dp*tp*cp*pp"
                         f" = {self.world}, gbs {self.gbs} divisible by mbs*dp, heads by tp, ...); try another --gbs or --fix")
            for r in self.refusals:
                lines.append(f"    {r['combinations']:,} of {self.invalid:,}: {r['refusal']}")
            return "\n".join(lines)
        if not self.plans:
            lines.append(f"  no plan fits in {self.capacity_bytes / GiB:.1f} GiB")
            if self.closest:
                lines.append(f"  closest: {self.closest['plan']} needs {self.closest['peak_memory_bytes'] / GiB:.1f} GiB"
                             f" ({self.closest['how']})")
            return "\n".join(lines)
        lines.append("")
        lines.append(f"  top {len(self.plans)} by {self.objective}:")
        lines.append(_table(self.plans))
        lines += self._time_to_train_lines()
        lines.append("")
        if self.pareto_limit is not None:
            edge = (f"step time up to {self.pareto_limit:.4g} s" if self.objective != "memory"
                    else f"peak memory up to {self.pareto_limit / GiB:.2f} GiB")
        else:
            edge = "every fitting plan simulated"
        lines.append(f"  Pareto front, throughput vs peak memory ({edge}):")
        lines.append(_table(self.pareto, rank=False))
        lines.append("")
        lines.append("  why the best: " + self.explanation.get("text", ""))
        lines += self._against_lines()
        lines += self._robust_lines()
        return "\n".join(lines)

    def _time_to_train_lines(self) -> list[str]:
        t = self.time_to_train
        if t is None:
            return []
        how = ("exact: no plan outside them trains in fewer than "
               f"{t['outside_days_lower_bound']:.2f} days" if t["exact"] and t["outside_days_lower_bound"]
               else "exact" if t["exact"] else "not proven exact: a plan outside them could train faster")
        return [f"  days to train {t['tokens']:.3g} tokens with failures and checkpoints; the fastest "
                f"{t['pool']} plans ranked ({how})"]

    def _robust_lines(self) -> list[str]:
        if self.robust is None:
            return []
        from simexec.search.robust import RobustReport, RobustRow

        rows = [RobustRow(**r) for r in self.robust["plans"]]
        return ["", RobustReport(self.robust["spec"], self.robust["ranked_by"], rows).format()]

    def _against_lines(self) -> list[str]:
        a = self.against
        if a is None:
            return []
        fit = "fits" if a["fits"] else f"does not fit in {self.capacity_bytes / GiB:.1f} GiB"
        if a["rank"] is not None:
            where = f"rank {a['rank']}"
        elif self.interrupted:
            where = "unranked (interrupted)"
        elif a["fits"]:
            where = f"beyond the top {self.top} (--top shows more)"
        else:
            where = "unranked"
        return ["", f"  your plan: {a['plan']}: {a['step_time_s']:.4g} s, {a['peak_memory_bytes'] / GiB:.2f} GiB "
                f"({fit}), {where}", f"    {a['text']}"]


def _fix_str(fix: dict) -> str:
    """As --fix takes it: stages as a list, recompute_modules joined by +, alternatives by |."""
    def val(k: str, v) -> str:
        if isinstance(v, AnyOf):
            return "|".join(_fmt_val(x) for x in v)
        return ",".join(map(str, v)) if isinstance(v, tuple) and k == "stages" else _fmt_val(v)
    return ",".join(f"{k}={val(k, v)}" for k, v in fix.items())


def _table(rows: list[dict], rank: bool = True) -> str:
    days = rank and any("days" in r for r in rows)
    head = (f"  {'#':>3}  {'step s':>9}  {'tokens/s':>11}  {'MFU':>6}  {'peak GiB':>8}"
            + (f"  {'days':>8}" if days else "") + f"  {'bottleneck':<20}  plan")
    out = [head]
    for i, r in enumerate(rows, 1):
        out.append(
            f"  {i if rank else '':>3}  {r['step_time_s']:9.4g}  {r['tokens_per_s']:11,.0f}  {100 * r['mfu']:5.1f}%  "
            f"{r['peak_memory_bytes'] / GiB:8.2f}" + (f"  {r.get('days', math.nan):8.3f}" if days else "")
            + f"  {r.get('bottleneck', ''):<20}  {r['plan']}"
        )
    return "\n".join(out)

