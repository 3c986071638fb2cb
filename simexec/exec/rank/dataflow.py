"""What each block reads and writes: the interpreter's dataflow, as tables.

Activations and their gradients live in two dicts keyed by (name, layer, micro-batch); the names and
which block or collective makes each are in `BLOCK_IO` and `COLLECTIVE_IO` (`BLOCK_IO_SP` and `COLLECTIVE_IO_SP`
under sequence parallelism, where the norms are blocks of their own and the column-parallel GEMMs
re-gather their input for the backward). Where the program has no collective between two names
(tp = 1, or the identity side of an f/g pair), a read falls through to the name before it (forward,
`upstream`) or after it (backward, `downstream`).
"""
from __future__ import annotations

from typing import Optional

# block: (inputs, outputs). x: residual stream entering a layer; xa / xma: after the f-conjugate
# (gathered under sp); yp / y2p: partial sums before the g-conjugate; xm: residual after attention.
BLOCK_IO: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "embed": ((), ("emb",)),
    "qkv": (("xa",), ("q", "kv")),
    "attn": (("qf", "kvf"), ("oh",)),
    "proj": (("o", "xa"), ("yp",)),
    "fc1": (("xma",), ("a",)),
    "fc2": (("a", "xma"), ("y2p",)),
    "router": (("xma",), ("h", "w", "xs", "route")),
    "experts": (("xr",), ("yr",)),
    "moe_out": (("xma", "h", "w", "yc"), ("y2p",)),
    "head": (("xh",), ("logits", "lmax")),
    "xent": (("logits", "gmax"), ("ce",)),
    "loss": (("ceg",), ("loss",)),
    # an MTP depth's input: the shifted tokens' embedding (partial over tp, as emb), the two norms and
    # their concatenation eh, eh_proj's column-parallel output xp, gathered into its block's input x
    "mtp_embed": ((), ("memb",)),
    "mtp_norm": (("me", "hprev"), ("eh",)),  # hprev: the previous depth's hidden state (`mtp_aliases`)
    "mtp_in": (("eha",), ("xp",)),
}

# blocks whose first act is to permute an all-to-all's tokens (the interpreter frees them after)
PERMUTED_INPUT = {"experts": "xr", "moe_out": "yc"}

# collective block: (input name, output name, dimension it gathers/scatters along).
# Activations are (B, T, C): sequence dimension 1; kv is (2, B, nkv, T, hd); MoE tokens (N, C). The
# attention reads qf and kvf and writes oh: q, kv and o themselves but under cp (an all-gather of kv, or
# cp_impl=a2a's exchanges between the sequence-split and the heads-split layouts).
COLLECTIVE_IO: dict[str, tuple[str, str, Optional[int]]] = {
    "embed_out": ("emb", "x", 1),
    "attn_in": ("x", "xa", 1),
    "attn_out": ("yp", "xm", 1),
    "mlp_in": ("xm", "xma", 1),
    "mlp_out": ("y2p", "x", 1),
    "head_in": ("x", "xh", 1),
    "ce_max": ("lmax", "gmax", None),
    "ce_sum": ("ce", "ceg", None),
    "kv": ("kv", "kvf", 3),
    "heads_in": ("q", "qf", None),  # with kv -> kvf: cp_impl=a2a (`simexec.exec.rank.heads_exchange`)
    "heads_out": ("oh", "o", None),
    "dispatch": ("xs", "xd", 0),
    "etp_in": ("xd", "xr", 0),  # parallel folding with etp > 1: the dispatched rows gathered over etp
    "etp_out": ("yr", "yd", 0),  # and the experts' partial outputs reduce-scattered back
    "combine": ("yd", "yc", 0),
    "mtp_embed_out": ("memb", "me", 1),
    "mtp_eh_in": ("eh", "eha", 1),
    "mtp_eh_out": ("xp", "x", 2),  # over the hidden dimension (under sp then split over the sequence)
}
# Under sp the norms run on the sequence slice, between the g and f collectives (n1, n2, nf: their
# outputs, kept as slices until the backward's re-gather); the residual is added on the sequence slice
# (proj and fc2 read the slice x / xm); the MoE shared experts read the gathered norm output.
BLOCK_IO_SP = {
    **BLOCK_IO,
    "norm1": (("x",), ("n1",)),
    "norm2": (("xm",), ("n2",)),
    "norm": (("x",), ("nf",)),
    "proj": (("o", "x"), ("yp",)),
    "fc2": (("a", "xm"), ("y2p",)),
    "moe_out": (("xm", "xma", "w", "yc"), ("y2p",)),
}


def gathered_dispatch_io(io: dict) -> dict:
    """moe_dispatcher=allgather (Megatron-Core's MoEAllGatherTokenDispatcher): the routing weights
    travel with the tokens the dispatch all-gathers (`GPT.router_gathered`) and the experts weight
    their outputs before the combine's reduce-scatter, so the router writes no w and moe_out reads
    the weighted sum as yc."""
    return {**io, "router": (io["router"][0], ("h", "xs", "route")),
            "moe_out": (tuple(n for n in io["moe_out"][0] if n != "w"), io["moe_out"][1])}


def two_hop_io(colls: dict) -> dict:
    """moe_dispatcher=deepep across NVLink domains (DeepEP's internode kernels): the packed tokens
    (`gathered_dispatch_io`'s, each once with its routing weights) cross the network once per destination
    domain (`dispatch_net`: xs -> xn, at the forwarder of the sender's local index there), then NVLink to
    the domain's ranks that hold one of their experts (`dispatch`: xn -> xd); the combine sums each
    token's outputs at the forwarder (`combine`: yd -> yn) and then at its source (`combine_net`: yn -> yc)."""
    return {**colls, "dispatch_net": ("xs", "xn", 0), "dispatch": ("xn", "xd", 0),
            "combine": ("yd", "yn", 0), "combine_net": ("yn", "yc", 0)}


# sp: the f-conjugates gather a norm's output; the backward gathers it again for the GEMM after it
# (`<sub-layer>_regather`, delivered as an activation, not a gradient)
SP_GATHERS = {"attn_in": ("n1", "xa", 1), "mlp_in": ("n2", "xma", 1), "head_in": ("nf", "xh", 1),
              "mtp_eh_in": ("eh", "eha", 1)}
SP_REGATHERS = {b.replace("_in", "_regather"): names for b, names in SP_GATHERS.items()}
COLLECTIVE_IO_SP = {**COLLECTIVE_IO, **SP_GATHERS, **SP_REGATHERS}
# sp: the block whose forward reads a gathered norm output last (it is freed after), and the name
LAST_READER_OF_GATHERED = {"qkv": "xa", "fc1": "xma", "moe_out": "xma", "head": "xh", "mtp_in": "eha"}
# sp: the re-gathered input each column-parallel GEMM's weight gradient reads (`*_regather`)
REGATHERED_INPUT = {"qkv": "xa", "fc1": "xma", "router": "xma", "head": "xh", "mtp_in": "eha"}
# the collectives whose backward also sums tp-replicated parameters' partial gradients
TP_PARTIAL_COLLECTIVES = ("attn_in", "mlp_in", "head_in", "norm_grads", "mtp_norm_grads")
# sp: which backward collective sums a replicated parameter's partial gradient (ParamSpec.tp_partial
# names the one without sp): a norm's backward now follows the f-conjugate's reduce-scatter, so the
# second norm's rides the sub-layer's next one (attn_in) and the first and final norms', which no
# later collective of their unit carries, an all-reduce of their own (`norm_grads`)
SP_PARTIAL_BY = {"attn_in": "norm_grads", "mlp_in": "attn_in", "head_in": "norm_grads"}
# names whose one forward reader is the collective after them (when that collective exists)
CONSUMED_BY_COLLECTIVE = frozenset(("emb", "yp", "y2p", "kv", "xs", "xn", "xd", "yr", "yd", "yn", "lmax", "q",
                                    "oh", "memb", "xp"))  # their backward also sums replicated params' grads


def mtp_aliases(layers: int, depths: int, sp: bool = False, tp: int = 1) -> dict[tuple[str, int], tuple[str, int]]:
    """Where the MTP depths' reads meet the names the rest of the model writes: depth d (unit u =
    layers + 1 + d, `ModelSpec.mtp_block`) reads as `hprev` the hidden state of the head before it
    (the main head's, unit `layers`, for d = 0; else depth d - 1's head, unit u - 1 + depths, the
    lowering's `mtp_head`) after its final norm (Megatron-Core hands the depth the final_layernorm's
    output): the head's normed output `hn` (`MTP_HEAD_IO`), or under sp the norm block's on this
    rank's slice, whose gradient sums with what the head's reduce-scatter brings (at its input xh
    with tp = 1, where there is none)."""
    name = "hn" if not sp else "xh" if tp == 1 else "nf"
    return {("hprev", layers + 1 + d): (name, layers if d == 0 else layers + d + depths) for d in range(depths)}


# without sp, where MTP depths follow: the head also writes its normed input, which the next depth reads
MTP_HEAD_IO = {"head": (("xh",), ("logits", "lmax", "hn"))}


def is_mtp_block(layer: int, layers: int, depths: int) -> bool:
    """Layer numbers layers + 1 .. layers + depths are the MTP depths' blocks (`ModelSpec.mtp_block`)."""
    return layers < layer <= layers + depths


def collective_keys(block: str, layer: int, mb: int, table: dict = COLLECTIVE_IO, layers: int = 0,
                    depths: int = 0) -> tuple[tuple, tuple]:
    """(what a collective reads, what it writes). A layer's `mlp_out` writes the next layer's input;
    an MTP depth's block's writes its head's (layer + depths, the lowering's `mtp_head`)."""
    src, dst, _ = table[block]
    out_layer = layer
    if block == "embed_out":
        out_layer = 0
    elif block == "mlp_out":
        out_layer = layer + depths if is_mtp_block(layer, layers, depths) else layer + 1
    return (src, layer, mb), (dst, out_layer, mb)


_UP = {dst: src for src, dst, _ in COLLECTIVE_IO.values() if dst != "x"}  # each name but x has one maker
_DOWN = {src: dst for src, dst, _ in COLLECTIVE_IO.values() if src not in ("emb", "y2p", "x")}


# under sp the f-conjugates gather a norm's output (`SP_GATHERS`): where one is absent (a MoE layer no tp
# collective surrounds, `GPT.moe_on_slice`) its reader reads the norm's slice
_UP_SP = {**_UP, **{dst: src for src, dst, _ in SP_GATHERS.values()}}


# moe_dispatcher=deepep across NVLink domains (`two_hop_io`): where a domain holds one rank of the ep
# group, the NVLink hop is absent and the network hop delivers to the experts' rank itself
_UP_TWO_HOPS = {"xd": "xn", "xn": "xs", "yn": "yd"}
_DOWN_TWO_HOPS = {"xs": "xn", "xn": "xd", "yd": "yn", "yn": "yc"}


def upstream(key: tuple, sp: bool = False, layers: int = 0, depths: int = 0,
             two_hops: bool = False) -> Optional[tuple]:
    """The name a collective turns into `key`, for reads where that collective is absent. With MTP
    depths: a depth's block reads eh_proj's output, a depth's head its block's output."""
    name, l, mb = key
    if name == "x":
        if l == 0:
            return ("emb", -1, mb)
        if depths and is_mtp_block(l, layers, depths):
            return ("xp", l, mb)
        if depths and l > layers + depths:
            return ("y2p", l - depths, mb)
        return ("y2p", l - 1, mb)
    src = (two_hops and _UP_TWO_HOPS.get(name)) or (_UP_SP if sp else _UP).get(name)
    return None if src is None else (src, l, mb)


_DOWN_SP = {**_DOWN, **{src: dst for src, dst, _ in SP_GATHERS.values()}}


def downstream(key: tuple, layers: int, sp: bool = False, depths: int = 0,
               two_hops: bool = False) -> Optional[tuple]:
    """The name `key` turns into through a collective, for gradient reads where it is absent."""
    name, l, mb = key
    if name == "emb":
        return ("x", 0, mb)
    if name == "y2p":
        return ("x", l + depths if is_mtp_block(l, layers, depths) else l + 1, mb)
    if name == "x":
        return ("xh", l, mb) if l == layers or l > layers + depths else ("xa", l, mb)
    dst = (two_hops and _DOWN_TWO_HOPS.get(name)) or (_DOWN_SP if sp else _DOWN).get(name)
    return None if dst is None else (dst, l, mb)
