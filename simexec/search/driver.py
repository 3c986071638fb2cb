"""`search`: find the fastest plan that fits, by simulating only the plans that could win.

1. **Space** (`simexec.search.space`): every plan of the model on the cluster, as structures (the
   split of the compute) times state variants (ZeRO stage and flavour, HSDP, offload), each checked
   by `resolve`.
2. **Bounds** (`simexec.search.bounds`), per plan, without simulating: a lower bound on its peak
   memory (over capacity: counted as `oom` unsimulated) and on its step time, the latter refined by
   replaying the pipeline schedule for the plans the first bound does not rule out.
3. **Order and prune**: plans are simulated in order of their time bound (memory bound for the
   memory objective), refined when they reach the head of the queue, in waves of `WAVE`. A plan is
   skipped (`pruned`) when its bound is past the K-th best found so far and it cannot be on the
   Pareto front either: past the window (`pareto_window`, by default none beyond the K-th best), or
   a simulated plan is at least as fast as its time bound and at least as small as its memory bound,
   strictly better on one. So the top K and the Pareto front inside the window are those an
   exhaustive search finds. With a `limit` (say, a known plan's step time) every plan bounded past
   it is skipped too: only plans that can beat it are simulated.
4. **Parallel** (`simexec.search.runners`): waves go to local processes (spawn) or Ray tasks; a
   wave's plans and the pruning after it do not depend on which worker ran what, so serial, local
   and Ray searches return identical results, run after run. Ties break on (step time, peak memory,
   plan string). Local processes also share the first bounds, each enumerating and bounding the
   structures of its (tp, cp) pairs while this process enumerates the space for the plans and the
   counts; a bound is a function of its plan alone, so the result is the serial search's.

A plan's numbers are those of `simexec.sim.simulate.simulate` on its plan string, to the last digit: the
search parses the string it reports and simulates exactly that. `simexec.search.report` formats
the result.
"""
from __future__ import annotations

import heapq
import math
import sys
import time
from typing import Any, Callable, Optional, Union

from simexec.specs.cluster import ClusterSpec, GiB, get_cluster
from simexec.errors import PlanError
from simexec.specs.model import ModelSpec, get_model
from simexec.specs.plan import Plan, validate_fields, load_plan, resolve, split_pairs
from simexec.specs.stack import StackSpec, get_stack
from simexec.search.bounds import Bounds, Candidate
from simexec.search.robust import RobustSpec
from simexec.sim.goodput import GoodputParams
from simexec.search.report import (SearchResult, against_report, entry, explain, objective_attr, pareto_front,
                                   sort_key)
from simexec.search.runners import Context, evaluate, make_runner
from simexec.search.space import ALTERNATIVE_KEYS, Allowed, AnyOf, SpaceStats, search_world, structures

WAVE = 16  # plans simulated between two pruning decisions (fixed: results must not depend on workers)
TIME_TO_TRAIN_POOL = 3  # objective time-to-train: the fastest top x 3 plans are ranked by days
PARETO_WINDOW = 0.0  # the Pareto front is exact over plans as fast as the K-th best (widen: pareto_window)
OBJECTIVES = ("throughput", "memory", "time-to-train")


# ---------------------------------------------------------------------------------------------------
# --fix
# ---------------------------------------------------------------------------------------------------

_OPTIONAL = {name for name, f in Plan.model_fields.items() if f.default is None}


def parse_fix(text: str) -> dict:
    """`tp=8,pp=4,recompute=full` -> {"tp": 8, "pp": 4, "recompute": "full"}, typed as `Plan` types them.

    Any `Plan` field may be pinned; `none` unsets an optional one (`recompute_layers=none`);
    `stages=` takes every following bare integer, as in plan strings. A knob the space enumerates
    may take alternatives, `tp=4|8` -> {"tp": AnyOf((4, 8))}. Raises PlanError on bad input.
    """
    if not isinstance(text, str):
        raise PlanError(f"--fix takes key=value pairs, got {text!r}")
    raw = split_pairs(text, f"--fix {text!r}")
    if not raw:
        raise PlanError(f"--fix {text!r}: no key=value pairs")
    return normalize_fix(raw, where=f"--fix {text!r}")


def normalize_fix(fix: Optional[dict], where: str = "fix") -> dict:
    """Check and type a dict of pinned plan fields (strings as on the command line, or typed values)."""
    if not fix:
        return {}
    fields: dict[str, Any] = {}
    choices: dict[str, AnyOf] = {}
    for key, val in fix.items():
        if key not in Plan.model_fields:
            raise PlanError(f"{where}: unknown key {key!r}; keys: {', '.join(Plan.model_fields)}")
        if isinstance(val, AnyOf) or (isinstance(val, str) and "|" in val):
            choices[key] = _alternatives(key, val, where)
            continue
        if isinstance(val, str) and val.strip().lower() in ("none", "null", "") and key in _OPTIONAL:
            fields[key] = None
            continue
        if key == "stages" and isinstance(val, str):
            try:
                val = tuple(int(v) for v in val.split(","))
            except ValueError:
                raise PlanError(f"{where}: stages takes integers, got {val!r}") from None
        fields[key] = val
    typed = {k: v for k, v in fields.items() if v is not None}
    plan = validate_fields(dict(typed), where)  # types and ranges, one-line PlanError
    out = {k: (getattr(plan, k) if fields[k] is not None else None) for k in fields}
    for key, alts in choices.items():  # one distinct value is a plain pin
        out[key] = alts if len(alts) > 1 else alts[0]
    return {k: out[k] for k in fix}


def _alternatives(key: str, val: Any, where: str) -> AnyOf:
    """`4|8` (or an AnyOf) for `key`: each value typed and checked as a pin of its own, repeats dropped."""
    if key not in ALTERNATIVE_KEYS:
        raise PlanError(f"{where}: {key} takes one value; alternatives (a|b) are for the knobs the search "
                        f"enumerates: {', '.join(sorted(ALTERNATIVE_KEYS))}")
    items = [v.strip() for v in val.split("|")] if isinstance(val, str) else list(val)
    if not items or any(v == "" for v in items):
        raise PlanError(f"{where}: {key}={val!r} has an empty alternative")
    typed = []
    for v in items:
        if v is None or (isinstance(v, str) and v.lower() in ("none", "null")):
            if key not in _OPTIONAL:
                raise PlanError(f"{where}: {key} cannot be none")
            typed.append(None)
        else:
            typed.append(getattr(validate_fields({key: v}, f"{where}, alternative {v!r}"), key))
    return AnyOf(dict.fromkeys(typed))



# ---------------------------------------------------------------------------------------------------
# The search
# ---------------------------------------------------------------------------------------------------


def search(model: Union[str, ModelSpec], cluster: Union[str, ClusterSpec], gbs: int, *, seq_len: Optional[int] = None,
           top: int = 10, objective: str = "throughput", fix: Optional[dict] = None, profile: Any = None,
           ray_address: Optional[str] = None, workers: Optional[int] = None, progress: bool = True,
           pareto_window: float = PARETO_WINDOW, prune: bool = True, limit: Optional[float] = None,
           simulator: Optional[Callable] = None, against: Optional[str] = None,
           stack: Union[str, StackSpec, None] = None, memory_margin_bytes: float = 0.0,
           robust: Optional[RobustSpec] = None, tokens: Optional[float] = None,
           goodput_params: Optional[GoodputParams] = None) -> SearchResult:
    """Search the plans of `model` on `cluster` at global batch `gbs` (sequences).

    top: plans to return; objective: "throughput" (shortest step) or "memory" (smallest peak);
    fix: plan fields pinned to one value, or knobs the space enumerates to a choice (`AnyOf`; see
    `parse_fix`); profile: a calibrated profile, as for
    `simulate`; ray_address: run the simulations as Ray tasks on that cluster ("auto", an address,
    or "local" to start a Ray instance here) instead of local processes; workers: local processes
    (default: the CPU count; 1 = in this process); progress: a progress bar on stderr.
    pareto_window: the Pareto front is exact over the plans at most this fraction slower
    (throughput) or larger (memory) than the best, and over all plans as good as the K-th best.
    prune: False simulates every plan that might fit (brute force, for checks).
    limit: only plans at least this good matter (a step time in seconds, or peak bytes under the
    memory objective), e.g. a known plan's: plans bounded past it are not simulated, so the top K
    are exact among the plans within the limit (fewer may come back).
    simulator: stand-in for `simexec.sim.simulate.simulate` (tests; runs in this process).
    against: a plan of the user's, a string or a plan file (its gbs, when given, the search's): simulated first, it
    becomes the limit when it fits, and the result says where it ranks and why the best beats it.
    stack: the framework the plans run on (`megatron-core`, `torchtitan`, ... or a file): prices them as it
    runs them, and the space holds only the knobs it can run (`StackSpec.search_choices`, under `fix`);
    None: the default stack, every knob.
    memory_margin_bytes: device memory every plan must leave free; the bounds prune and the simulations judge
    with the same capacity less the margin.
    robust: also re-simulate the best `top` x 3 plans with a straggler (`simexec.search.robust`) and rank
    them by the straggled step (`result.robust`).
    tokens, goodput_params: for objective "time-to-train": plans ranked by the days to train `tokens`
    with failures and checkpoints (`simexec.search.time_to_train`).
    Ctrl-C stops the search and returns the best plans so far, `interrupted` set. Local processes
    use the spawn start method: a script that calls `search` needs `if __name__ == "__main__":`.
    """
    t0 = time.perf_counter()
    if objective not in OBJECTIVES:
        raise PlanError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if objective == "time-to-train":
        if tokens is None:
            raise PlanError("--objective time-to-train needs --tokens N (the tokens to train, e.g. 15e12)")
        if not tokens > 0:
            raise PlanError(f"--tokens must be > 0, got {tokens:g}")
        (goodput_params or GoodputParams()).check()
    elif tokens is not None:
        raise PlanError("--tokens ranks plans by the days to train: it needs --objective time-to-train")
    if isinstance(gbs, bool) or not isinstance(gbs, int) or gbs <= 0:
        raise PlanError(f"global batch must be a positive integer, got {gbs!r}")
    if isinstance(top, bool) or not isinstance(top, int) or top <= 0:
        raise PlanError(f"top must be a positive integer, got {top!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers <= 0):
        raise PlanError(f"workers must be a positive integer (1: in this process), got {workers!r}")
    if not pareto_window >= 0:
        raise PlanError(f"pareto_window must be >= 0, got {pareto_window!r}")
    if limit is not None and not limit > 0:
        raise PlanError(f"limit must be positive, got {limit!r}")
    cut = math.inf if limit is None else limit
    # a name is loaded as `simexec simulate` loads it (the sequence length can size a learned position table)
    model = model if isinstance(model, ModelSpec) else get_model(model, seq_len=seq_len)
    cluster = cluster if isinstance(cluster, ClusterSpec) else get_cluster(cluster)
    if memory_margin_bytes:
        usable = cluster.device.memory_bytes - memory_margin_bytes
        if not (memory_margin_bytes > 0 and usable > 0):
            raise PlanError(f"memory margin {memory_margin_bytes / 2**30:g} GiB must be positive and below the device's"
                            f" {cluster.device.memory_bytes / 2**30:.2f} GiB")
        cluster = cluster.model_copy(update={"device": cluster.device.model_copy(update={"memory_bytes": usable})})
    fix = normalize_fix(fix)
    if stack is not None:
        stack = stack if isinstance(stack, StackSpec) else get_stack(stack)
        unknown = sorted(set(stack.search_choices) - ALTERNATIVE_KEYS)
        if unknown:
            raise PlanError(f"stack {stack.name}: search_choices names {', '.join(unknown)}; the search enumerates "
                            f"{', '.join(sorted(ALTERNATIVE_KEYS))}")
        fix = {**{k: Allowed(tuple(v)) for k, v in stack.search_choices.items()}, **fix}
    if fix.get("gbs") not in (None, gbs):
        raise PlanError(f"fix gbs={fix['gbs']} contradicts the global batch {gbs}")
    fix.pop("gbs", None)
    seq = model.seq_len if seq_len is None else seq_len
    if seq <= 0:
        raise PlanError(f"sequence length must be positive, got {seq}")
    bound_cluster = cluster
    if profile is not None:
        from simexec.sim.profile import apply_profile

        bound_cluster = apply_profile(cluster, profile)

    wanted = objective
    if objective == "time-to-train":  # simulate the fastest top x POOL, then rank them by days
        objective, top = "throughput", top * TIME_TO_TRAIN_POOL
    if robust is not None and robust.slow is not None:  # a bad --robust spec fails before the search
        from simexec.sim.slowdown import parse_slow

        parse_slow(robust.slow, search_world(cluster, fix), cluster.node.gpus_per_node or search_world(cluster, fix))
    yours = None
    if against is not None:
        yours = _evaluate_against(against, model, cluster, gbs, seq, seq_len, profile, simulator, stack)
        if yours["fits"]:
            cut = min(cut, yours[objective_attr(objective)])

    # 1. the space, with bounds: shared among local worker processes, which then simulate
    ctx = Context(model, cluster, seq_len, profile, stack)
    stats = SpaceStats()
    bounds = Bounds(model, bound_cluster, seq)
    cands: list[Candidate] = []
    interrupted = False
    runner = None
    try:
        runner = make_runner(ctx, simulator=simulator, ray_address=ray_address, workers=workers, local_only=True)
        if runner is not None:
            cands = _bound_by_workers(runner, model, bound_cluster, gbs, seq, fix, stats, stack)
        else:
            for st in structures(model, bound_cluster, gbs, seq, fix, stats, stack=stack):
                cands.extend(bounds.candidates(st, len(cands)))
    except KeyboardInterrupt:  # nothing simulated yet: an empty, interrupted result
        interrupted = True
        cands = []
    capacity = bound_cluster.device.memory_bytes
    bound_s = time.perf_counter() - t0
    fitting = [c for c in cands if c.mem_lb <= capacity]
    oom_bound = len(cands) - len(fitting)
    # Simulate in order of the bound of the objective (ties: the estimate, then the enumeration), so
    # that the K-th best settles early. Under throughput a plan's bound is refined (the replay) when
    # it reaches the head of the queue, and it goes back in with the refined bound.
    bound_attr = "mem_lb" if objective == "memory" else "time_lb"

    def order_key(c: Candidate) -> tuple:
        return (getattr(c, bound_attr), c.est, c.order)

    queue = [(order_key(c), c.order, c) for c in fitting]
    heapq.heapify(queue)
    refine_on_pop = prune and objective == "throughput"

    # 2. simulate in waves, pruning between them
    if runner is None or interrupted or not fitting:
        if runner is not None:
            runner.close(interrupted)
        runner = make_runner(ctx, simulator=simulator, ray_address=ray_address, workers=workers,
                             serial=interrupted or not fitting)
    bar = _progress(len(fitting), progress)
    results: list[dict] = []
    ok: list[dict] = []
    pruned = 0
    key = sort_key(objective)
    try:
        while queue and not interrupted:
            wave: list[Candidate] = []
            kth, edge = _limits(ok, top, objective, pareto_window)
            while len(wave) < WAVE and queue:
                head, _, c = queue[0]
                if refine_on_pop and not c.refined:
                    bounds.refine(c)
                    heapq.heapreplace(queue, (order_key(c), c.order, c))
                    continue
                heapq.heappop(queue)
                if prune and head[0] > min(max(kth, edge), cut):
                    # every plan left is bounded at least as far out: none can matter any more
                    pruned += 1 + len(queue)
                    bar.update(1 + len(queue))
                    queue.clear()
                    break
                if prune and _prunable(c, kth, edge, ok, objective, bounds):
                    pruned += 1
                    bar.update(1)
                    continue
                wave.append(c)
            if not wave:
                continue
            got: list[dict] = []

            def on_result(r: dict) -> None:
                got.append(r)
                bar.update(1)

            runner.map([c.plan_string for c in wave], on_result)
            got.sort(key=lambda r: r["plan"])
            results.extend(got)
            ok.extend(r for r in got if "error" not in r and r["fits"])
            ok.sort(key=key)
            if ok:
                bar.set_postfix_str(f"best {ok[0]['step_time_s']:.4g} s" if objective == "throughput"
                                    else f"best {ok[0]['peak_memory_bytes'] / GiB:.2f} GiB")
    except KeyboardInterrupt:
        interrupted = True
    finally:
        runner.close(interrupted)
        bar.close()
    errors = sum(1 for r in results if "error" in r)
    oom_sim = sum(1 for r in results if "error" not in r and not r["fits"])
    ok.sort(key=key)
    entries = [entry(r) for r in ok[:top]]
    kth, edge = _limits(ok, top, objective, pareto_window)
    limit = max(kth, edge) if ok else None
    attr = objective_attr(objective)
    front_rows = [entry(r) for r in pareto_front([r for r in ok if r[attr] <= limit])] if ok else []
    ttt = None
    if wanted == "time-to-train":  # the fastest top x POOL, ranked by days; the front stays over them
        from simexec.search.time_to_train import rank_by_days

        ttt = rank_by_days(ok[:top], ctx, tokens, goodput_params or GoodputParams(), complete=not interrupted,
                           keep=top // TIME_TO_TRAIN_POOL, whole=len(ok) < top)
        top //= TIME_TO_TRAIN_POOL
        entries = [entry(r) for r in ttt.ranked[:top]]
    explanation = explain(entries[0] if entries else None, entries[1] if len(entries) > 1 else None,
                          objective)
    closest = None if entries else _closest(results, cands, capacity)
    robust_rows = None
    if robust is not None and ok:
        from simexec.search.robust import ROBUST_POOL, robust_report

        pool = ok[:top * ROBUST_POOL] if ttt is None else ttt.ranked[:top * ROBUST_POOL]
        robust_rows = robust_report([entry(r) for r in pool], ctx, robust).to_json()
    return SearchResult(
        model=model.name, cluster=cluster.name, gbs=gbs, seq_len=seq, world=search_world(cluster, fix),
        objective=wanted, top=top, fix=fix, plans=entries, pareto=front_rows,
        pareto_limit=None if limit is None or math.isinf(limit) else limit, space=stats.combinations,
        invalid=stats.invalid, refusals=stats.most_often(), candidates=len(cands), evaluated=len(results), pruned=pruned,
        oom=oom_bound + oom_sim, oom_bound=oom_bound, errors=errors, interrupted=interrupted,
        explanation=explanation, capacity_bytes=capacity, closest=closest, wall_s=time.perf_counter() - t0,
        bound_s=bound_s, backend=runner.name, workers=runner.workers,
        error_examples=sorted((r for r in results if "error" in r), key=lambda r: r["plan"])[:3],
        against=against_report(yours, ok, top, objective, not interrupted) if yours is not None else None,
        robust=robust_rows, time_to_train=ttt.to_json() if ttt is not None else None,
    )


def _evaluate_against(text: str, model: ModelSpec, cluster: ClusterSpec, gbs: int, seq: int,
                      seq_len: Optional[int], profile: Any, simulator: Optional[Callable],
                      stack: Optional[StackSpec] = None) -> dict:
    """The user's plan (`search(against=...)`), checked as `simulate` checks it and simulated."""
    plan = load_plan(text)
    if plan.gbs is None:
        plan = plan.model_copy(update={"gbs": gbs})
    elif plan.gbs != gbs:
        raise PlanError(f"--against plan has gbs={plan.gbs}, the search's global batch is {gbs}")
    text = resolve(model, cluster, plan, seq, stack).plan.to_string()  # dp filled in; a one-line PlanError
    r = evaluate(text, Context(model, cluster, seq_len, profile, stack), simulator)
    if "error" in r:
        raise PlanError(f"--against plan {text}: {r['error']}")
    return r


def _closest(results: list[dict], cands: list[Candidate], capacity: float) -> Optional[dict]:
    """When nothing fits: the simulated plan with the smallest peak, else the smallest memory bound."""
    sims = [r for r in results if "error" not in r]
    if sims:
        r = min(sims, key=lambda r: (r["peak_memory_bytes"], r["plan"]))
        return {"plan": r["plan"], "peak_memory_bytes": r["peak_memory_bytes"],
                "how": f"simulated, {(r['peak_memory_bytes'] - capacity) / GiB:.2f} GiB over"}
    if cands:
        c = min(cands, key=lambda c: (c.mem_lb, c.order))
        return {"plan": c.plan_string, "peak_memory_bytes": c.mem_lb,
                "how": f"lower bound, at least {(c.mem_lb - capacity) / GiB:.2f} GiB over"}
    return None


def _limits(ok: list[dict], top: int, objective: str, window: float) -> tuple[float, float]:
    """(the K-th best so far, the edge of the Pareto window around the best): infinite until K
    plans fit."""
    if len(ok) < top:
        return math.inf, math.inf
    attr = objective_attr(objective)
    return ok[top - 1][attr], ok[0][attr] * (1.0 + window)


def _bound_by_workers(runner, model: ModelSpec, cluster: ClusterSpec, gbs: int, seq: int, fix: dict,
                      stats: SpaceStats, stack: Optional[StackSpec] = None) -> list[Candidate]:
    """The first bounds of every plan, the space shared among the runner's workers while this process
    enumerates it (for the structures and the counts); in the order, and with the values, of the
    serial enumeration."""
    futures = runner.first_bounds(gbs, seq, fix)
    sts = list(structures(model, cluster, gbs, seq, fix, stats, stack=stack))
    parts = [iter(f.result()) for f in futures]
    cands: list[Candidate] = []
    for st in sts:
        for state, (est, time_lb, mem_lb) in zip(st.states, next(parts[st.pair % len(parts)])):
            cands.append(Candidate(est, time_lb, mem_lb, len(cands), st, state))
    return cands


def _prunable(c: Candidate, kth: float, edge: float, ok: list[dict], objective: str, bounds: Bounds) -> bool:
    """True when the plan can enter neither the top K (its bound is past the K-th best) nor the
    Pareto front inside the window: its bound is past the window's edge, or a simulated plan is at
    least as fast as its time bound and at least as small as its memory bound, strictly on one.
    Tries the cheap bound first, then the replayed one."""
    if math.isinf(kth):
        return False
    if _outside(c, kth, edge, ok, objective):
        return True
    if c.refined:
        return False
    bounds.refine(c)
    return _outside(c, kth, edge, ok, objective)


def _outside(c: Candidate, kth: float, edge: float, ok: list[dict], objective: str) -> bool:
    bound = c.mem_lb if objective == "memory" else c.time_lb
    if not bound > kth:
        return False
    if bound > edge:
        return True
    for r in ok:
        step, peak = r["step_time_s"], r["peak_memory_bytes"]
        if step <= c.time_lb and peak <= c.mem_lb and (step < c.time_lb or peak < c.mem_lb):
            return True
    return False


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return _NoBar()
    return tqdm(total=total, desc="search", unit="plan", file=sys.stderr, dynamic_ncols=True, leave=False)
