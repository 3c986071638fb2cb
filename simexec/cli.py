"""The `simexec` command line. Each command is one small function; user errors exit 2 with one line."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable, Optional

from simexec.errors import SimexecError

EXAMPLES = {
    "models": "simexec models --json",
    "clusters": "simexec clusters",
    "plan check": "simexec plan check --model llama2-7b --cluster 1xdgx-a100-80g --plan dp=2,tp=4,zero=1,gbs=64",
    "simulate": "simexec simulate --model llama3-70b --cluster 128xdgx-h100 --plan dp=16,tp=8,pp=8,gbs=1024 --json out.json",
    "search": "simexec search --model llama3-8b --cluster 4xdgx-h100 --gbs 256 --top 5",
    "compare": "simexec compare predicted.json measured.json --json errors.json --plot compare.png",
    "plot": "simexec plot predicted.json measured.json -o timeline.png",
    "calibrate": "simexec calibrate traces traces/local/*.json.gz --out traces/profiles/mine.json",
    "demo": "simexec demo --out simexec-demo",
    "execute": "simexec execute --model gpt-tiny --cluster local --plan dp=2,tp=2,gbs=8,dtype=fp32 --steps 3 --json result.json",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line and exit 2 (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"simexec: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def _sub(subs, name: str, help: str, key: Optional[str] = None) -> argparse.ArgumentParser:
    return subs.add_parser(name, help=help, description=help, epilog=f"example:\n  {EXAMPLES[key or name]}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)


STACK_HELP = ("training framework: megatron-core (default), torchtitan, torchtitan-compile, deepspeed, "
              "or a YAML/JSON file (docs/stacks.md)")


def _spec_args(p: argparse.ArgumentParser, plan: bool = True) -> None:
    p.add_argument("--model", required=True, help="preset name, or a Hugging Face config.json / YAML / JSON file")
    p.add_argument("--cluster", required=True, help="preset (dgx-h100), N nodes of one (4xdgx-h100), or a YAML/JSON file")
    if plan:
        p.add_argument("--plan", default="dp=1", help="plan string (dp=2,tp=4,pp=2,zero=1,gbs=64) or YAML/JSON file")
    p.add_argument("--seq-len", type=int, default=None, help="override the model's sequence length")


def _goodput_args(p: argparse.ArgumentParser) -> None:
    """The failure and checkpoint model's knobs (`simexec.sim.goodput.GoodputParams`)."""
    p.add_argument("--restart-min", type=float, default=None, metavar="MIN",
                   help="minutes to restart after a failure, before loading the checkpoint (default 11)")
    p.add_argument("--storage-gbps", type=float, default=None, metavar="GB/S",
                   help="checkpoint write bandwidth per node, GB/s (default 0.98: Llama 3's Tectonic, 2 TB/s / 2,048 nodes)")
    p.add_argument("--sync-checkpoint", action="store_true",
                   help="checkpoints block for the write too (default: async_save, only the device-to-host copy blocks)")
    p.add_argument("--failure-rate", type=float, default=None, metavar="PER_GPU_HOUR",
                   help="interruptions per GPU-hour (default 1.97e-5: Llama 3 405B's 419 in 54 days on 16,384 GPUs; "
                        "scripts/validate_goodput.py lists other fleets' measured rates)")


def _goodput_params(args):
    from simexec.sim.goodput import GoodputParams

    defaults = GoodputParams()
    params = GoodputParams(
        failures_per_gpu_hour=defaults.failures_per_gpu_hour if args.failure_rate is None else args.failure_rate,
        restart_s=defaults.restart_s if args.restart_min is None else args.restart_min * 60.0,
        storage_write_bw_per_node=defaults.storage_write_bw_per_node if args.storage_gbps is None
        else args.storage_gbps * 1e9,
        async_checkpoint=not args.sync_checkpoint)
    params.check()
    return params


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="simexec", description="Plan, simulate and execute parallel training of large models.")
    subs = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = _sub(subs, "models", "list model presets with their sizes")
    p.add_argument("--json", action="store_true", help="print JSON: [{name, params, active_params}]")
    p.set_defaults(func=cmd_models)

    p = _sub(subs, "clusters", "list cluster presets")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_clusters)

    plan = subs.add_parser("plan", help="work with plans", description="work with plans")
    plan_subs = plan.add_subparsers(dest="plan_command", required=True, parser_class=_Parser)
    p = _sub(plan_subs, "check", "validate a plan and print its derived numbers", key="plan check")
    _spec_args(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--order", action="store_true",
                   help="print each pipeline rank's actions in schedule order (0F3: chunk 0, forward, micro-batch 3)")
    p.set_defaults(func=cmd_plan_check)

    p = _sub(subs, "simulate", "predict step time, memory and a timeline of one training step")
    _spec_args(p)
    p.add_argument("--profile", default=None, help="hardware profile JSON from `simexec calibrate`")
    p.add_argument("--stack", default=None, help=STACK_HELP)
    p.add_argument("--memory-margin", type=float, default=0.0, metavar="GIB",
                   help="device memory to keep free: the plan fits when every rank's peak leaves this many GiB")
    p.add_argument("--memory-plan", action="store_true",
                   help="also plan every tensor's address offline (GPU clusters) and print the planned peak")
    p.add_argument("--full", action="store_true", help="simulate every rank (default: one per pipeline stage)")
    p.add_argument("--slow", default=None, metavar="SPEC",
                   help="stragglers: rank:R:F (rank R computes F x slower), node:N:F (every rank of node N), "
                        "nic:N:F (node N's NICs at 1/F bandwidth), comma-separated (docs/variation.md)")
    p.add_argument("--variation", type=float, default=None, metavar="CV",
                   help="per-GPU speed's coefficient of variation: step time p50/p90/p99 over --seeds draws")
    p.add_argument("--link-variation", type=float, default=None, metavar="CV",
                   help="per-node NIC bandwidth's coefficient of variation, drawn with --variation's seeds")
    p.add_argument("--seeds", type=int, default=16, help="draws of per-GPU speed for --variation (default 16)")
    p.add_argument("--tokens", type=float, default=None,
                   help="also the days to train this many tokens, with failures and checkpoints (e.g. 15e12)")
    _goodput_args(p)
    p.add_argument("--json", dest="json_path", default=None, help="write the summary as JSON here")
    p.add_argument("--trace", dest="trace_path", default=None, help="write the predicted trace (Perfetto JSON) here")
    p.set_defaults(func=cmd_simulate)

    p = _sub(subs, "compare", "match a predicted and a measured trace op by op and report the errors")
    p.add_argument("predicted", help="predicted trace (simexec simulate --trace)")
    p.add_argument("measured", help="measured trace (simexec execute --trace)")
    p.add_argument("--json", dest="json_path", default=None, help="write the errors as JSON here")
    p.add_argument("--plot", dest="plot_path", default=None, help="write the two timelines here (PNG or SVG)")
    p.set_defaults(func=cmd_compare)

    p = _sub(subs, "plot", "draw the timeline (and memory) of one or more traces")
    p.add_argument("traces", nargs="+", help="trace files in the simexec/Chrome schema")
    p.add_argument("-o", "--out", required=True, help="output image (.png or .svg)")
    p.set_defaults(func=cmd_plot)

    _add_optional_commands(subs)
    return parser


def _add_optional_commands(subs) -> None:
    """Commands whose modules exist in this build (each registers itself when present)."""
    import importlib.util

    if importlib.util.find_spec("simexec.search.driver") is not None:
        p = _sub(subs, "search", "find the fastest plan that fits")
        _spec_args(p, plan=False)
        p.add_argument("--gbs", type=int, required=True, help="global batch size (sequences)")
        p.add_argument("--top", type=int, default=10, help="how many plans to print")
        p.add_argument("--objective", choices=("throughput", "memory", "time-to-train"), default="throughput",
                       help="rank by step time, peak memory, or days to train --tokens with failures and checkpoints")
        p.add_argument("--tokens", type=float, default=None, help="tokens to train, for --objective time-to-train")
        _goodput_args(p)
        p.add_argument("--robust", nargs="?", const="", default=None, metavar="F|SPEC",
                       help="also re-rank the best top x 3 plans by their step with a straggler: one GPU F x slower "
                            "(default 1.2) at each plan's worst stage, or a --slow spec (docs/variation.md)")
        p.add_argument("--variation", type=float, default=None, metavar="CV",
                       help="with --robust: rank by the p90 step over --seeds draws of per-GPU speed")
        p.add_argument("--link-variation", type=float, default=None, metavar="CV",
                       help="with --robust: also draw per-node NIC bandwidth with this coefficient of variation")
        p.add_argument("--seeds", type=int, default=16, help="draws of per-GPU speed for --variation (default 16)")
        p.add_argument("--fix", default=None, help="fix some plan fields, e.g. tp=8,pp=4; a|b leaves a choice, e.g. \"tp=4|8,zero=0|1\"")
        p.add_argument("--against", default=None, metavar="PLAN",
                       help="a plan of yours (e.g. the one you run): where it ranks and why the best beats it")
        p.add_argument("--profile", default=None, help="hardware profile JSON")
        p.add_argument("--stack", default=None, help=STACK_HELP + "; the search tries only what it can run")
        p.add_argument("--memory-margin", type=float, default=0.0, metavar="GIB",
                       help="device memory every plan must leave free (GiB)")
        p.add_argument("--ray-address", default=None, help="spread the sweep over a Ray cluster")
        p.add_argument("--workers", type=int, default=None, help="local worker processes (default: one per core; 1: in this process)")
        p.add_argument("--json", dest="json_path", default=None, help="write the result as JSON here")
        p.set_defaults(func=cmd_search)
    if importlib.util.find_spec("simexec.exec.api") is not None:
        p = _sub(subs, "execute", "run a plan for real on Ray actors with torch.distributed")
        _spec_args(p)
        p.add_argument("--steps", type=int, default=3, help="training steps (the first is a warm-up)")
        p.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
        p.add_argument("--backend", choices=("gloo", "nccl", "xla"), default="gloo",
                       help="gloo on CPU ranks, nccl on GPUs, xla on PyTorch/XLA devices (scripts/xla_env.sh)")
        p.add_argument("--timeout", type=float, default=60.0, help="seconds before a hung rank ends the run")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", dest="json_path", default=None, help="write losses, step times and memory here")
        p.add_argument("--trace", dest="trace_path", default=None, help="write the measured trace here")
        p.add_argument("--profile", dest="profile_dir", default=None, help="write a torch.profiler trace per rank here")
        p.add_argument("--in-process", action="store_true",
                       help="a one-rank plan in this process, without Ray (a GPU machine without it, a debugger)")
        p.add_argument("--memory-plan", action="store_true",
                       help="also run the program reordered to lower the peak (weight passes early, ZeRO-3 gathers "
                            "late) and report both orders' measured peaks, losses and step times")
        p.add_argument("--slow", default=None, metavar="SPEC",
                       help="stragglers as simulate's --slow (rank:R:F, node:N:F): run healthy, then with those ranks "
                            "computing F x as long, and report the measured slowdown (docs/variation.md)")
        p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                       help="save every rank's state here with torch.distributed.checkpoint")
        p.add_argument("--checkpoint-every", type=int, default=0, metavar="K", help="save after steps K, 2K, ...")
        p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in DIR")
        p.add_argument("--kill", default=None, metavar="rank:R:step:S",
                       help="rank R exits hard as it begins step S; the run restarts from the newest checkpoint "
                            "and reports the time lost against the goodput model")
        p.set_defaults(func=cmd_execute)
    if importlib.util.find_spec("simexec.calibrate.profiles") is not None:
        p = _sub(subs, "calibrate", "fit the cluster's cost parameters to this machine (micro-benchmarks) or to traces")
        p.add_argument("method", choices=("microbench", "traces"), help="how to calibrate")
        p.add_argument("traces", nargs="*", help="measured traces (method traces)")
        p.add_argument("--cluster", default="local", help="cluster whose parameters are fitted")
        p.add_argument("--ranks", type=int, default=4, help="rank actors for the micro-benchmarks")
        p.add_argument("--base-profile", default=None, help="start the trace fit from this profile")
        p.add_argument("--out", required=True, help="profile JSON to write (traces/profiles/<name>.json)")
        p.set_defaults(func=cmd_calibrate)
    if importlib.util.find_spec("simexec.demo") is not None:
        p = _sub(subs, "demo", "simulate, execute, calibrate and re-simulate gpt-tiny's plans on this machine")
        p.add_argument("--out", default="simexec-demo", help="folder for report.md, plots, traces, summary.json")
        p.add_argument("--rounds", type=int, default=3, help="times each plan runs, interleaved (the median counts)")
        p.set_defaults(func=cmd_demo)


# --- commands ---------------------------------------------------------------------------------------
def _gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def cmd_models(args) -> int:
    from simexec.specs.model import list_models

    models = list_models()
    if args.json:
        print(json.dumps([{"name": m.name, "params": m.params, "active_params": m.active_params} for m in models], indent=1))
        return 0
    print(f"{'name':<18}{'params':>12}{'active':>12}  {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>4} {'seq':>6} "
          f"{'window':>6}")
    for m in models:
        print(f"{m.name:<18}{m.params / 1e9:>11.2f}B{m.active_params / 1e9:>11.2f}B  {m.layers:>6} {m.hidden:>6} "
              f"{m.heads:>5} {m.kv_heads:>4} {m.seq_len:>6} {m.sliding_window or '-':>6}")
    return 0


def cmd_clusters(args) -> int:
    from simexec.specs.cluster import list_clusters

    clusters = list_clusters()
    if args.json:
        print(json.dumps([c.model_dump() for c in clusters], indent=1))
        return 0
    print(f"{'name':<14}{'device':<18}{'bf16 TFLOP/s':>13}{'memory':>10}{'gpus/node':>10}{'fabric GB/s':>12}{'NICs':>6}")
    for c in clusters:
        gpn = c.node.gpus_per_node or "plan"
        print(f"{c.name:<14}{c.device.name:<18}{c.device.peak_flops.get('bf16', 0) / 1e12:>13.0f}"
              f"{c.device.memory_bytes / 2**30:>8.0f}Gi{gpn:>10}{c.node.intra_bw / 1e9:>12.0f}"
              f"{c.network.nics_per_node:>3}x{c.network.nic_bw * 8 / 1e9:.0f}G")
    print("NxNAME means N copies, e.g. 4xdgx-h100 (4 nodes), 2xgb200-nvl72 (2 racks);"
          " --cluster also takes a YAML/JSON file (docs/cluster.md).")
    return 0


def _resolve(args):
    from simexec.specs.cluster import get_cluster
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan, resolve

    model = get_model(args.model)
    cluster = get_cluster(args.cluster)
    plan = load_plan(args.plan)
    return resolve(model, cluster, plan, seq_len=args.seq_len)


def cmd_plan_check(args) -> int:
    rp = _resolve(args)
    p = rp.plan
    rows = []
    for pp_rank in range(p.pp):
        states = rp.model_state_bytes(pp_rank)
        params = rp.params_on_pp_rank(pp_rank)
        rows.append({"pp_rank": pp_rank, "stages": list(rp.stages_of_pp_rank(pp_rank)),
                     "layers": len(rp.layers_of_pp_rank(pp_rank)), "params": params["total"],
                     "model_state_bytes": sum(states.values()), **{f"{k}_bytes": v for k, v in states.items()}})
    out = {"plan": p.to_string(), "world_size": rp.world, "dp": rp.dp, "micro_batches": rp.micro_batches,
           "tokens_per_step": rp.tokens_per_step, "seq_len": rp.seq_len, "schedule": p.schedule_name,
           "per_stage": rows}
    order = None
    if args.order:
        from simexec.program.schedules import pipeline_order

        order = pipeline_order(p.schedule_name, p.pp, rp.micro_batches, p.vpp)
        out["order"] = {str(r): [str(a) for a in acts] for r, acts in order.items()}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(f"plan {p.to_string()}  ({rp.model.name} on {rp.cluster.name})")
    print(f"world size {rp.world} = dp {rp.dp} x tp {p.tp} x cp {p.cp} x pp {p.pp};  schedule {p.schedule_name}")
    print(f"global batch {p.gbs} x seq {rp.seq_len} = {rp.tokens_per_step:,} tokens; "
          f"{rp.micro_batches} micro-batches of {p.mbs} per data-parallel rank")
    print(f"{'stage':>5} {'holds':>8} {'layers':>6} {'params/rank':>12} {'weights':>10} {'grads':>10} {'optimizer':>10}"
          f" {'states':>10}")
    for r in rows:
        holds = ",".join(map(str, r["stages"]))
        print(f"{r['pp_rank']:>5} {holds:>8} {r['layers']:>6} {r['params'] / 1e9:>11.3f}B {_gb(r['params_bytes']):>10} "
              f"{_gb(r['grads_bytes']):>10} {_gb(r['optimizer_bytes']):>10} {_gb(r['model_state_bytes']):>10}")
    if order is not None:
        from simexec.program.schedules import format_order

        print(format_order(order))
    return 0


def cmd_simulate(args) -> int:
    from simexec.specs.cluster import get_cluster
    from simexec.specs.model import get_model
    from simexec.specs.plan import load_plan
    from simexec.sim.simulate import simulate
    from simexec.specs.stack import get_stack
    from simexec.trace.schema import save_json

    params = _goodput_params(args)
    result = simulate(get_model(args.model, seq_len=args.seq_len), get_cluster(args.cluster), load_plan(args.plan),
                      seq_len=args.seq_len, symmetric=not args.full, profile=args.profile,
                      trace=args.trace_path is not None, stack=get_stack(args.stack),
                      memory_margin_bytes=args.memory_margin * 2**30, memory_plan=args.memory_plan,
                      slow=args.slow, variation=args.variation, seeds=args.seeds, tokens=args.tokens,
                      goodput_params=params, link_variation=args.link_variation)
    print(result.format())
    if args.json_path:
        save_json(result.to_json(), args.json_path)
    if args.trace_path:
        result.trace.save(args.trace_path)
    return 0


def cmd_compare(args) -> int:
    from simexec.trace.compare import compare_files
    from simexec.trace.schema import save_json

    result = compare_files(args.predicted, args.measured)
    print(result.format())
    if args.json_path:
        save_json(result.to_json(), args.json_path)
    if args.plot_path:
        from simexec.trace.plot import plot_traces

        plot_traces([args.predicted, args.measured], args.plot_path)
    return 0


def cmd_plot(args) -> int:
    from simexec.trace.plot import plot_traces

    plot_traces(args.traces, args.out)
    print(f"wrote {args.out}")
    return 0


def cmd_search(args) -> int:
    from simexec.search.driver import parse_fix, search
    from simexec.trace.schema import save_json

    from simexec.search.robust import parse_robust

    if (args.variation is not None or args.link_variation is not None) and args.robust is None:
        raise SimexecError("--variation and --link-variation rank plans under variation: they need --robust")
    robust = (parse_robust(args.robust, args.variation, args.seeds, args.link_variation)
              if args.robust is not None else None)
    result = search(args.model, args.cluster, args.gbs, seq_len=args.seq_len, top=args.top,
                    objective=args.objective, fix=parse_fix(args.fix) if args.fix else None,
                    profile=args.profile, ray_address=args.ray_address, workers=args.workers, against=args.against,
                    stack=args.stack, memory_margin_bytes=args.memory_margin * 2**30, robust=robust,
                    tokens=args.tokens, goodput_params=_goodput_params(args))
    print(result.format())
    if args.json_path:
        save_json(result.to_json(), args.json_path)
    return 1 if not result.candidates and not result.interrupted else 0  # no valid plan: a bad gbs or fix


def cmd_execute(args) -> int:
    from simexec.errors import ExecError
    from simexec.exec.api import execute, execute_in_process

    if args.in_process:
        given = [f for f, v in (("--slow", args.slow), ("--checkpoint-dir", args.checkpoint_dir),
                                ("--resume", args.resume), ("--kill", args.kill),
                                ("--memory-plan", args.memory_plan)) if v]
        if given:
            raise ExecError(f"--in-process runs one rank without Ray: {given[0]} needs the rank actors")
        if args.ray_address or args.backend == "xla":
            what = "--ray-address" if args.ray_address else "--backend xla"
            raise ExecError(f"--in-process runs one rank here without Ray: {what} does not apply")
        result = execute_in_process(args.model, args.cluster, args.plan, steps=args.steps, seq_len=args.seq_len,
                                    seed=args.seed, device="cuda" if args.backend == "nccl" else "cpu",
                                    trace_path=args.trace_path, json_path=args.json_path, profile_dir=args.profile_dir)
    elif args.slow or args.kill:  # measured beside the simulator's and the goodput model's predictions
        from simexec.resilience import execute_with_predictions

        result = execute_with_predictions(
            args.model, args.cluster, args.plan, steps=args.steps, seq_len=args.seq_len, ray_address=args.ray_address,
            backend=args.backend, seed=args.seed, timeout_s=args.timeout, trace_path=args.trace_path,
            json_path=args.json_path, profile_dir=args.profile_dir, slow=args.slow, checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every, resume=args.resume, kill=args.kill)
    else:
        original = None
        if args.memory_plan:
            original = execute(args.model, args.cluster, args.plan, steps=args.steps, seq_len=args.seq_len,
                               ray_address=args.ray_address, backend=args.backend, seed=args.seed,
                               timeout_s=args.timeout)
        result = execute(args.model, args.cluster, args.plan, steps=args.steps, seq_len=args.seq_len,
                         ray_address=args.ray_address, backend=args.backend, seed=args.seed, timeout_s=args.timeout,
                         trace_path=args.trace_path, json_path=args.json_path, profile_dir=args.profile_dir,
                         checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                         resume=args.resume, memory_plan=args.memory_plan)
        if original is not None:
            print(result.format())
            print(_memory_plan_lines(original, result))
            return 0
    print(result.format())
    return 0


def _memory_plan_lines(original, reordered) -> str:
    """The two orders' measured peaks per rank, step times and the largest loss difference."""
    mib = 2**20
    peaks = ", ".join(f"r{r} {original.peak_memory_bytes_per_rank[r] / mib:.2f} -> {b / mib:.2f}"
                      for r, b in reordered.peak_memory_bytes_per_rank.items())
    diff = max((abs(a - b) for a, b in zip(original.losses, reordered.losses)), default=0.0)
    st = "n/a" if original.step_time_s is None or reordered.step_time_s is None else (
        f"{original.step_time_s * 1e3:.1f} -> {reordered.step_time_s * 1e3:.1f} ms")
    return (f"memory plan   measured peak (original -> reordered) {peaks} MiB\n"
            f"              step time {st}; largest loss difference {diff:.2g}")


def cmd_calibrate(args) -> int:
    from simexec.calibrate.micro import calibrate_from_microbench
    from simexec.calibrate.traces import calibrate_from_traces

    if args.method == "traces":
        if not args.traces:
            raise SimexecError("calibrate traces needs at least one measured trace file")
        profile = calibrate_from_traces(args.traces, args.cluster, args.out, base_profile=args.base_profile)
    else:
        t0 = time.perf_counter()
        profile = calibrate_from_microbench(
            args.cluster, args.ranks, args.out,
            progress=lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", file=sys.stderr, flush=True))
    print(f"wrote {args.out} ({profile.get('method', args.method)})")
    return 0


def cmd_demo(args) -> int:
    from simexec.demo import demo

    summary = demo(args.out, rounds=args.rounds)
    print(f"wrote {args.out}/report.md; held-out step-time MAPE {summary['heldout_mape_before']:.1%} before, "
          f"{summary['heldout_mape_after']:.1%} after calibration")
    return 0


# Each command's outputs, checked before it runs: (argument, flag, a folder rather than a file).
_OUTPUTS = (("json_path", "--json", False), ("trace_path", "--trace", False), ("plot_path", "--plot", False),
            ("profile_dir", "--profile", True))
_OUT_FLAG = {cmd_plot: ("-o", False), cmd_calibrate: ("--out", False), cmd_demo: ("--out", True)}


def _check_outputs(args) -> None:
    from simexec.outputs import check_output
    from simexec.trace.plot import check_image_name

    for attr, flag, folder in _OUTPUTS:
        if getattr(args, attr, None):
            check_output(getattr(args, attr), flag, folder=folder)
    if args.func in _OUT_FLAG:
        flag, folder = _OUT_FLAG[args.func]
        check_output(args.out, flag, folder=folder)
    image = args.out if args.func is cmd_plot else getattr(args, "plot_path", None)
    if image:
        check_image_name(image)


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable = args.func
    try:
        _check_outputs(args)
        return func(args)
    except SimexecError as exc:
        sys.stderr.write(f"simexec: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("simexec: interrupted\n")
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
