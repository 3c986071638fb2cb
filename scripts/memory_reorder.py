"""The program reordered to lower the peak (`simexec.program.reorder`), predicted and measured on CPU ranks.

    python scripts/memory_reorder.py                 # the plans below, a table on stdout
    python scripts/memory_reorder.py --steps 3 --plan pp=2,schedule=zb-h1,gbs=8,mbs=1
    python scripts/memory_reorder.py --markdown docs/memory.md   # rewrite the generated block

For each plan: the simulator's peak (live tensors, the `local` cluster's CPU ranks) and step time in the
original and the reordered order, the executor's measured peak (the live-memory tracker of the first step,
the largest rank) and median step time in both orders, and the largest difference of their losses.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simexec.specs.model import get_model  # noqa: E402

PLANS = ("pp=2,schedule=zb-h1,gbs=8,mbs=1", "pp=2,vpp=2,schedule=zb-v,gbs=8,mbs=1",
         "dp=2,zero=3,gbs=2,mbs=1", "pp=2,schedule=1f1b,gbs=8,mbs=1")
MODELS = {"gpt-tiny": None, "gpt-wide": dict(name="gpt-wide", hidden=256, ffn=1024, head_dim=64)}
MiB = 2**20


def model(name: str):
    base = get_model("gpt-tiny")
    return base if MODELS[name] is None else base.model_copy(update=MODELS[name])


def row(model_name: str, plan: str, steps: int) -> dict:
    from simexec.exec.api import execute
    from simexec.sim.simulate import simulate

    m = model(model_name)
    sim = simulate(m, "local", plan, symmetric=False, memory_plan=True)
    runs = [execute(m, "local", plan, steps=steps, trace=False, memory_plan=reorder) for reorder in (False, True)]
    losses = max((abs(a - b) for a, b in zip(runs[0].losses, runs[1].losses)), default=0.0)
    return dict(model=model_name, plan=plan, moved=sim.reordered.moved,
                predicted=(sim.peak_tensor_bytes, sim.reordered.peak_tensor_bytes),
                predicted_step=(sim.step_time_s, sim.reordered.step_time_s),
                measured=tuple(max(r.peak_memory_bytes_per_rank.values()) for r in runs),
                measured_step=tuple(r.step_time_s for r in runs), loss_diff=losses)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", action="append", help="plans to run (default: a zero-bubble, ZeRO-3 and 1F1B set)")
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="default: both")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--markdown", help="also rewrite this page's memory-reorder block with the table")
    args = ap.parse_args()
    lines = ["| model | plan | moves | predicted peak MiB | measured peak MiB | predicted step ms | measured step ms "
             "| loss diff |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines))
    for m in args.model or sorted(MODELS):
        for plan in args.plan or PLANS:
            r = row(m, plan, args.steps)
            pair = lambda v, s=MiB, f=".3f": f"{v[0] / s:{f}} -> {v[1] / s:{f}}"  # noqa: E731
            lines.append(f"| {m} | {plan} | {r['moved']} | {pair(r['predicted'])} | {pair(r['measured'])} | "
                         f"{pair(r['predicted_step'], 1e-3, '.1f')} | {pair(r['measured_step'], 1e-3, '.1f')} | "
                         f"{r['loss_diff']:.1g} |")
            print(lines[-1], flush=True)
    if args.markdown:
        from simexec.validation.markdown import replace_block

        begin, end = "<!-- memory-reorder:begin -->", "<!-- memory-reorder:end -->"
        replace_block(Path(args.markdown), "\n".join([begin, *lines, end]), begin, end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
