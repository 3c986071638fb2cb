"""The loss scale from step to step: Megatron-LM's DynamicGradScaler (and DeepSpeed's
DynamicLossScaler) on a sequence of overflows and clean steps, and the static scale."""
import pytest

from simexec.exec.nn.scaler import LossScaler
from simexec.specs.plan import parse_plan


def run(scaler: LossScaler, overflows: str) -> list[float]:
    """The scale after each step of `overflows` ("x": overflowed, ".": clean)."""
    out = []
    for c in overflows:
        scaler.update(c == "x")
        out.append(scaler.scale)
    return out


def test_static_scale_never_moves_but_counts_the_skipped_steps():
    s = LossScaler(1024.0)
    assert run(s, "x..x") == [1024.0] * 4
    assert s.skipped == [0, 3] and s.scales == [1024.0] * 4


def test_hysteresis_spends_lives_before_backing_off_and_growth_restores_them():
    s = LossScaler(2.0 ** 16, window=3, hysteresis=2)
    # one life lost, the next overflow halves, and every later overflow halves until a growth
    assert run(s, "xxx") == [2.0 ** 16, 2.0 ** 15, 2.0 ** 14]
    # an overflow restarts the window's count; a clean window doubles and restores both lives
    assert run(s, "..x...x") == [2.0 ** 14, 2.0 ** 14, 2.0 ** 13, 2.0 ** 13, 2.0 ** 13, 2.0 ** 14, 2.0 ** 14]
    assert run(s, "x") == [2.0 ** 13]
    assert s.skipped == [0, 1, 2, 5, 9, 10]


def test_the_scale_never_drops_below_one():
    assert run(LossScaler(4.0, window=10, hysteresis=1), "xxxx") == [2.0, 1.0, 1.0, 1.0]


def test_the_plan_sets_the_scaler():
    s = LossScaler.of(parse_plan("loss_scale=4096,loss_scale_window=500,loss_scale_hysteresis=1"))
    assert (s.scale, s.window, s.hysteresis, s.lives) == (4096.0, 500, 1, 1)
    assert LossScaler.of(parse_plan("dp=2")).scale == 1.0


def test_a_run_whose_ranks_disagree_on_the_scale_is_refused_naming_the_step():
    from simexec.errors import ExecError
    from simexec.exec.api import loss_scaling

    same = {"loss_scales": [8.0, 4.0, 4.0], "skipped_steps": [0]}
    assert loss_scaling({0: same, 1: dict(same), 2: {"losses": []}}) == same
    assert loss_scaling({0: {"losses": []}}) == {}
    other = {"loss_scales": [8.0, 8.0, 16.0], "skipped_steps": []}
    with pytest.raises(ExecError, match=r"^ranks 0 and 1 disagree on the loss scale at step 0: "
                                        r"rank 0 scale 8, skipped, rank 1 scale 8, taken$"):
        loss_scaling({0: same, 1: other})
