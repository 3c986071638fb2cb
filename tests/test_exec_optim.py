"""The executor's Adam: mixed precision keeps fp32 masters and moments for 16-bit parameters, so
that updates below the 16-bit spacing accumulate; fp32 parameters are updated in place."""
import torch

from simexec.exec.optim import Adam


def test_bf16_parameters_get_fp32_masters_and_small_steps_accumulate():
    p = torch.ones(8, dtype=torch.bfloat16)
    opt = Adam([p], lr=1e-4)
    assert opt.master[0].dtype == torch.float32 and opt.m[0].dtype == torch.float32
    assert len(opt.state_tensors()) == 3  # m, v and the master
    for _ in range(200):
        opt.step([torch.ones(8, dtype=torch.bfloat16)])
    # each step moves the weight by ~1e-4, far below bf16's spacing at 1.0 (2**-7): the master keeps them
    assert abs(opt.master[0][0].item() - (1 - 200 * 1e-4)) < 2e-4
    assert p[0].item() == torch.tensor(opt.master[0][0].item()).to(torch.bfloat16).item() < 1.0


def test_fp32_parameters_are_their_own_masters():
    p = torch.zeros(4)
    opt = Adam([p], lr=0.1)
    assert opt.master[0] is p and len(opt.state_tensors()) == 2
    opt.step([torch.ones(4)])
    torch.testing.assert_close(p, torch.full((4,), -0.1), rtol=1e-5, atol=1e-6)
