"""A zero-bubble schedule's split backward: a block's input gradients now, its weight gradients later.

The input-gradient pass (B) runs autograd from the block's outputs to its inputs alone and keeps the
graph, and keeps the gradients flowing into the nodes where a parameter's gradient path joins the
inputs' (the GEMM whose other operand is the weight, a norm's affine, a bias add): through prehooks
the first time a block runs, then as further outputs of the same engine call. The
weight-gradient pass (W) runs autograd from those nodes, with those gradients, to the parameters
alone, so no input-gradient kernel runs twice (the approach of torch.distributed.pipelining's
`stage_backward_input` / `stage_backward_weight`, which torchtitan's zero-bubble schedules use).
The gradients reach the parameters through autograd's own accumulation, so gradient hooks (ZeRO-2's
bucket copies) and `.grad` views into buckets behave as in a whole backward.

Memory follows: the block's saved tensors live until W, and so do the kept gradients.

Finding the joins walks the block's graph, which costs a CPU rank about what a small block's backward
does; a block builds the same graph every micro-batch, so the walk's result is kept per block as the
joins' places (a path of `next_functions` indices from an output) and checked against each new graph.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _python_backward(roots: list, grads: list, keep: bool, inputs: list) -> None:
    torch.autograd.backward(roots, grads, retain_graph=keep, inputs=inputs)


def _engine_backward(roots: list, grads: list, keep: bool, inputs: list) -> None:
    """torch.autograd.backward without its Python-side checks (a fifth of its cost on a CPU rank)."""
    _ENGINE.run_backward(tuple(roots), tuple(grads), keep, False, tuple(inputs), True, True)


def _python_grads(outs: tuple, grads: tuple, targets: tuple) -> tuple:
    return torch.autograd.grad(outs, targets, grads, retain_graph=True, allow_unused=True)


def _engine_grads(outs: tuple, grads: tuple, targets: tuple) -> tuple:
    """torch.autograd.grad(outs, targets, grads, retain_graph=True, allow_unused=True) without its
    Python-side checks: the gradients of tensors or of nodes' outputs (GradientEdges)."""
    return _ENGINE.run_backward(outs, grads, True, False, targets, True, False)


try:
    _ENGINE = torch.autograd.Variable._execution_engine
    _backward, _grads = _engine_backward, _engine_grads
except AttributeError:  # pragma: no cover - a torch without the engine handle
    _backward, _grads = _python_backward, _python_grads


class SplitPass:
    """The pass of a split backward autograd is running: "input" (B), "weight" (W), or None (a whole
    backward). The engine skips a built-in node's unneeded gradients, but a Python autograd
    function's `needs_input_grad` is fixed at its forward: one that computes both gradients reads
    this to compute only the pass's own (`simexec.exec.nn.ops.GatheredLinear`, `_RMSNorm`)."""

    now: Optional[str] = None


class DeferredWeights:
    """What W needs: batches of parameters with their join nodes, and the gradients B kept for them."""

    def __init__(self, batches: list[tuple[list[Tensor], list[Node], bool]], kept: dict[Node, tuple],
                 from_outputs: Optional[tuple[list[Tensor], list[GradientEdge], list[Tensor]]] = None):
        self.batches, self.kept, self.from_outputs = batches, kept, from_outputs

    def run(self) -> None:
        SplitPass.now = "weight"
        try:
            self._run()
        finally:
            SplitPass.now = None

    def _run(self) -> None:
        # a later batch may run through nodes an earlier one ran (a join downstream of another): the
        # graph is kept until the last
        last = len(self.batches) - 1
        if self.from_outputs is not None:
            params, edges, grads = self.from_outputs
            _backward(edges, grads, last >= 0, params)
        for n, (params, joins, clamp) in enumerate(self.batches):
            edges, grads = [], []
            for node in joins:
                for i, g in enumerate(self.kept[node]):
                    if g is not None:
                        edges.append(GradientEdge(node, i))
                        grads.append(g)
            if not edges:
                continue
            # a join downstream of another of its group would get a second share of what B kept for it
            clamps = [node.register_prehook(lambda _g, kept=self.kept[node]: kept) for node in joins] if clamp else []
            try:
                _backward(edges, grads, n < last, params)
            finally:
                for h in clamps:
                    h.remove()
        self.batches, self.kept, self.from_outputs = [], {}, None


Place = tuple[int, tuple[int, ...], str]  # (output index, next_functions indices from it, node type)


@dataclass
class Analysis:
    """Where a block's parameters join its inputs' gradient path: batches of (parameters, their
    joins' places, whether a group of them has joins on one another's path); None for a block
    without parameters. `from_outputs`: parameters reached from the outputs alone."""

    batches: Optional[list[tuple[list[Tensor], list[Place], bool]]]
    from_outputs: Optional[list[Tensor]] = None
    arity: Optional[dict[Place, int]] = None  # gradients flowing into each join, once seen

    def locate(self, roots: list[Node]) -> Optional[dict[Place, Node]]:
        """The join nodes of this graph, or None where it differs from the analysed one."""
        out = {}
        for _, places, _ in self.batches or ():
            for place in places:
                r, path, name = place
                node = roots[r]
                for i in path:
                    node = node.next_functions[i][0]
                    if node is None:
                        return None
                if type(node).__name__ != name:
                    return None
                out[place] = node
        return out


def _walk(roots: list[Node]) -> tuple[dict[Node, list[Node]], dict[Node, Place]]:
    """The block's graph reversed (node -> the nodes that pass it gradient, towards the outputs), and
    each node's place."""
    consumers: dict[Node, list[Node]] = defaultdict(list)
    where = {node: (r, (), type(node).__name__) for r, node in reversed(list(enumerate(roots)))}
    stack = list(roots)
    while stack:
        node = stack.pop()
        r, path, _ = where[node]
        for i, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            consumers[nxt].append(node)
            if nxt not in where:
                where[nxt] = (r, path + (i,), type(nxt).__name__)
                stack.append(nxt)
    return consumers, where


def _downstream(starts: list[Node], consumers: dict[Node, list[Node]]) -> set[Node]:
    seen, stack = set(starts), list(starts)
    while stack:
        for c in consumers.get(stack.pop(), ()):
            if c not in seen:
                seen.add(c)
                stack.append(c)
    return seen


def _batches(by_joins: dict[frozenset, list[Tensor]], consumers: dict[Node, list[Node]]) -> list[tuple[list[Tensor], set, bool]]:
    """The parameter groups merged where their joins share no node and none lies on another's
    gradient path (q, k and v beside one another; not a norm and the GEMM after it): W then makes
    one engine call per batch, each costing about what a small block's whole backward does on a CPU
    rank, and no gradient reaches a join twice."""
    batches: list[list] = []  # [params, joins, the joins' gradient sources, clamp]
    for joins, ps in by_joins.items():
        sources = _downstream(list(joins), consumers)
        for b in batches:
            if not (joins & b[2]) and not (b[1] & sources):
                b[0].extend(ps)
                b[1] |= joins
                b[2] |= sources
                b[3] = b[3] or len(joins) > 1
                break
        else:
            batches.append([list(ps), set(joins), sources, len(joins) > 1])
    return [(ps, joins, clamp) for ps, joins, _, clamp in batches]


def analyse(roots: list[Node], inputs: list[Tensor]) -> Analysis:
    """Where the parameters behind `roots` join the gradient path of `inputs` (see `Analysis`)."""
    consumers, where = _walk(roots)
    input_nodes = [get_gradient_edge(x).node for x in inputs]
    on_input_path = _downstream(input_nodes, consumers) if input_nodes else set()
    inputs_set = set(input_nodes)
    params = [n for n in consumers if n not in inputs_set and hasattr(n, "variable")]
    if not params:
        return Analysis(None)
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
    batches = [(ps, sorted((where[j] for j in joins)), clamp) for ps, joins, clamp in _batches(by_joins, consumers)]
    return Analysis(batches, roots_only)


def backward_inputs(outs: tuple[Tensor, ...], grads: tuple[Tensor, ...], inputs: list[Tensor],
                    run: Callable[[tuple, tuple, tuple], None], run_whole: Callable[[tuple, tuple], None],
                    cache: Optional[dict] = None, key=None) -> Optional[DeferredWeights]:
    """B: accumulate the gradients of `inputs` (leaves requiring grad) from `outs` seeded with
    `grads`, through `run(outs, grads, inputs)` (autograd with the graph kept); returns what W needs,
    or None for a block without parameters, whose backward `run_whole(outs, grads)` ran whole.
    `cache[key]` keeps the block's analysis from one micro-batch to the next."""
    roots = [get_gradient_edge(o).node for o in outs]
    an = cache.get(key) if cache is not None else None
    joins = an.locate(roots) if an is not None else None
    if joins is None:
        an = analyse(roots, inputs)
        if cache is not None:
            cache[key] = an
        joins = an.locate(roots)
    if an.batches is None:
        run_whole(outs, grads)
        return None
    kept: dict[Node, tuple] = {}
    SplitPass.now = "input"
    try:
        _input_pass(an, joins, outs, grads, inputs, run, kept)
    finally:
        SplitPass.now = None
    batches = [(ps, [joins[p] for p in places], clamp) for ps, places, clamp in an.batches]
    from_outputs = (an.from_outputs, [get_gradient_edge(o) for o in outs], list(grads)) if an.from_outputs else None
    return DeferredWeights(batches, kept, from_outputs)


def _input_pass(an: Analysis, joins: dict, outs: tuple, grads: tuple, inputs: list, run: Callable,
                kept: dict) -> None:
    """B's engine call: the inputs' gradients accumulated, the joins' incoming gradients kept."""
    if an.arity is not None and inputs:
        # the gradients of the inputs and of the joins' outputs from one engine call, no hooks
        places = list(joins)
        edges = [GradientEdge(joins[p], i) for p in places for i in range(an.arity[p])]
        got = _grads(tuple(outs), tuple(grads), tuple(inputs) + tuple(edges))
        for x, g in zip(inputs, got):
            if g is not None:
                x.grad = g if x.grad is None else x.grad + g
        k = len(inputs)
        for p in places:
            kept[joins[p]] = tuple(got[k:k + an.arity[p]])
            k += an.arity[p]
    else:
        hooks = [node.register_prehook(lambda g, node=node: kept.__setitem__(node, g)) for node in joins.values()]
        try:
            if inputs:
                run(outs, grads, tuple(inputs))
        finally:
            for h in hooks:
                h.remove()
        if inputs and all(node in kept for node in joins.values()):
            an.arity = {p: len(kept[node]) for p, node in joins.items()}
