"""The split backward of zero-bubble schedules on one block: B and then W give the whole backward's
gradients, W through autograd's own accumulation."""
import torch
import torch.nn.functional as F

from simexec.exec.weight_grads import backward_inputs


def _run_to(outs, grads, inputs):
    torch.autograd.backward(outs, grads, retain_graph=True, inputs=inputs)


def _run_whole(outs, grads):
    torch.autograd.backward(outs, grads)


def _params():
    torch.manual_seed(0)
    return {"w": torch.randn(8, 16, requires_grad=True), "b": torch.randn(16, requires_grad=True),
            "g": (torch.rand(8) + 0.5).requires_grad_()}


def _block(x, p):
    """A norm, a GEMM with a bias, a GELU, and a second use of the norm's weight downstream."""
    h = F.layer_norm(x, (8,), p["g"])
    return F.gelu(h @ p["w"] + p["b"]) * p["g"].sum()


def test_input_pass_then_weight_pass_equals_the_whole_backward():
    p = _params()
    x = torch.randn(4, 8)
    dy = torch.randn(4, 16)
    x1 = x.clone().requires_grad_()
    _block(x1, p).backward(dy)
    want = {n: t.grad.clone() for n, t in p.items()}
    for t in p.values():
        t.grad = None
    fired = []
    p["w"].register_post_accumulate_grad_hook(lambda t: fired.append("w"))
    x2 = x.clone().requires_grad_()
    y = _block(x2, p)
    deferred = backward_inputs((y,), (dy,), [x2], _run_to, _run_whole)
    assert torch.allclose(x2.grad, x1.grad, atol=1e-6)
    assert all(t.grad is None for t in p.values()) and not fired
    deferred.run()
    for n, t in p.items():
        assert torch.allclose(t.grad, want[n], atol=1e-5), n
    assert fired == ["w"]


def test_a_block_without_inputs_needing_gradients_leaves_everything_to_the_weight_pass():
    table = torch.randn(10, 4, requires_grad=True)
    ids = torch.tensor([1, 3, 3, 7])
    dy = torch.randn(4, 4)
    out = F.embedding(ids, table)
    deferred = backward_inputs((out,), (dy,), [], _run_to, _run_whole)
    assert table.grad is None
    deferred.run()
    want = torch.zeros(10, 4).index_add_(0, ids, dy)
    assert torch.allclose(table.grad, want)


def test_a_block_without_parameters_runs_its_backward_whole():
    x = torch.randn(3, 5, requires_grad=True)
    y = torch.softmax(x, -1)
    assert backward_inputs((y,), (torch.ones(3, 5),), [x], _run_to, _run_whole) is None
    assert x.grad is not None


def test_the_analysis_kept_for_a_block_serves_its_next_micro_batches():
    p = _params()
    xs, dys = [torch.randn(4, 8) for _ in range(3)], [torch.randn(4, 16) for _ in range(3)]
    for x, dy in zip(xs, dys):
        _block(x.clone().requires_grad_(), p).backward(dy)
    want = {n: t.grad.clone() for n, t in p.items()}
    for t in p.values():
        t.grad = None
    cache = {}
    for x, dy in zip(xs, dys):
        x2 = x.clone().requires_grad_()
        backward_inputs((_block(x2, p),), (dy,), [x2], _run_to, _run_whole, cache, "block").run()
    assert list(cache) == ["block"]
    for n, t in p.items():
        assert torch.allclose(t.grad, want[n], atol=1e-5), n
