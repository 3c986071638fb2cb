"""A zero-bubble schedule's split backward: a block's input gradients now, its weight gradients later.

The input-gradient pass (B) runs autograd from the block's outputs to its inputs alone and keeps the
graph. Prehooks on the nodes where a parameter's gradient path joins the inputs' (the GEMM whose
other operand is the weight, a norm's affine, a bias add) keep the gradients flowing into them. The
weight-gradient pass (W) runs autograd from those nodes, with those gradients, to the parameters
alone, so no input-gradient kernel runs twice (the approach of torch.distributed.pipelining's
`stage_backward_input` / `stage_backward_weight`, which torchtitan's zero-bubble schedules use).
The gradients reach the parameters through autograd's own accumulation, so gradient hooks (ZeRO-2's
bucket copies) and `.grad` views into buckets behave as in a whole backward.

Memory follows: the block's saved tensors live until W, and so do the kept gradients.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _python_backward(roots: list, grads: list, keep: bool, inputs: list) -> None:
    torch.autograd.backward(roots, grads, retain_graph=keep, inputs=inputs)


def _engine_backward(roots: list, grads: list, keep: bool, inputs: list) -> None:
    """torch.autograd.backward without its Python-side checks (a fifth of its cost on a CPU rank)."""
    _ENGINE.run_backward(tuple(roots), tuple(grads), keep, False, tuple(inputs), True, True)


try:
    _ENGINE = torch.autograd.Variable._execution_engine
    _backward = _engine_backward
except AttributeError:  # pragma: no cover - a torch without the engine handle
    _backward = _python_backward


class DeferredWeights:
    """What W needs: per group of parameters, the join nodes and the gradients B kept for them."""

    def __init__(self, groups: list[tuple[list[Tensor], list[Node]]], kept: dict[Node, tuple],
                 from_outputs: Optional[tuple[list[Tensor], list[GradientEdge], list[Tensor]]] = None):
        self.groups, self.kept, self.from_outputs = groups, kept, from_outputs

    def run(self) -> None:
        # a later group may run through nodes an earlier one ran (a join downstream of another): the
        # graph is kept until the last
        last = len(self.groups) - 1
        if self.from_outputs is not None:
            params, edges, grads = self.from_outputs
            _backward(edges, grads, last >= 0, params)
        for n, (params, joins) in enumerate(self.groups):
            edges, grads = [], []
            for node in joins:
                for i, g in enumerate(self.kept[node]):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            # a join downstream of another would pass it a second share of what B already kept for it
            clamps = [node.register_prehook(lambda _g, kept=self.kept[node]: kept) for node in joins] if len(joins) > 1 else []
            try:
                _backward(edges, grads, n < last, params)
            finally:
                for h in clamps:
                    h.remove()
        self.groups, self.kept, self.from_outputs = [], {}, None


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """The block's graph reversed: node -> the nodes that pass it gradient (towards the outputs)."""
    out: dict[Node, list[Node]] = defaultdict(list)
    seen, stack = set(roots), list(roots)
    while stack:
        node = stack.pop()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            out[nxt].append(node)
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return out


def _downstream(starts: list[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    seen, stack = set(starts), list(starts)
    while stack:
        for c in consumers.get(stack.pop(), ()):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen


def backward_inputs(outs: tuple[Tensor, ...], grads: tuple[Tensor, ...], inputs: list[Tensor],
                    run: Callable[[tuple, tuple, tuple], None],
                    run_whole: Callable[[tuple, tuple], None]) -> Optional[DeferredWeights]:
    """B: accumulate the gradients of `inputs` (leaves requiring grad) from `outs` seeded with
    `grads`, through `run(outs, grads, inputs)` (autograd with the graph kept); returns what W needs,
    or None for a block without parameters, whose backward `run_whole(outs, grads)` ran whole."""
    roots = [o.grad_fn for o in outs]
    consumers = _consumers(roots)
    input_nodes = [get_gradient_edge(x).node for x in inputs]
    on_input_path = _downstream(input_nodes, consumers) if input_nodes else set()
    inputs_set = set(input_nodes)
    params = [n for n in consumers if n not in inputs_set and hasattr(n, "variable")]
    if not params:
        run_whole(outs, grads)
        return None
    by_joins: dict[frozenset, list[Tensor]] = {}
    for acc in params:
        joins, seen, stack = set(), {acc}, [acc]
        while stack:
            for c in consumers.get(stack.pop(), ()):
                if c in on_input_path:
                    joins.add(c)
                elif c not in seen:
                    seen.add(c)
                    stack.append(c)
        by_joins.setdefault(frozenset(joins), []).append(acc.variable)
    roots_only = by_joins.pop(frozenset(), None)
    kept: dict[Node, tuple] = {}
    hooks = []
    for node in set().union(*by_joins) if by_joins else ():
        hooks.append(node.register_prehook(lambda g, node=node: kept.__setitem__(node, g)))
    try:
        if inputs:
            run(outs, grads, tuple(inputs))
    finally:
        for h in hooks:
            h.remove()
    groups = [(ps, list(joins)) for joins, ps in by_joins.items()]
    # parameters whose gradients come from the outputs without meeting an input's path
    from_outputs = (roots_only, [get_gradient_edge(o) for o in outs], list(grads)) if roots_only else None
    return DeferredWeights(groups, kept, from_outputs)
