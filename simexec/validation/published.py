"""The published training runs the simulator is checked against, and what each ran with.

The tables ship as package data (data/*.csv, each with its source in its header); the rest are the
rules for what a paper leaves out and the recipes the authors' software ran (Megatron-LM 2021,
BigScience's Megatron-DeepSpeed for BLOOM), shared by every validation of this package.
"""
from __future__ import annotations

import csv
from pathlib import Path

from simexec.specs.cluster import ClusterSpec, get_cluster
from simexec.specs.model import ModelSpec, get_model
from simexec.specs.plan import balanced_stages

DATA = Path(__file__).resolve().parent / "data"
SEQ = 2048
MEGATRON_VOCAB = 51200  # GPT-2 BPE padded to a multiple of 1024 (SC'21 §5.1)
VPP_MAX = 3
WHOLE_BUFFER_MB = 1e6  # a gradient "bucket" larger than any model's gradients: one reduction after the backward
TFLOPS = "TFLOP/s per GPU (Megatron eq. 3)"

SC21 = "Narayanan et al., SC'21, 'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM'"
SC21_T1 = SC21 + ", Table 1"
SC21_T2 = SC21 + ", Table 2 (PTD-P rows)"
ZERO_SRC = "Rajbhandari et al., SC'20, 'ZeRO: Memory Optimizations Toward Training Trillion Parameter Models', Figure 1"
BLOOM_SRC = ("Le Scao et al. 2022, 'BLOOM' (arXiv:2211.05100) §3.4; BigScience tr11-176B-ml.slurm and model card "
             "('training throughput: about 150 TFLOPs')")


def read_published_csv(path) -> list[dict]:
    """The rows of a published table in simexec/validation/data: a CSV whose comment lines (#) give its source."""
    with open(path) as f:
        return list(csv.DictReader(line for line in f if line.strip() and not line.startswith("#")))


def read_megatron_csv(path) -> list[tuple]:
    """Rows in the format of megatron_sc21_table1.csv: params (B), heads, hidden, layers, tp, pp, GPUs,
    global batch, achieved TFLOP/s per GPU."""
    return [(float(d["params_b"]), int(d["heads"]), int(d["hidden"]), int(d["layers"]), int(d["tp"]), int(d["pp"]),
             int(d["gpus"]), int(d["global_batch"]), float(d["tflops_per_gpu"])) for d in read_published_csv(path)]


TABLE1_CSV = DATA / "megatron_sc21_table1.csv"
TABLE1 = read_megatron_csv(TABLE1_CSV)  # the paper's Table 1, with its source in the file's header
# Table 2, PTD-P: GPT-3 175B (model-parallel size 96 = tp 8 x pp 12) and 530B (280 = 8 x 35),
# micro-batch 1 (given in the table); achieved TFLOP/s per GPU at three GPU counts each.
TABLE2 = [
    (174.6, 96, 12288, 96, 8, 12, 384, 1536, 153),
    (174.6, 96, 12288, 96, 8, 12, 768, 1536, 149),
    (174.6, 96, 12288, 96, 8, 12, 1536, 1536, 141),
    (529.6, 128, 20480, 105, 8, 35, 560, 2240, 171),
    (529.6, 128, 20480, 105, 8, 35, 1120, 2240, 167),
    (529.6, 128, 20480, 105, 8, 35, 2240, 2240, 159),
]


def t2_suffix(r: tuple) -> str:
    """A Table 2 row's name suffix: its GPU count tells the three runs of one model apart."""
    return f"-t2-{r[6]}gpu"



# --- Megatron-LM -----------------------------------------------------------------------------------

def eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron SC'21 eq. 3: FLOPs of one iteration with full recompute (4 passes of the forward
    over every layer, 3 over the LM head): 96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    return 96.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def megatron_model(heads: int, hidden: int, layers: int, name: str = "") -> ModelSpec:
    """Megatron-LM's GPT (as simexec's `megatron-*` presets): learned positions, LayerNorm, biases,
    GeLU FFN of 4h, tied embeddings, vocabulary 51200, sequence 2048."""
    return ModelSpec(
        name=name or f"gpt-h{hidden}-l{layers}", layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
        head_dim=hidden // heads, ffn=4 * hidden, gated=False, vocab=MEGATRON_VOCAB, seq_len=SEQ,
        tied_embeddings=True, norm="layernorm", bias=True, learned_pos=True, dropout=0.1, source=SC21,
    )


def megatron_name(params_b: float) -> str:
    return "megatron-1t" if params_b >= 1000 else f"megatron-{params_b:g}b"


def megatron_rule(layers: int, tp: int, pp: int, gpus: int, global_batch: int) -> dict:
    """Micro-batch size, virtual stages and gradient bucketing for a run whose paper leaves them out."""
    dp = gpus // (tp * pp)
    mbs = 1
    micro = global_batch // (dp * mbs)
    vpp = 1
    if pp > 1 and layers % pp == 0 and micro % pp == 0:
        vpp = max(v for v in range(1, VPP_MAX + 1) if (layers // pp) % v == 0)
    # Megatron-LM 2021 needs layers divisible by pp; for other runs spread the remainder over the
    # middle stages (the first and last also hold the embedding and the head).
    stages = None
    if layers % pp:
        base, extra = divmod(layers, pp)
        order = sorted(range(pp), key=lambda i: (i in (0, pp - 1), abs(i - (pp - 1) / 2)))
        stages = [base + (1 if i in order[:extra] else 0) for i in range(pp)]
    return {"dp": dp, "mbs": mbs, "vpp": vpp, "micro_batches": micro,
            "bucket_mb": 25.0 if pp == 1 else WHOLE_BUFFER_MB, "stages": stages}


def megatron_plan(layers: int, tp: int, pp: int, gpus: int, global_batch: int) -> str:
    r = megatron_rule(layers, tp, pp, gpus, global_batch)
    # the authors' runs scale the loss by 8192 and clip the gradients at 1.0 (examples/sc21/CONFIG.sh:
    # `--clip-grad 1.0 --fp16 --loss-scale 8192`)
    # the fp16 optimizer copies the gradients to fp32 main gradients for the step (master_grads)
    plan = (f"tp={tp},pp={pp},dp={r['dp']},mbs={r['mbs']},gbs={global_batch},recompute=full,"
            f"flash_attention=0,dtype=fp16,bucket_mb={r['bucket_mb']:g},loss_scale=8192,clip_grad=1,master_grads=1")
    if pp > 1:  # Megatron-LM's pipeline messages block (`_communicate` waits on batch_isend_irecv), and
        # its local DDP all-reduces every model chunk's buffer after the whole backward (`train_step`)
        plan += ",p2p_overlap=0,grad_overlap=0"
    else:  # torch DDP as Megatron-LM wraps it: its own buckets beside `.grad` (gradient_as_bucket_view=False)
        plan += ",grad_bucket_view=0"
    if r["vpp"] > 1:
        plan += f",vpp={r['vpp']}"
    if r["stages"]:
        plan += ",stages=" + ",".join(str(x) for x in r["stages"])
    return plan


def megatron_spec(params_b: float, heads: int, hidden: int, layers: int) -> ModelSpec:
    """The `megatron-*` preset of that size, or the same GPT built from its shape."""
    name = megatron_name(params_b)
    try:
        model = get_model(name)
        if (model.heads, model.hidden, model.layers) == (heads, hidden, layers):
            return model
    except Exception:  # noqa: BLE001 - no preset of that name
        pass
    return megatron_model(heads, hidden, layers, name)


# --- BLOOM-176B ------------------------------------------------------------------------------------

def bloom_model() -> ModelSpec:
    """BLOOM-176B: 70 layers, hidden 14336, 112 heads, ALiBi (no position embedding), GeLU, biases,
    tied embeddings, vocabulary 250,680 padded to 250,880 (--pad-vocab-size-to); 176,247M parameters."""
    return ModelSpec(name="bloom-176b", layers=70, hidden=14336, heads=112, kv_heads=112, head_dim=128,
                     ffn=4 * 14336, gated=False, vocab=250880, seq_len=SEQ, tied_embeddings=True,
                     norm="layernorm", bias=True, learned_pos=False, dropout=0.1, source=BLOOM_SRC)


def jean_zay(nodes: int = 48) -> ClusterSpec:
    """Jean Zay's A100 partition: 8 A100-SXM4-80GB per node on NVLink/NVSwitch (as DGX A100), but
    4 Omni-Path 100 Gb/s links per node (BLOOM paper §3.4.1) instead of 8 HDR 200 Gb/s."""
    base = get_cluster(f"{nodes}xdgx-a100-80g")
    net = base.network.model_copy(update={"nics_per_node": 4, "nic_bw": 12.5e9})
    return base.model_copy(update={"name": f"{nodes}xjean-zay-a100-80g", "network": net,
                                   "source": base.source + "; network: 4x Omni-Path 100 Gb/s per node"})


# What Megatron-DeepSpeed (BigScience, 2022) ran BLOOM with, whatever the (tp, pp): bf16, ZeRO-1, full
# recompute, Megatron's fused softmax (no FlashAttention), no sequence parallelism, DeepSpeed's
# non-interleaved pipeline with blocking sends, gradients clipped at 1.0 (tr11-176B-ml.slurm:
# `--clip-grad 1.0`, ds_config `"gradient_clipping": 1.0`). bf16 with ZeRO-1 under DeepSpeed's pipeline
# engine is its BF16_Optimizer (deepspeed/runtime/bf16_optimizer.py): each
# micro-batch's bf16 gradients are added into fp32 ones (`update_hp_grads` after every backward), which
# are all-reduced whole after the last backward (`_exec_reduce_grads` -> `buffered_allreduce_fallback`,
# buffers of MEMORY_OPT_ALLREDUCE_SIZE = 5e8 elements, 2000 MB of fp32) before each rank steps its shard
# and the bf16 parameters are all-gathered. Its tensor-parallel layers have no asynchronous input-gradient
# all-reduce (no `--async-tensor-model-parallel-allreduce` in BigScience's fork): tp_overlap=0.
DEEPSPEED_ALLREDUCE_MB = 5e8 * 4 / 1e6
BLOOM_2022 = dict(vpp=1, sp=False, cp=1, zero=1, zero_impl=None, dp_shard=None, offload="none", recompute="full",
                  recompute_layers=None, flash_attention=False, dtype="bf16", grad_fp32=True, grad_allreduce=True,
                  grad_overlap=False, bucket_mb=DEEPSPEED_ALLREDUCE_MB, p2p_overlap=False, tp_overlap=False,
                  clip_grad=1.0)


def bloom_recipe(model: ModelSpec, tp: int, pp: int) -> dict:
    """`BLOOM_2022` for one (tp, pp), with DeepSpeed's 'type:transformer|embedding' partition
    (`balanced_stages`: 5,6,...,6,5 on 12 stages)."""
    return dict(BLOOM_2022, tp=tp, pp=pp, stages=balanced_stages(model.layers, pp) if pp > 1 else None)
