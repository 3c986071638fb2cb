"""ModelSpecs read from files: a Hugging Face config.json (mapped field by field from its model_type),
a checkpoint folder holding one, or a JSON/YAML file of ModelSpec fields."""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Optional

from simexec.errors import SpecError
from simexec.specs.model import ModelSpec, build_model_spec

_MISSING = object()


def _get(cfg: dict, key: str, origin: str, default: Any = _MISSING, kind: type = int) -> Any:
    """cfg[key], checked to be a `kind`; SpecError naming the key and the file when absent or mistyped."""
    if key not in cfg or cfg[key] is None:
        if default is _MISSING:
            mtype = f" (model_type {cfg['model_type']})" if key != "model_type" and "model_type" in cfg else ""
            raise SpecError(f"missing key '{key}' in {origin}{mtype}")
        return default
    v = cfg[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise SpecError(f"key '{key}' in {origin} must be of type {kind.__name__}, got {v!r}")
    return v


def _head_dim(hidden: int, heads: int, origin: str, explicit: Optional[int] = None) -> int:
    """The config's head_dim if it gives one (Llama 3.x, Gemma), else hidden / heads."""
    if explicit is not None:
        return explicit
    if heads <= 0 or hidden % heads:
        raise SpecError(f"{origin}: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return hidden // heads


def _dropout(cfg: dict, origin: str, keys: tuple[str, ...], default: float) -> float:
    """The largest of the config's dropout probabilities `keys` (each defaults to transformers'
    default for the family when absent): masks are kept wherever any of them is on."""
    vals = []
    for k in keys:
        v = cfg.get(k)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
            raise SpecError(f"key '{k}' in {origin} must be a probability in [0, 1), got {v!r}")
        vals.append(float(v))
    return max(vals)


def _sliding_window(cfg: dict, origin: str, layers: int) -> dict[str, Any]:
    """`sliding_window` and `full_attention_every` of a config: which layers have the window comes
    from `layer_types` where the config lists them (transformers >= 4.54), else from Qwen2/3's
    `use_sliding_window` (layers from `max_window_layers` on), else every layer has Mistral's
    `sliding_window` when it is set."""
    types = _get(cfg, "layer_types", origin, default=None, kind=list)
    if types is not None:
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise SpecError(f"key 'layer_types' in {origin} must list 'sliding_attention' or 'full_attention' "
                            f"for each of the {layers} layers, got {types!r}")
        sliding = [t == "sliding_attention" for t in types]
    elif "use_sliding_window" in cfg:
        on = _get(cfg, "use_sliding_window", origin, default=False, kind=bool)
        first = _get(cfg, "max_window_layers", origin, default=0)
        sliding = [on and i >= first for i in range(layers)]
    else:
        sliding = [cfg.get("sliding_window") is not None] * layers
    if not any(sliding):
        return {}
    window = _get(cfg, "sliding_window", origin)
    if all(sliding):
        return dict(sliding_window=window)
    for k in range(2, layers + 1):
        if all(s == bool((i + 1) % k) for i, s in enumerate(sliding)):
            return dict(sliding_window=window, full_attention_every=k)
    full = [i for i, s in enumerate(sliding) if not s]
    raise SpecError(f"{origin}: layers {full} attend fully and the others through a window of {window}; "
                    "simexec models a window on every layer or every layer but each k-th")


def _hf_llama_like(cfg: dict, origin: str) -> dict[str, Any]:
    """llama, mistral, phi3, qwen2, qwen3 (and the base of the MoE ones): RMSNorm, SwiGLU, RoPE
    (Phi-3 fuses q, k, v into one matrix and gate and up into another: the same weights); Qwen3's
    RMSNorm on each head's q and k; Mistral's, Phi-3's and Qwen's sliding-window attention. Dropout is
    the largest of the attention's and the residual branches' (Phi-3's `resid_pdrop`)."""
    hidden = _get(cfg, "hidden_size", origin)
    heads = _get(cfg, "num_attention_heads", origin)
    layers = _get(cfg, "num_hidden_layers", origin)
    mtype = cfg["model_type"]
    attention_bias = _get(cfg, "attention_bias", origin, default=mtype in ("qwen2", "qwen2_moe"), kind=bool)
    mlp_bias = _get(cfg, "mlp_bias", origin, default=False, kind=bool)
    return dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=_get(cfg, "num_key_value_heads", origin, default=heads),
        head_dim=_head_dim(hidden, heads, origin, _get(cfg, "head_dim", origin, default=None)),
        ffn=_get(cfg, "intermediate_size", origin),
        gated=True,
        vocab=_get(cfg, "vocab_size", origin),
        seq_len=_get(cfg, "max_position_embeddings", origin),
        tied_embeddings=_get(cfg, "tie_word_embeddings", origin, default=False, kind=bool),
        norm="rmsnorm",
        # Llama's attention_bias covers q,k,v,o; without mlp_bias we model q,k,v only (o's bias is off by hidden).
        bias=attention_bias and mlp_bias,
        qkv_bias=attention_bias and not mlp_bias,
        qk_norm=mtype in ("qwen3", "qwen3_moe"),
        dropout=_dropout(cfg, origin, ("attention_dropout", "hidden_dropout", "resid_pdrop"), 0.0),
        **_sliding_window(cfg, origin, layers),
    )


def _hf_gemma(cfg: dict, origin: str) -> dict[str, Any]:
    """Gemma (1): as Llama, with the head tied to the embedding unless the config says otherwise
    (GemmaConfig's default) and heads of `head_dim` 256. Its GeGLU is priced as SwiGLU (one gated
    activation each), its embedding's scaling by sqrt(hidden) and its norms' 1 + w are left out (an
    element-wise pass each, no weights)."""
    f = _hf_llama_like(cfg, origin)
    f["tied_embeddings"] = _get(cfg, "tie_word_embeddings", origin, default=True, kind=bool)
    return f


def _hf_mixtral(cfg: dict, origin: str) -> dict[str, Any]:
    f = _hf_llama_like(cfg, origin)
    f["moe"] = dict(
        experts=_get(cfg, "num_local_experts", origin),
        top_k=_get(cfg, "num_experts_per_tok", origin),
        expert_ffn=f["ffn"],
    )
    return f


def _hf_gpt_oss(cfg: dict, origin: str) -> dict[str, Any]:
    """gpt-oss (transformers models/gpt_oss/modeling_gpt_oss.py): every layer a MoE of `num_local_experts`
    SwiGLU experts of width `intermediate_size`, `num_experts_per_tok` per token; biases on q, k, v, o, on
    every expert matrix (the router's bias, one per expert, is left out as for every MoE); a learned sink
    logit per head; `layer_types` alternating a
    sliding window of `sliding_window` with full attention. The clamped SwiGLU (`swiglu_limit`) and YaRN
    rotary scaling change neither parameters nor FLOPs."""
    f = _hf_llama_like(cfg, origin)
    f.update(bias=True, qkv_bias=False, attention_sinks=True)
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    f["moe"] = dict(
        experts=_get(cfg, "num_local_experts", origin),
        top_k=top_k if top_k is not None else _get(cfg, "num_experts_per_tok", origin),
        expert_ffn=f["ffn"],
    )
    return f


def _leading_dense(dense: list[int], origin: str) -> int:
    """ModelSpec only knows a leading block of dense layers: other layouts are approximated by moving
    the dense layers to the front. Parameter and FLOP totals stay exact; placement (pipeline balance) may not."""
    if dense != list(range(len(dense))):
        warnings.warn(f"{origin}: dense layers {dense} modelled as the first {len(dense)} layers", stacklevel=4)
    return len(dense)


def _hf_qwen_moe(cfg: dict, origin: str) -> dict[str, Any]:
    """Qwen2-MoE and Qwen3-MoE: layer i is sparse iff (i+1) % decoder_sparse_step == 0 and i not in
    mlp_only_layers; Qwen2-MoE's one shared expert of shared_expert_intermediate_size (its 1-wide
    sigmoid gate is left out); Qwen3-MoE has none."""
    f = _hf_llama_like(cfg, origin)
    step = _get(cfg, "decoder_sparse_step", origin, default=1)
    only = _get(cfg, "mlp_only_layers", origin, default=[], kind=list)
    dense = [i for i in range(f["layers"]) if i in only or step <= 0 or (i + 1) % step]
    shared_ffn = _get(cfg, "shared_expert_intermediate_size", origin, default=0)
    f["moe"] = dict(
        experts=_get(cfg, "num_experts", origin),
        top_k=_get(cfg, "num_experts_per_tok", origin),
        expert_ffn=_get(cfg, "moe_intermediate_size", origin),
        shared_experts=1 if shared_ffn else 0,
        shared_expert_ffn=shared_ffn or None,
        first_dense_layers=_leading_dense(dense, origin),
    )
    return f


def _hf_deepseek(cfg: dict, origin: str) -> dict[str, Any]:
    """DeepSeek-V2/V3: MLA + fine-grained MoE. Layer i is sparse iff i >= first_k_dense_replace and
    i % moe_layer_freq == 0. The multi-token-prediction depths (num_nextn_predict_layers, DeepSeek-V3: 1)
    become `mtp_layers`; V2 has none."""
    f = _hf_llama_like(cfg, origin)
    freq = _get(cfg, "moe_layer_freq", origin, default=1)
    first = _get(cfg, "first_k_dense_replace", origin, default=0)
    dense = [i for i in range(f["layers"]) if i < first or freq <= 0 or i % freq]
    f.update(
        head_dim=_get(cfg, "qk_nope_head_dim", origin),
        q_lora_rank=_get(cfg, "q_lora_rank", origin, default=None),
        kv_lora_rank=_get(cfg, "kv_lora_rank", origin),
        qk_rope_head_dim=_get(cfg, "qk_rope_head_dim", origin),
        v_head_dim=_get(cfg, "v_head_dim", origin),
        moe=dict(
            experts=_get(cfg, "n_routed_experts", origin),
            top_k=_get(cfg, "num_experts_per_tok", origin),
            expert_ffn=_get(cfg, "moe_intermediate_size", origin),
            shared_experts=_get(cfg, "n_shared_experts", origin, default=0),
            first_dense_layers=_leading_dense(dense, origin),
            router_groups=_get(cfg, "n_group", origin, default=1) or 1,
            router_group_topk=_get(cfg, "topk_group", origin, default=1) or 1,
        ),
        mtp_layers=_get(cfg, "num_nextn_predict_layers", origin, default=0),
    )
    return f


def _hf_gpt2(cfg: dict, origin: str) -> dict[str, Any]:
    """GPT-2: learned positions, LayerNorm, biases, FFN n_inner (default 4*n_embd), tied head."""
    hidden = _get(cfg, "n_embd", origin)
    heads = _get(cfg, "n_head", origin)
    positions = _get(cfg, "n_positions", origin)
    return dict(
        layers=_get(cfg, "n_layer", origin), hidden=hidden, heads=heads, kv_heads=heads,
        head_dim=_head_dim(hidden, heads, origin), ffn=_get(cfg, "n_inner", origin, default=4 * hidden),
        gated=False, vocab=_get(cfg, "vocab_size", origin), seq_len=positions, max_positions=positions,
        tied_embeddings=_get(cfg, "tie_word_embeddings", origin, default=True, kind=bool),
        norm="layernorm", bias=True, learned_pos=True,
        dropout=_dropout(cfg, origin, ("attn_pdrop", "resid_pdrop", "embd_pdrop"), 0.1),
    )


def _hf_gpt_neox(cfg: dict, origin: str) -> dict[str, Any]:
    """GPT-NeoX / Pythia: rotary (partial; no parameters), LayerNorm, biases, separate embed_out.
    The parallel residual changes neither parameters nor FLOPs."""
    hidden = _get(cfg, "hidden_size", origin)
    heads = _get(cfg, "num_attention_heads", origin)
    bias = _get(cfg, "attention_bias", origin, default=True, kind=bool)
    return dict(
        layers=_get(cfg, "num_hidden_layers", origin), hidden=hidden, heads=heads, kv_heads=heads,
        head_dim=_head_dim(hidden, heads, origin), ffn=_get(cfg, "intermediate_size", origin),
        gated=False, vocab=_get(cfg, "vocab_size", origin), seq_len=_get(cfg, "max_position_embeddings", origin),
        tied_embeddings=_get(cfg, "tie_word_embeddings", origin, default=False, kind=bool),
        norm="layernorm", bias=bias, learned_pos=False,
        dropout=_dropout(cfg, origin, ("attention_dropout", "hidden_dropout"), 0.0),
    )


_HF_IMPORTERS = {
    "deepseek_v2": _hf_deepseek,
    "deepseek_v3": _hf_deepseek,
    "gemma": _hf_gemma,
    "gpt2": _hf_gpt2,
    "gpt_oss": _hf_gpt_oss,
    "gpt_neox": _hf_gpt_neox,
    "llama": _hf_llama_like,
    "mistral": _hf_llama_like,
    "phi3": _hf_llama_like,
    "mixtral": _hf_mixtral,
    "qwen2": _hf_llama_like,
    "qwen2_moe": _hf_qwen_moe,
    "qwen3": _hf_llama_like,
    "qwen3_moe": _hf_qwen_moe,
}


def from_hf_config(cfg: dict, name: str, origin: Optional[str] = None) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json dict. `origin` (default `name`) names it in errors.

    seq_len is the config's context length (max_position_embeddings / n_positions); get_model's
    seq_len overrides it.
    """
    origin = origin or name
    if not isinstance(cfg, dict):
        raise SpecError(f"{origin}: a Hugging Face config must be a JSON object, got {type(cfg).__name__}")
    mtype = _get(cfg, "model_type", origin, kind=str)
    importer = _HF_IMPORTERS.get(mtype)
    if importer is None:
        raise SpecError(f"unsupported model_type {mtype!r} in {origin}; supported: {', '.join(sorted(_HF_IMPORTERS))}")
    fields = importer(cfg, origin)
    return build_model_spec({**fields, "name": name, "source": f"Hugging Face config ({mtype}) {origin}"}, origin)


def _read_file(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read model file {path}: {e.strerror or e}") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise SpecError(f"reading {path} needs PyYAML (pip install pyyaml), or write it as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SpecError(f"invalid YAML in {path}: {str(e).splitlines()[0]}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"invalid JSON in {path}: {e.msg} at line {e.lineno} column {e.colno}") from None


def load_model_file(path: Path) -> ModelSpec:
    """The spec in a file, or in a checkpoint directory's config.json: a Hugging Face config if it
    has `model_type`, else ModelSpec fields."""
    if path.is_dir():
        path = path / "config.json"
    data = _read_file(path)
    if not isinstance(data, dict):
        raise SpecError(f"{path} must hold a mapping of model fields, got {type(data).__name__}")
    # A checkpoint directory's name (…/Llama-2-7b-hf/config.json) names the model better than "config".
    stem = path.parent.name if path.stem == "config" and path.parent.name else path.stem
    if "model_type" in data:
        return from_hf_config(data, data.get("_name_or_path") or stem, origin=str(path))
    return build_model_spec({"name": stem, **data}, str(path))

