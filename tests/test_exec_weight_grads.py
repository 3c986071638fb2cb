"""The split backward of zero-bubble schedules on one block: B and then W give the whole backward's
gradients, W through autograd's own accumulation."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from simexec.exec.nn.weight_grads import backward_inputs


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


def test_the_sequence_parallel_linear_computes_each_gradient_in_its_own_pass():
    """The sp linear (`GatheredLinear`) is a Python autograd function, whose `needs_input_grad` the
    engine cannot narrow: the input pass must not read the re-gathered input for the weight gradient,
    nor the weight pass compute the input gradient again; the gradients are the whole backward's."""
    from simexec.exec.nn.ops import GatheredLinear

    torch.manual_seed(0)
    x0, w, dy = torch.randn(4, 8), torch.randn(8, 16, requires_grad=True), torch.randn(4, 16)
    fetched = []

    def fetch():
        fetched.append(1)
        return x0

    x1 = x0.clone().requires_grad_()
    GatheredLinear.apply(x1, w, fetch).backward(dy)
    want_x, want_w = x1.grad, w.grad.clone()
    w.grad, fetched[:] = None, []
    x2 = x0.clone().requires_grad_()
    y = GatheredLinear.apply(x2 * 1.0, w, fetch)  # its input a node, as a block's is behind its norm
    deferred = backward_inputs((y,), (dy,), [x2], _run_to, _run_whole)
    assert torch.allclose(x2.grad, want_x) and w.grad is None and not fetched
    x2.grad = None
    deferred.run()
    assert torch.allclose(w.grad, want_w) and len(fetched) == 1 and x2.grad is None


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


@pytest.mark.parametrize("model", ["gpt-tiny", "window", "qk-norm", "mla"])
def test_the_host_model_counts_the_weight_pass_engine_calls_the_executor_makes(model):
    """`simexec.sim.host.operators.weight_pass_calls` against the batches the executor forms for each block."""
    from torch.autograd.graph import get_gradient_edge

    from simexec.exec.nn.gpt import GPT
    from simexec.exec.nn.param_layout import Layout, init_full
    from simexec.exec.nn.weight_grads import analyse
    from simexec.specs.model import get_model
    from simexec.sim.host.operators import weight_pass_calls

    data = Path(__file__).resolve().parent / "data"
    m = get_model(str(data / f"{model}-tiny.yaml") if model != "gpt-tiny" else model)
    M = GPT(m, Layout(), {n: t.clone().requires_grad_() for n, t in init_full(m, 0).items()}, flash=True)
    T = 16

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    def calls(outs, inputs):
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        an = analyse([get_gradient_edge(o).node for o in outs], inputs)
        return len(an.batches) + (1 if an.from_outputs else 0)

    x, o, a, r = leaf(1, T, m.hidden), leaf(1, T, m.heads * m.value_head_dim), None, leaf(1, T, m.hidden)
    got = {"qkv": calls(M.qkv(0, x, torch.arange(T)), [x]), "proj": calls((M.proj(0, o, r),), [o, r])}
    a = M.fc1(0, x)
    got["fc1"] = calls((a,), [x])
    a = a.detach().requires_grad_()
    got["fc2"] = calls((M.fc2(0, a, r),), [a, r])
    got["head"] = calls(M.head(x, None), [x])
    assert got == {b: weight_pass_calls(b, m, sp=False) for b in got}
