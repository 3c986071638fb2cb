"""The executor's launcher: Ray actors per rank, process groups, tracer, faults, teardown.

Ray tests run a stand-in for the interpreter (one real collective per collective instruction on
the real process groups, a little compute otherwise), so they check the launcher, not the maths.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time

import pytest

from simexec.specs.cluster import get_cluster
from simexec.errors import ExecError
from simexec.exec.runtime.groups import WORLD, group_specs
from simexec.exec.runtime.launcher import cpus_per_rank, live_workers
from simexec.exec.measure.tracer import Fault, InjectedFault, Tracer, build_events, clock_offsets, pick_step
from simexec.program.lower import lower
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve
from simexec.trace.schema import Trace

try:  # the stand-in below travels to the actors by value: they cannot import this test module
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
except ImportError:  # pragma: no cover
    pass


def stand_in(rp, instrs, *, steps, groups, tracer, device, seed=0, delay=0.0):
    """Same signature and result as `simexec.exec.rank.interpreter.run_rank`."""
    import torch
    import torch.distributed as dist

    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(seed))
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        sends = []
        for ins in instrs:
            tracer.begin(ins, step)
            if ins.kind == "collective":
                y = torch.ones(8)
                dist.all_reduce(y, group=groups.get(ins.axis, ins.group))
                assert y[0].item() == len(ins.group), (ins.id, y)
            elif ins.kind == "send":  # eager, as the program's sends are
                sends.append(dist.isend(torch.full((4,), float(ins.rank)), ins.peer))
            elif ins.kind == "recv":
                y = torch.empty(4)
                dist.recv(y, ins.peer)
                assert y[0].item() == ins.peer, (ins.id, y)
            elif ins.kind == "compute":
                x = torch.tanh(x @ x * 0.01)
                if delay:
                    time.sleep(delay)
            tracer.end(ins, step)
        for w in sends:
            w.wait()
        times.append(time.perf_counter() - t0)
    loss_rank = any(i.block == "loss" for i in instrs)
    return {"losses": [1.0 + step for step in range(steps)] if loss_rank else [], "step_times_s": times,
            "params": {"x": x}, "peak_memory_bytes": 1000 + tracer.rank}


def _rp(plan: str):
    return resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan(plan))


# --- without Ray ----------------------------------------------------------------------------------
def test_group_specs_cover_program_and_mesh():
    rp = _rp("dp=2,tp=2")
    specs = group_specs(rp, lower(rp, symmetric=False))
    assert specs == sorted(specs)
    assert ("tp", (0, 1)) in specs and ("tp", (2, 3)) in specs
    assert ("dp", (0, 2)) in specs and ("dp", (1, 3)) in specs
    assert (WORLD, (0, 1, 2, 3)) in specs
    assert not any(axis in ("cp", "pp") for axis, _ in specs)  # size-1 axes need no group


def test_cpus_per_rank_fits_tp_groups_on_a_node():
    assert cpus_per_rank(8, 2, [2.0]) == 0.25
    assert cpus_per_rank(4, 2, [2.0, 2.0]) == 1.0
    assert cpus_per_rank(2, 2, [16.0]) == 1.0
    assert cpus_per_rank(4, 4, [3.0, 1.0]) == 0.75


def test_fault_parse_and_fire():
    f = Fault.parse("rank=1,step=2,at=fwd.qkv.L0.m0,mode=raise")
    assert (f.rank, f.step, f.at, f.mode) == (1, 2, "fwd.qkv.L0.m0", "raise")
    assert Fault.parse("rank=0,at=3").at == 3
    with pytest.raises(ExecError, match="mode"):
        Fault.parse("rank=0,mode=explode")
    with pytest.raises(ExecError, match="unknown key"):
        Fault.parse("rank=0,when=3")
    rp = _rp("dp=1")
    instrs = lower(rp, symmetric=False).ranks[0]
    tr = Tracer(0, fault=Fault(rank=0, step=1, at=2))
    for ins in instrs:
        tr.begin(ins, 0)
        tr.end(ins, 0)
    tr.begin(instrs[0], 1)
    tr.begin(instrs[1], 1)
    with pytest.raises(InjectedFault, match=instrs[2].name):
        tr.begin(instrs[2], 1)
    assert tr.status() == {"step": 1, "current": instrs[2].name, "count": len(instrs) + 3,
                           "open": [instrs[0].name, instrs[1].name, instrs[2].name]}


def test_tracer_events_match_program_ids_and_align_clocks():
    rp = _rp("dp=2")
    program = lower(rp, symmetric=False)
    exports = {}
    for r, instrs in program.ranks.items():
        tr = Tracer(r)
        tr.sync_clock(lambda: None)
        for step in range(2):
            for ins in instrs:
                tr.begin(ins, step)
                tr.end(ins, step)
        tr.counter("params", 10.0)
        exports[r] = tr.export()
    events, counters = build_events(program, exports)
    assert {e.id for e in events} == {i.id for i in program}
    assert min(e.start_us for e in events) == 0.0
    assert all(e.dur_us >= 0 for e in events)
    assert {c.category for c in counters} <= {"params"}
    # two hosts: the second one's wall clock runs 5 ms ahead; its barrier exit says by how much
    clocks = {0: {"host": "a", "wall_minus_perf_ns": 100, "barrier_ns": 1_000},
              1: {"host": "b", "wall_minus_perf_ns": 5_000_200, "barrier_ns": 1_000}}
    off = clock_offsets(clocks)
    assert off[0] + 1_000 == off[1] + 1_000  # both barrier exits land on the same instant


# --- with Ray -------------------------------------------------------------------------------------


class Pids:
    """An `on_start` hook noting every rank's pid, to check afterwards that none outlived the run
    (other Ray sessions on this host may run rank actors of their own)."""

    def __init__(self, then=None):
        self.pids: list[int] = []
        self.then = then
        self.started = None

    def __call__(self, infos):
        self.started = time.monotonic()
        self.pids = [i["pid"] for i in infos]
        if self.then is not None:
            self.then(infos)

    def left(self) -> list[int]:
        assert self.pids, "the run never started"
        return live_workers(self.pids)


@pytest.mark.ray
def test_run_dp2_tp2_trace_json_and_teardown(ray_session, tmp_path):
    from simexec.exec.api import execute

    rp = _rp("dp=2,tp=2")
    program = lower(rp, symmetric=False)
    pids = Pids()
    res = execute("gpt-tiny", "local", "dp=2,tp=2", steps=3, runner=stand_in, return_params=True,
                  trace_path=tmp_path / "measured.json", json_path=tmp_path / "result.json", on_start=pids)
    assert res.losses == [1.0, 2.0, 3.0]
    assert len(res.step_times_s) == 3 and res.step_time_s > 0
    assert res.peak_memory_bytes_per_rank == {r: 1000 + r for r in range(4)}
    assert set(res.params) == {0, 1, 2, 3}
    assert {e.id for e in res.trace.events} == {i.id for i in program}  # one event per instruction
    trace = Trace.load(tmp_path / "measured.json")
    assert trace.kind == "measured" and trace.meta["program"] == program.fingerprint()
    assert trace.meta["trace_step"] == 2 and trace.meta["model"] == "gpt-tiny"
    import ray
    assert trace.meta["machine"]["ray"] == ray.__version__ and trace.meta["machine"]["kernel"]
    if sys.platform.startswith("linux"):  # every rank's gloo event loops ran at SCHED_IDLE
        assert trace.meta["gloo_event_loops"] == "SCHED_IDLE"
    assert trace.summary["step_time_s"] == res.step_time_s
    assert len(trace.events) == len(program)
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["losses"] == [1.0, 2.0, 3.0] and data["plan"].startswith("dp=2,tp=2")
    assert set(data["peak_memory_bytes_per_rank"]) == {"0", "1", "2", "3"}
    for key in ("ray_start_s", "actors_s", "rendezvous_s", "run_s"):
        assert key in res.timings
    print("timings", {k: round(v, 2) for k, v in res.timings.items()})
    assert pids.left() == []


def _fails(match: str, bound_s: float, **kw) -> ExecError:
    from simexec.exec.api import execute

    pids = Pids(kw.pop("on_start", None))
    with pytest.raises(ExecError, match=match) as info:
        execute("gpt-tiny", "local", kw.pop("plan", "dp=2,tp=2"), steps=kw.pop("steps", 3), on_start=pids, **kw)
    took = time.monotonic() - (pids.started or 0.0)  # from the actors being up: start-up varies with load
    assert took < bound_s, f"took {took:.1f} s after the actors started"
    assert "\n" not in str(info.value)
    assert pids.left() == [], "a rank actor outlived the run"
    return info.value


@pytest.mark.ray
def test_exception_in_one_rank_names_rank_and_instruction(ray_session, tmp_path):
    at = "fwd.fc1.L1.m0"
    err = _fails(rf"rank 2 raised on {at} \(step 1\): InjectedFault", 60, runner=stand_in, timeout_s=20,
                 fault=f"rank=2,step=1,at={at},mode=raise", trace_path=tmp_path / "t.json",
                 json_path=tmp_path / "r.json")
    assert (err.rank, err.instruction, err.kind) == (2, at, "raised")
    partial = Trace.load(tmp_path / "t.json")  # what was measured until then is saved
    assert partial.summary["error"] == str(err)
    assert any(e.id == "2:fwd.fc2.L0.m0" for e in partial.events)
    assert not any(e.id == f"2:{at}" for e in partial.events)
    assert json.loads((tmp_path / "r.json").read_text())["error"] == str(err)


@pytest.mark.ray
def test_rank_killed_mid_step(ray_session):
    err = _fails(r"rank 1 died last seen on \S+ \(step \d\)", 40, runner=functools.partial(stand_in, delay=0.01),
                 timeout_s=20, fault="rank=1,step=1,at=30,mode=kill")
    assert err.kind == "died" and err.rank == 1


@pytest.mark.ray
def test_actor_killed_from_outside(ray_session):
    """SIGKILL one rank's process, found by pid, while the ranks run."""
    def kill_rank_3(infos):
        pid = next(i["pid"] for i in infos if i["rank"] == 3)
        threading.Timer(3.0, os.kill, (pid, 9)).start()

    err = _fails(r"rank 3 died", 40, runner=functools.partial(stand_in, delay=0.005), steps=1000,
                 timeout_s=20, on_start=kill_rank_3)
    assert err.kind == "died"


@pytest.mark.ray
def test_hung_rank_is_named_within_timeout(ray_session):
    at = "fwd.attn.L2.m0"
    err = _fails(rf"rank 3 hung on {at} \(step 0\): no rank made progress for 4 s", 4 + 25, runner=stand_in,
                 timeout_s=4, fault=f"rank=3,step=0,at={at},mode=hang")
    assert err.kind == "hung"


@pytest.mark.ray
def test_hang_in_a_pipeline_blames_the_busy_rank(ray_session):
    """Every other rank ends up waiting on a peer (recv, tp collective); the hung one is in compute."""
    at = "fwd.fc1.L3.m0"  # a stage-1 compute instruction
    err = _fails(rf"rank 3 hung on {at} \(step 1\)", 4 + 25, runner=stand_in, plan="tp=2,pp=2,gbs=4",
                 timeout_s=4, fault=f"rank=3,step=1,at={at},mode=hang")
    assert err.kind == "hung"


@pytest.mark.ray
def test_unsupported_plan_refused_before_any_actor(ray_session, monkeypatch):
    import simexec.exec.api as api

    class Fake:
        @staticmethod
        def unsupported(rp):
            return "pipeline schedules (pp > 1)"

    def no_actors(self):
        raise AssertionError("actors started for a refused plan")

    monkeypatch.setitem(sys.modules, "simexec.exec.rank.unsupported_plans", Fake)
    monkeypatch.setattr("simexec.exec.runtime.launcher.Launch.start", no_actors)
    with pytest.raises(ExecError, match=r"cannot run plan .*pp=2.*: pipeline schedules"):
        api.execute("gpt-tiny", "local", "pp=2", steps=1)


@pytest.mark.ray
def test_profile_writes_a_kineto_trace_per_rank(ray_session, tmp_path):
    from simexec.exec.api import execute

    pids = Pids()
    res = execute("gpt-tiny", "local", "dp=2", steps=2, runner=stand_in, profile_dir=tmp_path / "prof", on_start=pids)
    for r in range(2):
        data = json.loads((tmp_path / "prof" / f"rank{r}.pt.trace.json").read_text())
        names = {e.get("name") for e in data["traceEvents"]}
        assert "fwd.qkv.L0.m0" in names  # instruction ranges show up in the Kineto trace
    assert "events" in res.format() and pids.left() == []


@pytest.mark.ray
def test_real_interpreter_matches_one_rank(ray_session, tmp_path):
    """The default path: `simexec.exec.rank.interpreter.run_rank` on every rank, losses against dp=1."""
    pytest.importorskip("simexec.exec.rank.interpreter")
    from simexec.exec.api import execute

    one = execute("gpt-tiny", "local", "dp=1,gbs=4,dtype=fp32", steps=3, seq_len=32)
    plan = "dp=2,tp=2,gbs=4,dtype=fp32"
    res = execute("gpt-tiny", "local", plan, steps=3, seq_len=32, trace_path=tmp_path / "t.json")
    assert res.losses == pytest.approx(one.losses, rel=1e-4)
    program = lower(resolve(get_model("gpt-tiny"), get_cluster("local"), parse_plan(plan), 32), symmetric=False)
    traced = {e.id for e in Trace.load(tmp_path / "t.json").events}
    assert traced == {i.id for i in program if i.kind != "memory"}  # memory markers take no time
    assert all(b > 0 for b in res.peak_memory_bytes_per_rank.values())
    summary = Trace.load(tmp_path / "t.json").summary
    cpu, main = summary["cpu_times_s_per_rank"], summary["main_cpu_times_s_per_rank"]  # each process's CPU a step
    assert sorted(cpu) == sorted(main) == ["0", "1", "2", "3"]
    assert all(len(cpu[r]) == len(main[r]) == 3 and 0 < min(main[r]) and all(m <= c for m, c in zip(main[r], cpu[r]))
               for r in cpu)


def test_the_trace_keeps_the_steady_step_not_one_a_stall_hit():
    """Every step is recorded; the trace keeps the one of the second half nearest that half's median
    time, so a stall in the last step does not become the trace a calibration fits. Runs of fewer
    than 4 steps, and failed runs (no step times), keep the last step with events."""
    exports = [{"records": [("fwd", s, 0, 1) for s in range(9)]}]
    times = [0.9, 0.3, 0.2, 0.2, 0.21, 0.19, 0.23, 0.2, 0.45]  # the last step stalled
    assert pick_step(exports, times) == 4  # second half 0.21 0.19 0.23 0.2 0.45: median 0.21
    assert pick_step(exports, times[:8]) in (4, 7)  # 0.21 0.19 0.23 0.2: one of the two nearest 0.205
    assert pick_step(exports, times[:3]) == 8 and pick_step(exports) == 8
    assert pick_step([{"records": []}], times) == -1


@pytest.mark.ray
def test_the_optimizer_step_does_not_wait_for_eager_sends(ray_session):
    """The program lets a stage step its optimizer while its last gradient send is in flight (the
    end of the step waits for it); under GPipe the last stage's final send completes only once the
    stage before it has worked back to that micro-batch, well after its own optimizer step."""
    from simexec.exec.api import execute

    res = execute("gpt-tiny", "local", "pp=2,gbs=8,schedule=gpipe,dtype=fp32", steps=2)
    ev = {e.id: e for e in res.trace.events if e.rank == 1}
    sends = [e for i, e in ev.items() if i.startswith("1:p2p.grad")]
    last_send = max(sends, key=lambda e: e.end_us)
    optim = ev["1:optim.optim.L-1.m-1"]
    assert optim.end_us < last_send.end_us, (optim, last_send)


def _loop_policies(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    from simexec.exec.runtime.gloo_loops import idle_gloo_loops, loop_threads

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dist.barrier()

        def policies():
            return [os.sched_getscheduler(tid) for tid in loop_threads()]

        before = policies()
        changed = idle_gloo_loops()
        after = policies()
        again = idle_gloo_loops()
        dist.barrier()
        if rank == 0:
            out.put((before, changed, after, again))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread scheduling policies are Linux's")
def test_gloo_event_loops_are_put_at_sched_idle():
    from simexec.exec.runtime.spawn import spawn_ranks

    before, changed, after, again = spawn_ranks(_loop_policies, 2, (), timeout_s=60)
    assert before and all(p == os.SCHED_OTHER for p in before)
    assert changed == len(before) == len(after) == again
    assert all(p == os.SCHED_IDLE for p in after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread scheduling policies are Linux's")
def test_gloo_event_loops_stay_as_gloo_starts_them_when_asked(monkeypatch):
    from simexec.exec.runtime.gloo_loops import POLICY_ENV
    from simexec.exec.runtime.spawn import spawn_ranks

    monkeypatch.setenv(POLICY_ENV, "default")
    before, changed, after, again = spawn_ranks(_loop_policies, 2, (), timeout_s=60)
    assert before and changed == again == 0
    assert after == before


def _send_unwaited(rank: int, world: int, port: int, out) -> None:
    import time

    import torch
    import torch.distributed as dist

    from simexec.exec.rank.collectives import SendWaiter, InflightComm
    from simexec.program.instructions import Instr

    class _Rank:  # what InflightComm.wait touches of the interpreter's rank
        step_no, inflight = 0, {}

        class tracer:
            end = staticmethod(lambda ins, step: None)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        if rank == 0:
            ins = Instr(0, "fwd.act.send", "send", "p2p.send", "send", peer=1)
            bare = dist.isend(torch.ones(1 << 16), 1)
            watched = InflightComm(_Rank(), ins, [dist.isend(torch.ones(1 << 16), 1)], None, SendWaiter.shared())
            dist.barrier()  # rank 1 has received both
            deadline = time.monotonic() + 10
            while not watched.completed() and time.monotonic() < deadline:
                time.sleep(0.01)
            out.put((bare.is_completed(), watched.completed()))
            watched.wait()
            bare.wait()
        else:
            for _ in range(2):
                dist.recv(torch.empty(1 << 16), 0)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def test_gloo_sends_complete_without_being_waited():
    """gloo's send Work stays `is_completed() == False` after its data has left until someone waits on
    it; the rank's send waiter completes it in the background, so that `reap` lets its buffer go."""
    from simexec.exec.runtime.spawn import spawn_ranks

    bare, watched = spawn_ranks(_send_unwaited, 2, (), timeout_s=60)
    assert watched
    assert not bare  # if gloo ever reports its own sends, SendWaiter can go
