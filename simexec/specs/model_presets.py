"""The preset models: published GPT-3, Megatron-LM, Llama, Mistral, Mixtral and DeepSeek-V3 sizes, and
the tiny models the executor's tests train on a CPU. `get_model` looks names up in MODELS."""
from __future__ import annotations

from simexec.specs.model import ModelSpec, MoESpec

_GPT3 = "Brown et al. 2020, 'Language Models are Few-Shot Learners', Table 2.1"
_MEGATRON = "Narayanan et al. SC'21, 'Efficient Large-Scale Language Model Training on GPU Clusters', Table 1"


def _gpt3(name: str, layers: int, hidden: int, heads: int, head_dim: int, note: str = "") -> ModelSpec:
    """GPT-3: learned positions, LayerNorm, biases, FFN 4h, tied embeddings, vocab 50257, context 2048."""
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads, head_dim=head_dim,
        ffn=4 * hidden, gated=False, vocab=50257, seq_len=2048, tied_embeddings=True, norm="layernorm",
        bias=True, learned_pos=True, dropout=0.1, source=_GPT3 + note,
    )


def _megatron(name: str, heads: int, hidden: int, layers: int, published: str) -> ModelSpec:
    """Megatron-LM GPT: as GPT-3 but vocab 51200 (padded), sized by Table 1's heads/hidden/layers."""
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads,
        ffn=4 * hidden, gated=False, vocab=51200, seq_len=2048, tied_embeddings=True, norm="layernorm",
        bias=True, learned_pos=True, dropout=0.1, source=f"{_MEGATRON} ({published} row)",
    )


def _llama(name: str, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
           seq_len: int, source: str, tied: bool = False) -> ModelSpec:
    """Llama: RMSNorm, SwiGLU, RoPE, no biases; embeddings untied but in Llama 3.2 1B/3B."""
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=hidden // heads,
        ffn=ffn, gated=True, vocab=vocab, seq_len=seq_len, tied_embeddings=tied, norm="rmsnorm",
        bias=False, learned_pos=False, source=source,
    )


def _presets() -> dict[str, ModelSpec]:
    l2 = "HF meta-llama/Llama-2-{}-hf config.json; Touvron et al. 2023 (Llama 2), context 4096"
    l3 = "HF meta-llama/{} config.json; Llama 3 Herd of Models 2024, pre-training context 8192"
    specs = [
        _gpt3("gpt3-125m", 12, 768, 12, 64),
        # Table 2.1 prints 24 heads x 128 = 3072 != d_model 2048 (1.52B); 16 x 128 gives the 1.3B.
        _gpt3("gpt3-1.3b", 24, 2048, 16, 128, "; 16 heads (the table's 24 x 128 does not equal d_model 2048)"),
        _gpt3("gpt3-2.7b", 32, 2560, 32, 80),
        _gpt3("gpt3-6.7b", 32, 4096, 32, 128),
        # Table 2.1 prints d_model 5140, inconsistent with 40 heads x 128; 5120 is the usual reading.
        _gpt3("gpt3-13b", 40, 5120, 40, 128, "; d_model 5120 (the table's 5140 does not equal 40 x 128)"),
        _gpt3("gpt3-175b", 96, 12288, 96, 128),
        _megatron("megatron-1.7b", 24, 2304, 24, "1.7B"),
        _megatron("megatron-3.6b", 32, 3072, 30, "3.6B"),
        _megatron("megatron-7.5b", 32, 4096, 36, "7.5B"),
        _megatron("megatron-18.4b", 48, 6144, 40, "18.4B"),
        _megatron("megatron-39.1b", 64, 8192, 48, "39.1B"),
        _megatron("megatron-76.1b", 80, 10240, 60, "76.1B"),
        _megatron("megatron-145.6b", 96, 12288, 80, "145.6B"),
        _megatron("megatron-310.1b", 128, 16384, 96, "310.1B"),
        _megatron("megatron-529.6b", 128, 20480, 105, "529.6B"),
        _megatron("megatron-1t", 160, 25600, 128, "1008B"),
        _llama("llama2-7b", 32, 4096, 32, 32, 11008, 32000, 4096, l2.format("7b")),
        _llama("llama2-13b", 40, 5120, 40, 40, 13824, 32000, 4096, l2.format("13b")),
        _llama("llama2-70b", 80, 8192, 64, 8, 28672, 32000, 4096, l2.format("70b")),
        _llama("llama3.2-1b", 16, 2048, 32, 8, 8192, 128256, 8192,
               l3.format("Llama-3.2-1B") + " (1,235,814,400 parameters, the LM head tied to the embedding)", tied=True),
        _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, l3.format("Meta-Llama-3-8B")),
        _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, l3.format("Meta-Llama-3-70B")),
        _llama("llama3-405b", 126, 16384, 128, 8, 53248, 128256, 8192, l3.format("Llama-3.1-405B")),
        ModelSpec(
            name="mistral-7b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
            gated=True, vocab=32000, seq_len=8192, tied_embeddings=False, norm="rmsnorm", sliding_window=4096,
            source="Jiang et al. 2023, Mistral 7B, Table 1 (window 4096, context 8192); HF "
            "mistralai/Mistral-7B-v0.1 config.json (7,241,732,096 parameters)",
        ),
        ModelSpec(
            name="mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336,
            gated=True, vocab=32000, seq_len=4096, tied_embeddings=False, norm="rmsnorm",
            moe=MoESpec(experts=8, top_k=2, expert_ffn=14336),
            source="HF mistralai/Mixtral-8x7B-v0.1 config.json; Jiang et al. 2024. seq_len 4096 chosen as a "
            "training length (config max_position_embeddings is 32768: pass seq_len=32768 for that)",
        ),
        ModelSpec(
            name="deepseek-v3", layers=61, hidden=7168, heads=128, kv_heads=128, head_dim=128, ffn=18432,
            gated=True, vocab=129280, seq_len=4096, tied_embeddings=False, norm="rmsnorm",
            q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, v_head_dim=128,
            moe=MoESpec(experts=256, top_k=8, expert_ffn=2048, shared_experts=1, first_dense_layers=3,
                        router_groups=8, router_group_topk=4),
            source="HF deepseek-ai/DeepSeek-V3 config.json (n_group 8, topk_group 4: node-limited routing); "
            "DeepSeek-AI arXiv 2412.19437 (671B total, 37B active, 4K pre-training context). The "
            "multi-token-prediction module (14B) is left out",
        ),
        # Tiny models that train on a CPU. The executor's tests rely on these exact numbers
        # (tp up to 4, pp up to 4, cp 2): change them only together with those tests.
        ModelSpec(
            name="gpt-tiny", layers=4, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=256, gated=False,
            vocab=512, seq_len=64, tied_embeddings=False, norm="layernorm", bias=True, learned_pos=True,
            # no dropout: the executor runs none (a seeded dropout that matches the single process
            # under tp / sp / cp would need masks drawn per global element), so the simulator must not
            # count its masks either
            dropout=0.0, source="simexec test model (GPT-2 shaped)",
        ),
        ModelSpec(
            name="moe-tiny", layers=4, hidden=64, heads=4, kv_heads=4, head_dim=16, ffn=256, gated=True,
            vocab=512, seq_len=64, tied_embeddings=False, norm="rmsnorm", bias=False, learned_pos=False,
            moe=MoESpec(experts=4, top_k=2, expert_ffn=128, shared_experts=1, first_dense_layers=0,
                        capacity_factor=None),
            source="simexec test model (DeepSeek-MoE shaped: routed + shared experts)",
        ),
    ]
    return {m.name: m for m in specs}


MODELS: dict[str, ModelSpec] = _presets()
