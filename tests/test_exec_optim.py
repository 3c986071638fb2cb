"""The executor's Adam: mixed precision keeps fp32 masters and moments for 16-bit parameters, so
that updates below the 16-bit spacing accumulate; fp32 parameters are updated in place."""
import torch

from simexec.exec.nn.optim import Adam


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


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Aten operators dispatched, and the largest tensor a cast made."""

    def __init__(self):
        super().__init__()
        self.n, self.largest_cast = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.n += 1
        if func is torch.ops.aten._to_copy.default:
            self.largest_cast = max(self.largest_cast, out.numel())
        return out


def test_16bit_gradients_are_cast_a_piece_at_a_time_with_the_same_update():
    """Without master_grads the fp32 copies of 16-bit gradients never exceed a piece (the program
    counts none), and the update is bit for bit the one of casting them all at once."""
    from simexec.exec.nn.optim import PIECE
    from simexec.sim.host.operators import adam_ops

    torch.manual_seed(0)
    sizes = (3 * PIECE + 5, 7, PIECE // 2, 2 * PIECE)
    a = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    b = [p.clone() for p in a]
    pieced, whole = Adam(a), Adam(b, master_grads=True)
    for step in range(3):
        grads = [torch.randn(n).to(torch.bfloat16) for n in sizes]
        ops = _Ops()
        with ops:
            pieced.step(grads)
        whole.step(grads)
        assert ops.largest_cast <= PIECE
        if step:  # the simulator's count of the step's operators (`adam_ops`), within two
            assert abs(ops.n - adam_ops(len(sizes), "bf16", sum(sizes))) <= 2, ops.n
    for x, y, u, v in zip(a, b, pieced.master, whole.master):
        assert torch.equal(x, y) and torch.equal(u, v)
