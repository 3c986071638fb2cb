"""The parameter tensors of a ZeRO-3 unit, one rank's share before sharding: a stack that gathers
per parameter (DeepSpeed) issues its collectives by them, and keeps the small ones (norms, biases)
unsharded. Dense class only: experts are gathered over their own group, as one call."""
from __future__ import annotations

from simexec.specs.model import ModelSpec


def _norm(m: ModelSpec, width: float) -> list[float]:
    """A norm's tensors: LayerNorm's weight and bias, RMSNorm's weight."""
    return [width, width] if m.norm == "layernorm" else [width]


def _dense_layer(m: ModelSpec, tp: int) -> list[float]:
    """A dense, non-MLA block in forward order: norm, q k v (+biases), q/k norms, o (+bias), norm,
    the FFN's matrices (+biases)."""
    h, hd = m.hidden, m.head_dim
    q, kv = m.heads * hd / tp, m.kv_heads * hd / tp
    out = _norm(m, h)
    out += [h * q, h * kv, h * kv]
    if m.bias or m.qkv_bias:
        out += [q, kv, kv]
    if m.qk_norm:
        out += _norm(m, hd) + _norm(m, hd)
    out.append(h * q)
    if m.bias:
        out.append(h)
    out += _norm(m, h)
    ffn = m.ffn / tp
    out += [h * ffn] * (3 if m.gated else 2)
    if m.bias:
        out += [ffn] * (2 if m.gated else 1) + [h]
    return out


def unit_tensors(rp, unit: int, dense: float) -> list[float]:
    """Elements of each dense tensor of `unit` (-1 the embedding, `layers` the head) on one rank,
    summing to `dense` (the unit's dense parameters there). A MoE or MLA block is listed as its
    norms and one tensor for the rest."""
    m, tp = rp.model, rp.plan.tp
    if unit == -1:
        pos = (m.max_positions or m.seq_len) * m.hidden if m.learned_pos else 0
        out = [m.vocab * m.hidden / tp] + ([float(pos) / tp] if pos else [])
    elif unit == m.layers:
        out = _norm(m, m.hidden) + [dense - m.final_norm_params()]
    elif not m.is_moe_layer(unit) and not m.is_mla:
        out = _dense_layer(m, tp)
    else:
        norms = _norm(m, m.hidden) * 2
        out = norms + [dense - sum(norms)]
    if abs(sum(out) - dense) > 1e-6 * max(dense, 1.0):  # a layout this list does not know: one tensor
        return [dense] if dense > 0 else []
    return [t for t in out if t > 0]
