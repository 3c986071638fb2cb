"""The interpreter against the single-process reference, without Ray: each plan's ranks are spawned
processes (gloo over TCP on 127.0.0.1, one intra-op thread each) that run `run_rank` on the lowered
program; the losses of 3 steps and the final parameters must match `reference()` (fp32, relative 1e-4).

Core dimensions (issue 5). The extended ones (MoE/EP, CP, YaFSDP, HSDP, offload) are in
test_exec_interp_ext.py, which reuses `check_plan`.
"""
from __future__ import annotations

import os
import socket
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve

STEPS = 3
RTOL = 1e-4
POOL = 8  # ranks kept alive for the session: the largest plan below (dp2 tp2 pp2)
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pool_main(rank: int, size: int, port: int, jobs, results, device: str = "cpu") -> None:
    """One rank of the pool: joins a gloo world of `size` once, then runs plans until told to stop.
    Ranks beyond a plan's world only take part in building its process groups (a world collective).
    device "xla": the rank computes on its XLA device (collectives: gloo on host copies)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    if device == "xla":
        from simexec.exec.rank.xla import device as xla_device

        dev = xla_device()  # before any backward: autograd sizes its device queues once
    import io
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    from simexec.exec.runtime.groups import GroupTable
    from simexec.exec.rank.interpreter import run_rank

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=TIMEOUT_S))
    while True:
        job = jobs.get()
        if job is None:
            break
        rp, program, steps, specs = job
        groups = None
        try:
            groups = GroupTable(specs, rank, timeout_s=TIMEOUT_S)
            res = None
            if rank in program.ranks:
                res = run_rank(rp, program.ranks[rank], steps=steps, groups=groups, tracer=None, device=dev, seed=0)
            buf = io.BytesIO()
            torch.save(res, buf)  # bytes, not shared-memory tensors: no file descriptor per tensor
            results.put(("ok", rank, buf.getvalue()))
        except BaseException:  # noqa: BLE001 - reported to the test, which restarts the pool
            results.put(("error", rank, traceback.format_exc()))
        finally:
            if groups is not None:
                for pg in set(groups._groups.values()):
                    if pg is not dist.group.WORLD:
                        dist.destroy_process_group(pg)
    dist.destroy_process_group()


class RankPool:
    """`size` spawned processes in one gloo world (127.0.0.1), reused by every plan of the session:
    a plan runs on ranks 0..world-1. Saves the start of a process and the import of torch per rank and
    plan. A plan that fails restarts the pool, so nothing of it (unread messages) reaches the next."""

    def __init__(self, size: int = POOL, device: str = "cpu"):
        self.size, self.device = size, device
        self.ctx = mp.get_context("spawn")
        self.procs = []

    def _start(self) -> None:
        port = _free_port()
        self.jobs = [self.ctx.Queue() for _ in range(self.size)]
        self.results = self.ctx.Queue()
        self.procs = [self.ctx.Process(target=_pool_main, args=(r, self.size, port, self.jobs[r], self.results, self.device),
                                       daemon=True) for r in range(self.size)]
        for p in self.procs:
            p.start()

    def close(self) -> None:
        for q, p in zip(getattr(self, "jobs", []), self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []

    def run(self, rp, program, steps: int) -> list[dict]:
        import io
        import queue

        from simexec.exec.runtime.groups import group_specs

        assert rp.world <= self.size, f"plan needs {rp.world} ranks, the pool has {self.size}"
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        specs = group_specs(rp, program)
        for q in self.jobs:
            q.put((rp, program, steps, specs))
        out, errors = {}, {}
        try:
            for _ in range(self.size):
                status, rank, payload = self.results.get(timeout=2 * TIMEOUT_S)
                if status == "ok":
                    out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors[rank] = payload
        except queue.Empty:
            errors[-1] = f"no answer from ranks {sorted(set(range(self.size)) - set(out) - set(errors))}"
        if errors:
            self.close()
            first = min(errors)
            raise RuntimeError(f"rank {first} failed:\n{errors[first]}")
        return [out[r] for r in range(rp.world)]


_POOL: RankPool | None = None


def _pool() -> RankPool:
    global _POOL
    if _POOL is None:
        import atexit

        _POOL = RankPool()
        atexit.register(_POOL.close)
    return _POOL


def resolved(model: str, plan: str, seq_len: int | None = 32, dtype: str | None = "fp32", cluster=None):
    """`plan` in `dtype` (fp32 by default, to compare with the fp32 reference; None: the plan's own), on
    `cluster` (a ClusterSpec; None: `local`, one node of the plan's ranks)."""
    return resolve(get_model(model), cluster or get_cluster("local"),
                   parse_plan(plan + (f",dtype={dtype}" if dtype else "")), seq_len)


def run_plan(model: str, plan: str, seq_len: int | None = 32, steps: int = STEPS, pool: RankPool | None = None,
             dtype: str | None = "fp32", cluster=None) -> tuple[object, list[dict]]:
    """Lower `plan` and run every rank (in the session's pool, or `pool`); the results of run_rank per rank."""
    from simexec.program.lower import lower

    rp = resolved(model, plan, seq_len, dtype, cluster)
    program = lower(rp, symmetric=False)
    program.validate()
    return rp, (pool or _pool()).run(rp, program, steps)


@lru_cache(maxsize=None)
def _reference(model: str, gbs: int, seq_len: int | None, steps: int, maths: str = "") -> dict:
    """`maths`: the plan's fields that change the training maths (loss scale, clipping), e.g. `clip_grad=1`."""
    from simexec.exec.nn.reference import reference

    torch.set_num_threads(1)
    return reference(resolved(model, f"dp=1,gbs={gbs}" + (f",{maths}" if maths else ""), seq_len), steps)


MATHS = ("clip_grad", "loss_scale", "loss_scale_window", "loss_scale_hysteresis")


def training_maths(plan) -> str:
    """The fields of `plan` the reference must share, to the last bit."""
    return ",".join(f"{k}={getattr(plan, k)!r}" for k in MATHS)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius). Not element-wise: Adam divides each gradient element by its own
    running RMS, so an element whose gradient is near zero turns rounding noise (summation orders
    differ between plans) into a step of up to lr; one such element would decide a max-norm metric.
    The denominator is at least 0.01 per element (the init scale): the attention key bias has an
    exactly zero gradient (softmax ignores a shift common to all keys), so both runs hold noise there."""
    floor = 1e-2 * b.numel() ** 0.5
    return float((a - b).norm() / max(float(b.norm()), floor))


def check_plan(model: str, plan: str, seq_len: int | None = 32, steps: int = STEPS, pool: RankPool | None = None,
               cluster=None) -> tuple[float, float]:
    """Run `plan`; assert losses and every rank's parameter shard match the reference. Returns the
    largest relative errors of the losses and of the parameters. `pool`: another RankPool (XLA);
    `cluster`: where the plan's ranks sit (`resolved`)."""
    from simexec.exec.nn.param_layout import Layout, holds, param_specs, shard

    rp, results = run_plan(model, plan, seq_len, steps, pool, cluster=cluster)
    ref = _reference(model, rp.plan.gbs, seq_len, steps, training_maths(rp.plan))
    loss_err = 0.0
    reporting = [r for r in results if r["losses"]]
    last_stage = [r for r in range(rp.world) if rp.mesh.coords(r)["pp"] == rp.head_pp_rank]
    assert [r for r, res in enumerate(results) if res["losses"]] == last_stage, "losses from other ranks than the last stage's"
    measures_memory = pool is None or pool.device == "cpu"  # the XLA CPU runtime reports no memory
    assert all(len(res["step_times_s"]) == steps and (res["peak_memory_bytes"] > 0 or not measures_memory)
               for res in results)
    for res in reporting:
        assert len(res["losses"]) == steps
        for got, want in zip(res["losses"], ref["losses"]):
            loss_err = max(loss_err, abs(got - want) / abs(want))
    assert loss_err <= RTOL, f"{plan}: losses {reporting[0]['losses']} vs reference {ref['losses']}"
    for rank, res in enumerate(results):  # under loss_scale: every rank skips the steps the reference skips
        assert res.get("skipped_steps") == ref.get("skipped_steps"), f"{plan}: rank {rank} skipped other steps"
        assert res.get("loss_scales") == ref.get("loss_scales"), f"{plan}: rank {rank} scaled otherwise"
    specs = {s.name: s for s in param_specs(rp.model)}
    seen, param_err = set(), 0.0
    for rank, res in enumerate(results):
        lay = Layout.of(rp, rank)
        for name, got in res["params"].items():
            s = specs[name]
            assert holds(s, rp.model, lay)
            want = shard(s, ref["params"][name], lay)
            assert got.shape == want.shape, f"rank {rank} {name}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
            err = rel_err(got, want)
            assert err <= RTOL, f"{plan}: rank {rank} parameter {name} differs from the reference by {err:.2e}"
            param_err = max(param_err, err)
            seen.add(name)
    assert seen == set(specs), f"parameters held by no rank: {sorted(set(specs) - seen)}"
    return loss_err, param_err


CORE = [
    ("gpt-tiny", "dp=2"),
    ("gpt-tiny", "tp=2"),
    ("gpt-tiny", "tp=2,sp=1"),
    ("gpt-tiny", "pp=2,schedule=gpipe,gbs=4"),
    ("gpt-tiny", "pp=2,schedule=1f1b,gbs=4"),
    ("gpt-tiny", "pp=4,gbs=4"),
    ("gpt-tiny", "pp=2,vpp=2,gbs=4"),
    ("gpt-tiny", "dp=2,tp=2"),
    ("gpt-tiny", "tp=2,pp=2,gbs=4"),
    ("gpt-tiny", "dp=2,tp=2,pp=2,gbs=8"),
    ("gpt-tiny", "dp=4,zero=1"),
    ("gpt-tiny", "dp=4,zero=2,gbs=8"),
    ("gpt-tiny", "dp=4,zero=3"),
    ("gpt-tiny", "dp=2,gbs=4,recompute=selective"),
    ("gpt-tiny", "tp=2,gbs=2,recompute=full"),
    ("gpt-tiny", "pp=2,gbs=4,recompute=full,recompute_layers=1"),
    ("gpt-tiny", "pp=2,stages=1,3,gbs=4"),
    # combinations
    ("gpt-tiny", "dp=2,tp=2,zero=3"),
    ("gpt-tiny", "dp=2,pp=2,zero=2,gbs=4"),
    ("gpt-tiny", "dp=2,pp=2,vpp=2,zero=3,gbs=8"),
    ("gpt-tiny", "tp=2,pp=2,vpp=2,gbs=4,recompute=selective"),
    ("gpt-tiny", "dp=2,pp=2,vpp=2,zero=1,gbs=8,recompute=full"),
    ("gpt-tiny", "dp=2,tp=2,sp=1,pp=2,gbs=8"),
    ("gpt-tiny", "tp=2,sp=1,recompute=full"),
    ("gpt-tiny", "dp=2,pp=2,gbs=8,grad_overlap=0"),  # gradients reduced after the backward (Megatron 2021)
    ("gpt-tiny", "tp=2,pp=2,vpp=2,gbs=4,p2p_overlap=0"),  # blocking pipeline exchanges (Megatron-LM)
    ("gpt-tiny", "pp=2,vpp=2,gbs=2,p2p_overlap=0"),  # as many micro-batches as stages: all forwards first
    ("gpt-tiny", "dp=4,zero=2,gbs=8,grad_overlap=0"),
    ("gpt-tiny", "tp=2,gbs=2,flash_attention=0"),  # unfused attention: Q.K^T, softmax, P.V
    ("gpt-tiny", "dp=2,gbs=4,grad_bucket_view=0"),  # torch DDP's own buckets: copied in, reduced, copied back
    ("gpt-tiny", "dp=2,tp=2,gbs=4,grad_bucket_view=0,grad_overlap=0"),
    ("gpt-tiny", "dp=4,zero=1,grad_allreduce=1"),  # ZeRO-1 taking its slice of an all-reduce (DeepSpeed bf16)
    ("gpt-tiny", "dp=2,pp=2,zero=1,gbs=8,grad_allreduce=1,grad_overlap=0"),
    ("gpt-tiny", "dp=4,zero=1,param_overlap=1"),  # parameters gathered in the next step's forward (Megatron)
    ("gpt-tiny", "dp=2,tp=2,pp=2,vpp=2,zero=2,gbs=8,param_overlap=1,bucket_mb=0.05"),
]


TIED = str(Path(__file__).resolve().parent / "data" / "gpt-tiny-tied.yaml")  # the LM head is the embedding's transpose


@pytest.mark.parametrize("plan", ["dp=2", "tp=2,gbs=2", "dp=2,zero=1,gbs=4", "dp=2,zero=2,gbs=4",
                                  "dp=4,dp_shard=2,zero=3,gbs=8", "dp=2,pp=2,gbs=8,grad_bucket_view=0",
                                  "pp=2,vpp=2,gbs=4,clip_grad=0.01", "dp=2,pp=2,zero=1,gbs=8,clip_grad=0.01",
                                  "dp=4,pp=2,zero=1,dp_shard=2,gbs=8", "dp=2,pp=2,vpp=2,zero=1,gbs=8,bucket_mb=0.05",
                                  "dp=2,pp=2,zero=1,gbs=8,grad_overlap=0", "dp=2,pp=2,zero=1,gbs=8,param_overlap=1"])
def test_tied_embeddings_match_reference(plan):
    """The head multiplies by the (vocab-parallel) embedding, whose gradient sums both uses. Under
    ZeRO-3 the head gathers the embedding's unit as well and reduce-scatters its share of the
    gradient into the embedding's shard (HSDP: replicated once, after both). Over a pipeline the
    last stage holds a copy, whose gradient the `tied` all-reduce sums with the first stage's:
    after the data-parallel all-reduce, or under ZeRO-1 before the reduce-scatter (each stage shards
    its copy in its own layout), the last stage's bucket then waiting for the end of the step; the
    gradient norm counts it once (clipping at 0.01 moves every step: counted twice, the embedding
    drifts 1e-3 from the reference)."""
    check_plan(TIED, plan)


QK_NORM = str(Path(__file__).resolve().parent / "data" / "qk-norm-tiny.yaml")  # a norm over each q and k head


@pytest.mark.parametrize("plan", ["tp=2,gbs=2", "tp=2,sp=1,gbs=2", "dp=2,tp=2,zero=3,gbs=4", "pp=2,gbs=4",
                                  "cp=2,cp_impl=ring,gbs=2"])
def test_qk_norms_match_reference(plan):
    """The q and k norms' one weight serves every head: each tp rank's gradient covers its own heads
    and the qkv block's input-gradient collective sums them (with or without sp)."""
    check_plan(QK_NORM, plan)


MLA = str(Path(__file__).resolve().parent / "data" / "mla-tiny.yaml")  # DeepSeek-V3's attention, tiny


@pytest.mark.parametrize("plan", ["tp=2,gbs=2", "tp=2,sp=1,gbs=2", "cp=2,gbs=2", "tp=2,cp=2,cp_impl=ring,gbs=2",
                                  "pp=2,gbs=4,recompute=full", "dp=2,zero=3,gbs=4",
                                  "tp=2,gbs=2,flash_attention=0,recompute=selective"])
def test_latent_attention_matches_reference(plan):
    """Multi-head latent attention: the latents' projections and norms whole on every tp rank, their
    gradients summed over tp (with the input gradient, or under sp with the first norm's); the heads'
    up projections split; K (rotary part shared by the heads) and the narrower V side by side through
    context parallelism's all-gather and the ring."""
    check_plan(MLA, plan)


def test_latent_attention_without_a_q_latent_matches_reference(tmp_path):
    """DeepSeek-V2-Lite's layout: queries projected from the hidden state directly."""
    path = tmp_path / "mla-no-q-latent.yaml"
    path.write_text(Path(MLA).read_text().replace("q_lora_rank: 24\n", ""))
    check_plan(str(path), "tp=2,sp=1,gbs=2")


WINDOW = str(Path(__file__).resolve().parent / "data" / "window-tiny.yaml")  # a sliding window on layer 0


@pytest.mark.parametrize("plan", ["tp=2,gbs=2", "cp=2,gbs=2", "pp=2,gbs=4", "dp=2,flash_attention=0,gbs=4"])
def test_sliding_window_matches_reference(plan):
    """A windowed layer beside a full one: under tp each rank masks its heads' band, under context
    parallelism's all-gather its queries' band against the gathered keys, and the unfused attention
    masks the band in its scores."""
    check_plan(WINDOW, plan)


@pytest.mark.parametrize("plan", ["dp=2,pp=2,zero=2,gbs=8", "dp=2,zero=3,zero_impl=yafsdp,gbs=4"])
def test_tied_embeddings_refused_where_not_run(plan):
    from simexec.exec.rank.unsupported_plans import unsupported

    why = unsupported(resolved(TIED, plan))
    assert why is not None and "tied embeddings" in why


@pytest.mark.parametrize("model,plan", CORE, ids=[p for _, p in CORE])
def test_plan_matches_reference(model, plan):
    from simexec.exec.rank.unsupported_plans import unsupported

    rp = resolved(model, plan)
    why = unsupported(rp)
    if why:
        pytest.xfail(why)
    check_plan(model, plan)


def _reduce_scatter_main(rank: int, port: int, out_q) -> None:
    """Two gloo ranks: the executor's CPU reduce-scatter reports completion before `wait()`, and its
    slice is the sum (gloo's own reports completion only inside `wait()`)."""
    import time

    import torch.distributed as dist

    from simexec.exec.rank.collectives import TorchComm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.arange(8.0) + 100 * rank
    out = torch.empty(4)
    work = TorchComm.reduce_scatter(out, x, async_op=True)
    deadline = time.monotonic() + 20
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.005)
    completed = work.is_completed()
    work.wait()
    out_q.put((rank, completed, out.tolist(), x.tolist()))
    dist.destroy_process_group()


def test_cpu_reduce_scatter_completes_before_its_wait():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_reduce_scatter_main, args=(r, port, q), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=TIMEOUT_S) for _ in procs)
    for p in procs:
        p.join(timeout=10)
    total = [100.0 + 2 * i for i in range(8)]
    for rank, completed, out, x in got:
        assert completed, f"rank {rank}: the reduce-scatter reported completion only when waited"
        assert out == total[4 * rank: 4 * rank + 4]
        assert x == [i + 100.0 * rank for i in range(8)]  # the input is left as it was


def test_execute_in_process_trains_as_the_reference_and_traces_every_instruction(tmp_path):
    """`execute_in_process`: one rank in the caller's process, no Ray (a GPU machine without it):
    the reference's losses, a trace of every instruction under the program's fingerprint, the CPU a
    step, and the caller's thread count left as it was. A plan of several ranks is refused."""
    from simexec.errors import ExecError
    from simexec.exec.api import execute_in_process
    from simexec.program.lower import lower
    from simexec.trace.schema import Trace

    threads = torch.get_num_threads()
    res = execute_in_process("gpt-tiny", "local", "dp=1,gbs=4,dtype=fp32", steps=STEPS, seq_len=32,
                             trace_path=tmp_path / "t.json")
    assert torch.get_num_threads() == threads
    assert res.losses == pytest.approx(_reference("gpt-tiny", 4, 32, STEPS)["losses"], rel=RTOL)
    program = lower(resolved("gpt-tiny", "dp=1,gbs=4"), symmetric=False)
    trace = Trace.load(tmp_path / "t.json")
    assert {e.id for e in trace.events} == {i.id for i in program if i.kind != "memory"}
    assert trace.meta["program"] == program.fingerprint() and trace.meta["machine"]["ray"] is None
    assert len(trace.meta["summary"]["cpu_times_s_per_rank"]["0"]) == STEPS
    with pytest.raises(ExecError, match=r"in this process has one rank; plan .* has 2"):
        execute_in_process("gpt-tiny", "local", "dp=2,gbs=4,dtype=fp32", steps=1, seq_len=32)


def test_cli_execute_in_process_writes_the_trace_and_the_profile(tmp_path, capsys):
    """`simexec execute --in-process`: the run's files as `execute` writes them, the torch.profiler
    trace with the instructions as ranges; options that need Ray or several ranks are refused in one line."""
    import json as _json

    from simexec.cli import main

    threads = torch.get_num_threads()
    rc = main(["execute", "--model", "gpt-tiny", "--cluster", "local", "--plan", "dp=1,gbs=2,dtype=fp32",
               "--seq-len", "32", "--steps", "2", "--in-process", "--trace", str(tmp_path / "t.json"),
               "--profile", str(tmp_path / "prof")])
    assert rc == 0 and torch.get_num_threads() == threads
    assert "losses" in capsys.readouterr().out and (tmp_path / "t.json").is_file()
    names = {e["name"] for e in _json.loads((tmp_path / "prof" / "rank0.pt.trace.json").read_text())["traceEvents"]
             if e.get("cat") == "user_annotation"}
    assert {"fwd.qkv.L0.m0", "bwd.qkv.L0.m0"} <= names
    for extra, words in ((["--plan", "dp=2,gbs=2"], "has 2"), (["--plan", "dp=1,gbs=2", "--backend", "xla"],
                                                               "--backend xla does not apply")):
        args = ["execute", "--model", "gpt-tiny", "--cluster", "local", "--in-process"] + extra
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err
