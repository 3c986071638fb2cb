"""Pipeline schedules: every unit once, forward before backward, warm-up depths as published."""
import pytest

from simexec.errors import PlanError
from simexec.program.schedules import Action, exchange_groups, format_order, pipeline_order, place_of, stage_of


@pytest.mark.parametrize("schedule,pp,m,vpp", [
    ("gpipe", 4, 6, 1), ("1f1b", 4, 6, 1), ("1f1b", 2, 1, 1), ("interleaved-1f1b", 2, 4, 2),
    ("interleaved-1f1b", 4, 8, 3), ("interleaved-1f1b", 4, 4, 2),
])
def test_every_unit_runs_once_and_forward_precedes_backward(schedule, pp, m, vpp):
    order = pipeline_order(schedule, pp, m, vpp)
    for rank, actions in order.items():
        assert sorted(actions) == sorted(Action(c, k, i) for c in range(vpp) for k in "FB" for i in range(m))
        pos = {a: n for n, a in enumerate(actions)}
        for c in range(vpp):
            for i in range(m):
                assert pos[Action(c, "F", i)] < pos[Action(c, "B", i)]


def test_1f1b_warmup_is_p_minus_rank_minus_1():
    order = pipeline_order("1f1b", 4, 8)
    for rank, actions in order.items():
        first_b = next(n for n, a in enumerate(actions) if a.kind == "B")
        assert first_b == (4 - rank - 1) + 1  # warm-up forwards, then one steady-state forward


def test_1f1b_keeps_at_most_p_micro_batches_in_flight():
    for rank, actions in pipeline_order("1f1b", 4, 16).items():
        live = peak = 0
        for a in actions:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == 4 - rank


def test_gpipe_keeps_every_micro_batch_in_flight():
    actions = pipeline_order("gpipe", 4, 16)[0]
    assert [a.kind for a in actions] == ["F"] * 16 + ["B"] * 16


def test_interleaved_matches_megatron_order_for_two_ranks_two_chunks():
    # Megatron-LM's forward_backward_pipelining_with_interleaving, p=2, v=2, m=4, rank 0:
    # warm-up 2*(p-1-0) + (v-1)*p = 4 forwards: chunk 0 mb 0,1 then chunk 1 mb 0,1.
    actions = pipeline_order("interleaved-1f1b", 2, 4, 2)[0]
    assert [str(a) for a in actions[:6]] == ["0F0", "0F1", "1F0", "1F1", "0F2", "1B0"]


def test_interleaved_runs_every_forward_first_when_micro_batches_equal_stages():
    # Megatron-LM: `num_microbatches == pipeline_parallel_size` sets all_warmup_microbatches
    for rank, actions in pipeline_order("interleaved-1f1b", 4, 4, 2).items():
        assert [a.kind for a in actions] == ["F"] * 8 + ["B"] * 8


@pytest.mark.parametrize("pp,m,vpp", [(2, 4, 2), (4, 8, 3), (4, 4, 2)])
def test_exchange_groups_pair_only_the_interleaved_steady_state(pp, m, vpp):
    for rank in range(pp):
        acts = pipeline_order("interleaved-1f1b", pp, m, vpp)[rank]
        groups = exchange_groups(acts, "interleaved-1f1b", pp, rank, m, vpp)
        assert [a for g in groups for a in g] == acts
        first_b = next(n for n, a in enumerate(acts) if a.kind == "B")
        pairs = [g for g in groups if len(g) == 2]
        assert all(g[0].kind == "F" and g[1].kind == "B" for g in pairs)
        if pairs:  # the steady state: from the forward before the first backward, every forward pairs
            assert pairs[0] == [acts[first_b - 1], acts[first_b]]
            assert len(pairs) == sum(1 for a in acts[first_b - 1:] if a.kind == "F")
        else:  # all forwards first
            assert all(a.kind == "F" for a in acts[:first_b]) and all(a.kind == "B" for a in acts[first_b:])
    assert all(len(g) == 1 for g in exchange_groups(pipeline_order("1f1b", 4, 8)[0], "1f1b", 4, 0, 8))


def test_interleaved_needs_micro_batches_divisible_by_pp():
    with pytest.raises(PlanError, match="divisible by pp=4"):
        pipeline_order("interleaved-1f1b", 4, 6, 2)


def test_unknown_schedule_is_refused():
    with pytest.raises(PlanError, match="unknown schedule"):
        pipeline_order("zigzag", 2, 2)


def test_format_order_prints_one_line_per_rank():
    text = format_order(pipeline_order("1f1b", 2, 2))
    assert text.splitlines()[0].startswith("rank 0: 0F0")
    assert len(text.splitlines()) == 2


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 4), (4, 3), (4, 8)])
def test_zb_h1_runs_every_pass_once_input_gradient_before_weight_gradient(pp, m):
    for rank, actions in pipeline_order("zb-h1", pp, m).items():
        assert sorted(actions) == sorted(Action(0, k, i) for k in "FBW" for i in range(m))
        pos = {a: n for n, a in enumerate(actions)}
        for i in range(m):
            assert pos[Action(0, "F", i)] < pos[Action(0, "B", i)] < pos[Action(0, "W", i)]
        # forwards and input-gradient backwards keep 1F1B's order
        assert [a for a in actions if a.kind != "W"] == pipeline_order("1f1b", pp, m)[rank]


def test_zb_h1_defers_rank_r_weight_passes_and_holds_pp_micro_batches():
    """Qi et al. 2024, §3.1: rank r leaves r weight passes to the cool-down; a micro-batch's activations
    live until its W, so every rank holds pp of them, the first rank's 1F1B peak."""
    pp, m = 4, 8
    for rank, actions in pipeline_order("zb-h1", pp, m).items():
        last_b = max(n for n, a in enumerate(actions) if a.kind == "B")
        assert len(actions) - 1 - last_b == rank + 1  # its own W and the r deferred ones
        live = peak = 0
        for a in actions:
            live += {"F": 1, "B": 0, "W": -1}[a.kind]
            peak = max(peak, live)
        assert peak == pp
    # the first rank has nothing to defer: each B is followed by its own W
    assert [str(a) for a in pipeline_order("zb-h1", 2, 3)[0]] == ["0F0", "0F1", "0B0", "0W0", "0F2", "0B1", "0W1",
                                                                  "0B2", "0W2"]
    assert [str(a) for a in pipeline_order("zb-h1", 2, 3)[1]] == ["0F0", "0B0", "0F1", "0B1", "0W0", "0F2", "0B2",
                                                                  "0W1", "0W2"]


@pytest.mark.parametrize("pp,m,vpp", [(2, 4, 2), (4, 8, 2), (4, 4, 3)])
def test_interleaved_zb_keeps_interleaved_order_with_a_shorter_warm_up(pp, m, vpp):
    """torch.distributed.pipelining's ScheduleInterleavedZeroBubble: interleaved 1F1B's units, (v-1)p +
    (p-1-r) forwards of warm-up, each B then the weight pass of the oldest B owed one (r owed to the end)."""
    order = pipeline_order("interleaved-zb", pp, m, vpp)
    for rank, actions in order.items():
        assert sorted(actions) == sorted(Action(c, k, i) for c in range(vpp) for k in "FBW" for i in range(m))
        pos = {a: n for n, a in enumerate(actions)}
        for c in range(vpp):
            for i in range(m):
                assert pos[Action(c, "F", i)] < pos[Action(c, "B", i)] < pos[Action(c, "W", i)]
        first_b = next(n for n, a in enumerate(actions) if a.kind == "B")
        assert first_b == min((vpp - 1) * pp + pp - 1 - rank, m * vpp) + 1
        fb = [a for a in actions if a.kind != "W"]
        ref = [a for a in pipeline_order("interleaved-1f1b", pp, m, vpp)[rank]]
        assert [a for a in fb if a.kind == "F"] == [a for a in ref if a.kind == "F"]
        assert [a for a in fb if a.kind == "B"] == [a for a in ref if a.kind == "B"]
        assert [(a.chunk, a.mb) for a in actions if a.kind == "W"] == [(a.chunk, a.mb) for a in fb if a.kind == "B"]
    assert pipeline_order("interleaved-zb", 2, 4, 1) == pipeline_order("zb-h1", 2, 4)


def test_zb_v_is_torch_pipelinings_order_over_a_v():
    """ZB-V as torch.distributed.pipelining's ScheduleZBVZeroBubble builds it (its `_calculate_single_rank_
    operations`, run without a process group), rank r holding stages r and 2p-1-r; including fewer
    micro-batches than the 2p-1 its warm-up is built for."""
    import types

    from torch.distributed.pipelining import schedules as torch_schedules

    kinds = {torch_schedules._ComputationType.FORWARD: "F", torch_schedules._ComputationType.BACKWARD_INPUT: "B",
             torch_schedules._ComputationType.BACKWARD_WEIGHT: "W"}
    for pp in (1, 2, 3, 4, 6):
        for m in range(1, 3 * pp + 2):
            this = types.SimpleNamespace(pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m)
            for rank, actions in pipeline_order("zb-v", pp, m, 2).items():
                theirs = [a for a in torch_schedules.ScheduleZBVZeroBubble._calculate_single_rank_operations(this, rank)
                          if a is not None]
                assert [(stage_of("zb-v", pp, rank, a.chunk), a.kind, a.mb) for a in actions] == \
                       [(a.stage_index, kinds[a.computation_type], a.microbatch_index) for a in theirs]


def test_dualpipev_is_torch_pipelinings_order_with_its_pairs_run_in_turn():
    """DualPipeV as torch.distributed.pipelining's ScheduleDualPipeV builds it, over the same V as ZB-V: an
    overlapped pair is its forward then its whole backward, as torch's runtime runs it without DualPipe's
    kernels, and a whole backward is the input-gradient pass followed at once by the weight pass."""
    import types

    from torch.distributed.pipelining import schedules as ts

    kinds = {ts._ComputationType.FORWARD: "F", ts._ComputationType.BACKWARD_INPUT: "B",
             ts._ComputationType.BACKWARD_WEIGHT: "W"}

    def flat(a):
        if a.computation_type == ts._ComputationType.OVERLAP_F_B:
            return [x for s in a.sub_actions for x in flat(s)]
        if a.computation_type == ts._ComputationType.FULL_BACKWARD:
            return [(a.stage_index, "B", a.microbatch_index), (a.stage_index, "W", a.microbatch_index)]
        return [(a.stage_index, kinds[a.computation_type], a.microbatch_index)]

    for pp in (1, 2, 3, 4, 6):
        for m in range(2 * pp, 4 * pp + 2):
            this = types.SimpleNamespace(pp_group_size=pp, num_stages=2 * pp, _n_microbatches=m)
            for rank, actions in pipeline_order("dualpipev", pp, m, 2).items():
                theirs = [x for a in ts.ScheduleDualPipeV._calculate_single_rank_operations(this, rank) if a is not None
                          for x in flat(a)]
                assert [(stage_of("dualpipev", pp, rank, a.chunk), a.kind, a.mb) for a in actions] == theirs
    with pytest.raises(PlanError, match="at least 2\\*pp = 8 micro-batches, got 7"):
        pipeline_order("dualpipev", 4, 7, 2)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_zb_v_places_two_chunks_per_rank_in_a_v(pp):
    """Rank r holds stages r and 2p-1-r: the first rank the first and last stages, the last rank the two
    middle ones, so the turn from the first chunk to the second stays on it."""
    for rank in range(pp):
        stages = [stage_of("zb-v", pp, rank, c) for c in (0, 1)]
        assert stages == [rank, 2 * pp - 1 - rank]
        assert [place_of("zb-v", pp, s) for s in stages] == [(rank, 0), (rank, 1)]
    assert place_of("zb-v", pp, pp - 1)[0] == place_of("zb-v", pp, pp)[0] == pp - 1
    assert [place_of("interleaved-1f1b", pp, s) for s in range(2 * pp)] == [(s % pp, s // pp) for s in range(2 * pp)]


@pytest.mark.parametrize("schedule,pp,m", [("zb-v", 2, 1), ("zb-v", 2, 4), ("zb-v", 4, 3), ("zb-v", 4, 8),
                                           ("dualpipev", 2, 4), ("dualpipev", 4, 8), ("dualpipev", 4, 13)])
def test_v_schedules_run_every_pass_once_input_gradient_before_weight_gradient(schedule, pp, m):
    for actions in pipeline_order(schedule, pp, m, 2).values():
        assert sorted(actions) == sorted(Action(c, k, i) for c in range(2) for k in "FBW" for i in range(m))
        pos = {a: n for n, a in enumerate(actions)}
        for c in range(2):
            for i in range(m):
                assert pos[Action(c, "F", i)] < pos[Action(c, "B", i)] < pos[Action(c, "W", i)]
        # a micro-batch's second chunk goes backward before its first
        assert all(pos[Action(1, "B", i)] < pos[Action(0, "B", i)] for i in range(m))


def test_plan_check_prints_the_stages_each_rank_holds_and_its_order(capsys):
    """`simexec plan check --order`: the V's stages per rank, and the order every rank runs."""
    import json

    from simexec.cli import main

    assert main(["plan", "check", "--model", "gpt-tiny", "--cluster", "local", "--plan",
                 "pp=2,vpp=2,gbs=4,schedule=zb-v", "--order", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["stages"] for r in out["per_stage"]] == [[0, 3], [1, 2]]
    assert out["order"] == {str(r): [str(a) for a in acts] for r, acts in pipeline_order("zb-v", 2, 4, 2).items()}
    assert main(["plan", "check", "--model", "gpt-tiny", "--cluster", "local", "--plan", "pp=2,vpp=2,gbs=4", "--order"]) == 0
    text = capsys.readouterr().out
    assert "0,2" in text and "rank 1: 0F0 " in text
