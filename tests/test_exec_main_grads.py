"""Main gradients (`grad_fp32` under a 16-bit dtype, Megatron-LM's `main_grad`): every 16-bit gradient
autograd makes is added into an fp32 gradient as it lands, so micro-batches accumulate, and buckets
and shards reduce, in fp32. Uses the rank pool of test_exec_interp.py."""
from __future__ import annotations

import pytest
import torch
from test_exec_interp import resolved, run_plan


@pytest.mark.parametrize("plan", ["dp=1,gbs=4,mbs=1", "dp=1,gbs=4,mbs=1,grad_bucket_view=0"])
def test_main_gradients_are_the_fp32_sum_of_each_micro_batch_gradient(plan):
    """One rank, four micro-batches: what the optimizer gets is fp32 and equals, to the bit, the fp32
    sum of the four bf16 gradients autograd made, in order; summed in bf16 they differ."""
    from simexec.exec.rank.interpreter import RankInterpreter
    from simexec.program.lower import lower

    torch.set_num_threads(1)
    rp = resolved("gpt-tiny", plan + ",dtype=bf16,grad_fp32=1", 32, None)
    rank = RankInterpreter(rp, lower(rp, symmetric=False).ranks[0], None, None, torch.device("cpu"), 0)
    made: dict[str, list[torch.Tensor]] = {n: [] for n in rank.p}
    for n, p in rank.p.items():  # a tensor hook sees each gradient before it is accumulated
        p.register_hook(lambda g, n=n: made[n].append(g.detach().clone()))
    stepped: list[torch.Tensor] = []
    rank.opt.step = lambda grads: stepped.extend(g.clone() for g in grads)
    rank.run_step(0)

    assert len(stepped) == len(rank.opt_keys) == len(rank.p)
    bf16_differs = False
    for name, got in zip(rank.opt_keys, stepped):
        assert got.dtype == torch.float32, name
        assert len(made[name]) == 4, name
        fp32 = torch.zeros(got.shape, dtype=torch.float32)
        bf16 = torch.zeros(got.shape, dtype=torch.bfloat16)
        for g in made[name]:
            fp32.add_(g)
            bf16 += g
        assert torch.equal(got, fp32), name
        bf16_differs |= not torch.equal(bf16.float(), fp32)
    assert bf16_differs


AGREE = [  # (the one-rank or tp-only plan, plans that compute the same per-sequence gradients)
    ("dp=1,gbs=8", ["dp=2,gbs=8,grad_bucket_view=0", "dp=2,zero=1,offload=optimizer,gbs=8", "dp=4,zero=2,gbs=8",
                    "dp=4,zero=3,zero_impl=yafsdp,gbs=8", "dp=2,zero=3,zero_impl=fsdp1,gbs=8",
                    "dp=4,zero=3,dp_shard=2,gbs=8", "pp=2,gbs=8,schedule=zb-h1",
                    "dp=2,pp=2,zero=1,gbs=8,grad_allreduce=1,grad_overlap=0,p2p_overlap=0"]),
    ("tp=2,sp=1,gbs=8", ["dp=2,tp=2,sp=1,zero=3,gbs=8"]),
    ("tp=2,gbs=8", ["dp=2,tp=2,zero=2,gbs=8", "tp=2,pp=2,gbs=8,schedule=zb-h1"]),
]


def _by_tp(rp, results) -> dict[int, dict[str, torch.Tensor]]:
    return {rp.mesh.coords(r)["tp"]: res["params"] for r, res in enumerate(results)}


@pytest.mark.parametrize("base,plans", AGREE, ids=[b for b, _ in AGREE])
def test_main_gradients_make_data_parallel_and_pipeline_plans_agree_to_the_bit(base, plans):
    """Every micro-batch of one sequence computes the same bf16 gradients however the batch is split
    over dp, ZeRO shards and pipeline stages; summed in fp32, only the order of the sums differs, so
    after three Adam steps every bf16 parameter is the same bits as under the base plan (the losses
    within 1e-6). Gradients kept in bf16 end otherwise: a fifth of the parameters differ after
    `dp=4,zero=2` (checked on the first plan, so that this test can fail)."""
    def run(plan: str, main: bool):
        return run_plan("gpt-tiny", plan + ",dtype=bf16" + (",grad_fp32=1" if main else ""), 32, 3, dtype=None)

    def differing(rp, results, ref) -> int:
        assert {n for res in results for n in res["params"]} == set(ref[0]), "parameters held by no rank"
        return sum(int((got != ref[rp.mesh.coords(r)["tp"]][name]).sum())
                   for r, res in enumerate(results) for name, got in res["params"].items())

    brp, bres = run(base, True)
    ref, ref_losses = _by_tp(brp, bres), next(r["losses"] for r in bres if r["losses"])
    for plan in plans:
        rp, results = run(plan, True)
        assert differing(rp, results, ref) == 0, f"{plan}: parameters differ from {base}'s"
        losses = next(r["losses"] for r in results if r["losses"])
        assert losses == pytest.approx(ref_losses, rel=1e-6), plan
    if base == "dp=1,gbs=8":
        brp, bres = run(base, False)
        rp, results = run("dp=4,zero=2,gbs=8", False)
        assert differing(rp, results, _by_tp(brp, bres)) > 0


@pytest.mark.parametrize("plan", ["dp=2,gbs=8", "dp=2,zero=3,gbs=8", "dp=4,zero=3,zero_impl=yafsdp,gbs=8",
                                  "tp=2,sp=1,gbs=8", "dp=2,zero=1,offload=optimizer,gbs=8"])
def test_main_gradient_memory_follows_the_simulator(plan):
    """The fp32 gradients (their buckets, ZeRO-3 shards, YaFSDP's buffers, the host copies under
    offload) and the 16-bit gradient each hook lets go: every rank's peak within 2% of the
    prediction, and above the same plan's without main gradients by what the simulator says, within
    a fifth."""
    from simexec.specs.model import get_model
    from simexec.sim.simulate import simulate

    measured, predicted = {}, {}
    for main in (False, True):
        full = plan + ",dtype=bf16" + (",grad_fp32=1" if main else "")
        _, results = run_plan("gpt-tiny", full, 32, 2, dtype=None)
        predicted[main] = simulate(get_model("gpt-tiny"), "local", full, seq_len=32).peak_memory_bytes_per_rank
        measured[main] = [res["peak_memory_bytes"] for res in results]
        for r, m in enumerate(measured[main]):
            err = m / predicted[main][r] - 1
            assert abs(err) < 0.02, f"{full} rank {r}: measured {m}, predicted {predicted[main][r]:.0f} ({err:+.1%})"
    for r in range(len(measured[True])):
        d_measured = measured[True][r] - measured[False][r]
        d_predicted = predicted[True][r] - predicted[False][r]
        assert d_predicted > 0 and abs(d_measured / d_predicted - 1) < 0.2, (r, d_measured, d_predicted)
