#!/usr/bin/env python
"""What a rank holds at its measured peak, storage by storage, against the simulator's prediction.

    python scripts/live_memory.py [--model moe-tiny] [--rank R] PLAN

Runs one step of PLAN on local Ray CPU ranks with a runner that wraps the executor's own
`run_rank`: every tensor storage its peak-memory tracker counts is tagged with the instruction and
the aten operator that made it. Prints the rank's measured and predicted peak, then the storages
alive at the end of the instruction where the peak fell, grouped by the instruction that made them
(layer 0 in full, the other layers summed), and the predicted activations the program saves per
block of a layer (`simexec.program.blocks.Anatomy`). This is how docs/calibration_findings.md traced moe-tiny's
`dp=4,ep=2` gap to the norms, the rotary tables and the combine's tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tagging_runner(out_dir: str):
    """A `run_rank` stand-in that records, per rank, the live storages after each instruction of the
    first step: {instruction: [(made by instruction, aten op, shape, bytes)]} for the peak's."""

    def runner(rp, instrs, *, steps, groups, tracer, device, seed=0):
        import torch

        from simexec.exec.rank import interpreter as interp
        from simexec.exec.measure import live_memory

        torch.set_num_threads(1)
        now, op = ["start"], ["?"]
        origin: dict[int, tuple] = {}
        track, dispatch = live_memory._LiveBytes.track, live_memory._LiveBytes.__torch_dispatch__

        def tagged_track(self, t, created=False):
            key = nbytes = None
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    st = t.untyped_storage()
                    key, nbytes = id(st), st.nbytes()
                except (RuntimeError, NotImplementedError):
                    key = None
            was = key is not None and key in self._seen and self._seen[key].alive
            track(self, t, created)
            if key is not None and not was and key in self._seen:
                origin[key] = (now[0], op[0], list(t.shape), nbytes)

        def tagged_dispatch(self, func, types, args=(), kwargs=None):
            op[0] = str(func)
            return dispatch(self, func, types, args, kwargs)

        live_memory._LiveBytes.track, live_memory._LiveBytes.__torch_dispatch__ = tagged_track, tagged_dispatch
        best = {"peak": -1, "at": None, "live": []}

        class Tagging:
            def begin(self, ins, step):
                now[0] = ins.name
                tracer.begin(ins, step)

            def end(self, ins, step):
                tracer.end(ins, step)
                t = live_memory._TRACKER[0]
                if t is not None and t.peak > best["peak"]:
                    best.update(peak=t.peak, at=ins.name,
                                live=[origin[k] for k, f in t._seen.items() if f.alive and k in origin])

            def counter(self, category, nbytes):
                tracer.counter(category, nbytes)

        try:
            res = interp.run_rank(rp, instrs, steps=steps, groups=groups, tracer=Tagging(), device=device, seed=seed)
        finally:
            live_memory._LiveBytes.track, live_memory._LiveBytes.__torch_dispatch__ = track, dispatch
        Path(out_dir, f"rank{instrs[0].rank}.json").write_text(json.dumps(best))
        return res

    return runner


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", help="plan string, e.g. dp=4,ep=2,gbs=8,dtype=fp32")
    ap.add_argument("--model", default="moe-tiny")
    ap.add_argument("--rank", type=int, default=None, help="the rank to show (default: the largest measured peak)")
    ap.add_argument("--seq-len", type=int, default=None, help="sequence length (default: the model's)")
    args = ap.parse_args(argv)
    from simexec.program.blocks import Anatomy
    from simexec.specs.cluster import get_cluster
    from simexec.errors import SimexecError
    from simexec.exec.api import execute
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve
    from simexec.sim.simulate import simulate

    try:
        rp = resolve(get_model(args.model), get_cluster("local"), load_plan(args.plan), args.seq_len)
        if args.rank is not None and not 0 <= args.rank < rp.world:
            raise SimexecError(f"--rank {args.rank}: the plan has ranks 0-{rp.world - 1}")
        predicted = simulate(args.model, "local", args.plan, seq_len=args.seq_len).peak_memory_bytes_per_rank
        with tempfile.TemporaryDirectory() as tmp:
            res = execute(args.model, "local", args.plan, steps=1, seq_len=args.seq_len, runner=tagging_runner(tmp))
            rank = args.rank if args.rank is not None else max(res.peak_memory_bytes_per_rank,
                                                               key=res.peak_memory_bytes_per_rank.get)
            best = json.loads(Path(tmp, f"rank{rank}.json").read_text())
    except SimexecError as exc:
        print(f"live_memory: error: {exc}", file=sys.stderr)
        return 2
    measured, predicted = res.peak_memory_bytes_per_rank[rank], predicted[rank]
    print(f"rank {rank}: measured peak {measured / 1e6:.3f} MB at {best['at']}, predicted {predicted / 1e6:.3f} MB "
          f"(error {predicted / measured - 1:+.1%})")
    by_made: dict[str, int] = defaultdict(int)
    for made, _, _, nbytes in best["live"]:
        layer = made.split(".L")[1].split(".")[0] if ".L" in made else ""
        key = made if layer in ("0", "-1", "") else f"{made.split('.L')[0]}.L1+ (summed)"
        by_made[key] += nbytes
    print("\nlive at the peak, by the instruction that made it (kB):")
    for made, nbytes in sorted(by_made.items(), key=lambda kv: -kv[1]):
        print(f"  {made:32s} {nbytes / 1e3:9.1f}")
    print("\nlayer 0's storages (instruction, operator, shape, kB):")
    for made, op, shape, nbytes in best["live"]:
        if ".L0." in made:
            print(f"  {made:22s} {op:46s} {str(shape):20s} {nbytes / 1e3:7.1f}")
    an = Anatomy(rp)
    print("\npredicted activations a layer saves, per block (kB):")
    for name, block in an.layer(0).items():
        print(f"  {name:10s} {block.saved / 1e3:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
