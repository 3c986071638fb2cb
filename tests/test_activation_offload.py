"""Activation CPU offloading (`offload_layers`, Megatron-Core's cpu_offloading over Transformer Engine's
cpu_offload.py): the plan's rules, the simulated peak and step time, and the executor against the
single-process reference."""
from __future__ import annotations

import pytest

from simexec.errors import PlanError
from simexec.program.lower import lower
from simexec.sim.simulate import simulate
from simexec.specs.cluster import get_cluster
from simexec.specs.model import get_model
from simexec.specs.plan import parse_plan, resolve

GIB = 2.0 ** 30


def _resolve(plan: str, model: str = "llama2-7b", cluster: str = "dgx-h100"):
    return resolve(get_model(model), get_cluster(cluster), parse_plan(plan), seq_len=4096)


@pytest.mark.parametrize("plan, words", [
    ("tp=8,offload_layers=32", "offload_layers=32 must be below the model's 32 layers"),
    ("tp=4,pp=2,offload_layers=4", "offload_layers=4 needs pp=1, got pp=2"),
    ("tp=8,recompute=selective,offload_layers=4", "offload_layers=4 needs recompute=none, got recompute=selective"),
    ("tp=8,schedule=zb-h1,offload_layers=4", "schedule=zb-h1"),
])
def test_refused_as_megatron_refuses(plan, words):
    with pytest.raises(PlanError) as exc:
        _resolve(plan)
    msg = str(exc.value)
    assert words in msg and "\n" not in msg


def test_negative_refused():
    with pytest.raises(PlanError, match="offload_layers"):
        parse_plan("tp=8,offload_layers=-1")


def test_copies_follow_te_synchronizer():
    """L=32, N=8: layer i's copy starts after its forward, layer 24+i's forward waits for it; its
    reload starts as layer 23+i's backward starts and layer i's backward waits for it."""
    prog = lower(_resolve("tp=8,gbs=1,offload_layers=8"))
    instrs = prog.ranks[0]
    names = [i.name for i in instrs]
    d2h = [i for i in instrs if i.block == "act_d2h"]
    h2d = [i for i in instrs if i.block == "act_h2d"]
    assert [i.layer for i in d2h] == list(range(8)) and [i.layer for i in h2d] == list(range(7, -1, -1))
    assert all(i.stream == "copy.act" for i in d2h + h2d)
    first_fwd = {}
    first_bwd = {}
    for i in instrs:
        if i.kind == "compute" and 0 <= i.layer < 32:
            (first_fwd if i.phase == "fwd" else first_bwd).setdefault(i.layer, i)
    for k in range(8):
        assert f"copy.act_d2h.L{k}.m0" in first_fwd[24 + k].deps
        assert f"copy.act_h2d.L{k}.m0" in first_bwd[k].deps
        assert names.index(f"copy.act_h2d.L{k}.m0") < names.index(first_bwd[23 + k].name)


def _link(bw: float):
    """One GB200 tray (4 GPUs) with its host link set to `bw` bytes/s a direction (stock: 225 GB/s)."""
    c = get_cluster("gb200-nvl72").model_copy(update={"nodes": 1})
    return c.model_copy(update={"node": c.node.model_copy(update={"host_link_bw": bw})})


PLAN = "tp=4,dp=1,gbs=1"


def test_peak_falls_with_offload_layers():
    """Each offloaded layer takes about its saved activations off the peak (pinned host memory is not
    the device's)."""
    c = _link(225e9)
    peaks = [simulate("llama2-7b", c, f"{PLAN},offload_layers={n}", seq_len=4096).peak_tensor_bytes
             for n in (0, 8, 16)]
    assert peaks[0] - peaks[1] > 1 * GIB and peaks[1] - peaks[2] > 1 * GIB


def test_step_time_holds_on_a_fast_link_and_rises_on_a_slow_one():
    fast, slow = _link(1e13), _link(1e9)
    base = simulate("llama2-7b", fast, PLAN, seq_len=4096)
    off = simulate("llama2-7b", fast, f"{PLAN},offload_layers=16", seq_len=4096)
    assert off.step_time_s == pytest.approx(base.step_time_s, rel=0.01)
    base = simulate("llama2-7b", slow, PLAN, seq_len=4096)
    off = simulate("llama2-7b", slow, f"{PLAN},offload_layers=16", seq_len=4096)
    assert off.step_time_s > 1.5 * base.step_time_s
    assert off.breakdown_s.get("offload", 0.0) > 0.0


@pytest.mark.parametrize("plan", ["dp=1,gbs=2,offload_layers=1", "tp=2,gbs=2,offload_layers=2",
                                  "dp=2,zero=1,gbs=4,offload_layers=3", "dp=2,zero=3,gbs=4,offload_layers=2",
                                  "tp=2,sp=1,gbs=2,offload_layers=1"])
def test_executor_matches_reference(plan):
    from tests.test_exec_interp import check_plan
    check_plan("gpt-tiny", plan)


def test_executor_moves_the_saved_tensors(monkeypatch):
    """In process: each offloaded layer's saved tensors (weights aside) go to the host and come back,
    and the losses are those of the run without offloading."""
    from simexec.exec.api import execute_in_process
    from simexec.exec.rank import activation_offload as ao

    moves = []
    copy = ao.ActivationOffloader.copy

    def spy(self, ins):
        out = copy(self, ins)
        moves.append((ins.block, ins.layer, ins.mb, len(self.saved[(ins.layer, ins.mb)]),
                      {t.device.type for t in self.saved[(ins.layer, ins.mb)]}))
        return out

    monkeypatch.setattr(ao.ActivationOffloader, "copy", spy)
    base = execute_in_process("gpt-tiny", "local", "dp=1,gbs=2,dtype=fp32", steps=2, seq_len=32)
    off = execute_in_process("gpt-tiny", "local", "dp=1,gbs=2,dtype=fp32,offload_layers=2", steps=2, seq_len=32)
    assert off.losses == pytest.approx(base.losses, rel=1e-6)
    assert sorted({(b, l) for b, l, _, _, _ in moves}) == [("act_d2h", 0), ("act_d2h", 1), ("act_h2d", 0), ("act_h2d", 1)]
    assert len(moves) == 2 * 2 * 2 * 2 and all(n > 0 for _, _, _, n, _ in moves)


@pytest.mark.parametrize("plan", ["dp=1,gbs=2", "tp=2,sp=1,gbs=2"])
def test_executor_peak_falls_as_the_simulator_says(plan):
    """At 256 tokens activations outweigh gpt-tiny's weights and optimizer state: each offloaded layer
    takes its saved tensors off the measured CPU peak (the interpreter keeps no device copy of them past
    the D2H copy, one after the reload), each rank's peak within 2% of the prediction, the losses those
    of the run without offloading."""
    from pathlib import Path

    from tests.test_exec_interp import run_plan

    model = str(Path(__file__).resolve().parent / "data" / "gpt-tiny-long.yaml")
    peaks, losses = [], []
    for n in (0, 1, 3):
        full = f"{plan},offload_layers={n}"
        _, results = run_plan(model, full, seq_len=256, steps=1)
        predicted = simulate(get_model(model), "local", full + ",dtype=fp32", seq_len=256).peak_memory_bytes
        for r, res in enumerate(results):
            err = res["peak_memory_bytes"] / predicted - 1
            assert abs(err) < 0.02, f"{full} rank {r}: measured {res['peak_memory_bytes']}, predicted {predicted:.0f} ({err:+.1%})"
        peaks.append(max(res["peak_memory_bytes"] for res in results))
        losses.append(next(res["losses"] for res in results if res["losses"]))
    assert peaks[0] > peaks[1] > peaks[2], peaks
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)


def test_the_xla_backend_refuses_offload_before_starting_ranks(monkeypatch):
    """Where PyTorch/XLA is installed the executor still refuses offload_layers on it, in one line, before Ray."""
    import simexec.exec.rank.xla as xla
    from simexec.errors import ExecError
    from simexec.exec.api import execute

    monkeypatch.setattr(xla, "unavailable", lambda: "")
    with pytest.raises(ExecError, match=r"backend xla: offload_layers=1 runs on gloo and nccl ranks only"):
        execute("gpt-tiny", "local", "dp=1,gbs=2,dtype=fp32,offload_layers=1", steps=1, seq_len=32, backend="xla")
