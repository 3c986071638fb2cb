"""ZeRO-3 flavours (a plan's `zero_impl`) as policy records: the traits in which the systems simexec
models differ, read by lowering, the executor, the host-cost model and search alike.

Every flavour shards each unit's parameters over the data-parallel ranks, all-gathers them before
the unit runs and reduce-scatters its gradients; they differ in where the gathered parameters and
unsharded gradients live, and in when a unit's gradient shard exists. Free of torch, as the
simulator reads it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from simexec.errors import PlanError

PYTORCH = "pytorch/pytorch@8fc2039decebd92b15b38296df8bf9aa13275be0"
DEEPSPEED = "deepspeedai/DeepSpeed@edaa7221267243c7be7fb49c5d5f5c4fb97b4641"
DEEPSPEED_2021 = "deepspeedai/DeepSpeed@429dfa6c3dc5763008a04fd1c94d7b72817dd93e"  # 0.3.15


def pack_calls(tensors: Sequence[float], bucket: Optional[float]) -> list[float]:
    """Elements of each collective when tensors join a bucket in order and it is issued once it
    holds `bucket` elements (the tensor that fills it included, so one bigger than the bucket goes
    alone); None: all in one call."""
    if bucket is None:
        return [float(sum(tensors))] if sum(tensors) > 0 else []
    calls, open_ = [], 0.0
    for t in tensors:
        open_ += t
        if open_ >= bucket:
            calls.append(open_)
            open_ = 0.0
    if open_ > 0:
        calls.append(open_)
    return calls


@dataclass(frozen=True)
class Zero3Flavour:
    """One ZeRO-3 implementation; adding one is adding a record to `ZERO3_FLAVOURS`."""

    name: str
    # gathered parameters and unsharded gradients live in two buffers per parameter class,
    # allocated at start and used by the units in turn (by parity), the backward accumulating
    # straight into the gradient buffer (YaFSDP); False: each unit's are allocated on demand and
    # freed after its last use (FSDP2, DeepSpeed)
    preallocated_buffers: bool = False
    # every unit's gradient shard allocated at start, summed into and zeroed as each step starts
    # (DeepSpeed stage 3, the system of the ZeRO paper); False: made by the unit's first
    # reduce-scatter of a step and dropped after the optimizer step (FSDP2's `.grad`, YaFSDP as
    # simexec runs it)
    holds_grad_shards: bool = False
    # a reduce-scatter's output (the unit's gradient shard, or what is summed into it) is allocated on the
    # reduce-scatter's stream, so the caching allocator keeps its pages in that stream's pool, apart from the
    # compute stream's activations (FSDP2); False: on the compute stream
    grad_shards_on_reduce_stream: bool = False
    # --- the collectives it issues (what decides the step at scale: per-call latency, overlap) ---
    # one unit's gathered parameters go out in calls of `gather_bucket_params` elements each, its
    # tensors taken in order until a call holds that many; None: one grouped call per unit; 0: one
    # call per tensor
    gather_bucket_params: Optional[float] = None
    # a tensor of at most this many elements is never sharded, so never gathered (its gradient is
    # still reduce-scattered with the rest); 0: every tensor is sharded
    persist_below_params: float = 0.0
    # a unit's gradients reduce-scattered in calls of this many elements (as `gather_bucket_params`);
    # None: one call per unit
    reduce_bucket_params: Optional[float] = None
    # units whose gathers are in flight or in use at once: the first `prefetch_depth` of a pass are
    # gathered up front, unit j+depth once unit j has computed
    prefetch_depth: int = 2
    # device copies around the collectives, in passes (each reads and writes the bytes once) over
    # this rank's shard before a gather (copy-in), the gathered unit after it (copy-out), and the
    # unsharded gradients before a reduce-scatter (copy-in)
    gather_copy_in: int = 0
    gather_copy_out: int = 0
    reduce_copy_in: int = 0
    # gathers and reduce-scatters through torch.distributed's list forms, one tensor view per rank made
    # in Python (`all_gather(partitions, ...)`, `reduce_scatter(out, input_list)`): per call the host
    # makes world-size views, and torch 1.x's ProcessGroupNCCL copies each rank's piece out of (into) its
    # flat buffer with one copy_ per rank (ProcessGroupNCCL::allgather / reduce_scatter,
    # flatten_for_scatter_gather); the calls run one after another with the device idle between them
    list_collectives: bool = False
    # --- under a pipeline schedule ---
    # a stage's units, once gathered, stay gathered (no reshard after a backward) and their unsharded
    # gradients accumulate over the step's micro-batches, reduce-scattered and resharded after the
    # stage's last backward; False: every micro-batch's backward reshards and reduce-scatters
    pipeline_defers_reduction: bool = False
    # the root module's parameters (the embedding's and the head's units, wrapped by the last
    # fully_shard(model)) are not resharded after the forward: gathered once for the forward, they stay
    # gathered through the backward until the root's post-backward, after the embedding's backward
    root_kept_through_backward: bool = False

    def gather_calls(self, tensors: Sequence[float]) -> list[float]:
        """Elements of each all-gather of a unit whose tensors (in forward order) are `tensors`."""
        return pack_calls([t for t in tensors if t > self.persist_below_params], self.gather_bucket_params)

    def reduce_calls(self, tensors: Sequence[float]) -> list[float]:
        """Elements of each reduce-scatter of the unit's gradients."""
        return pack_calls(tensors, self.reduce_bucket_params)

    @property
    def splits_units(self) -> bool:
        """Whether a unit may be gathered in several calls or in part, or reduced in several calls."""
        return (self.gather_bucket_params is not None or self.persist_below_params > 0
                or self.reduce_bucket_params is not None)


# Host seconds per rank to build a list collective's views, measured on this project's build machine
# (torch 2.13 CPU, CPython 3.11) with DeepSpeed 0.3.15's loops: `flat.narrow(0, p * i, p)` appended
# per rank for a gather (partition_parameters.py _allgather_param), `param.grad.view(-1).narrow(...)`
# with its bounds checks for a reduce-scatter (_reduce_scatter_gradient). Each rank's copy_ costs a
# kernel launch on top (`DeviceSpec.launch_overhead_s`).
LIST_VIEW_S = {"allgather": 1.5e-6, "reducescatter": 2.7e-6}

ZERO3_FLAVOURS: dict[str, Zero3Flavour] = {f.name: f for f in (
    # FSDP2 (fully_shard): one all_gather_into_tensor per parameter group, its input made by
    # all_gather_copy_in (the shards copied in) and its output split into the parameters by
    # split_with_sizes_copy; one reduce_scatter_tensor whose input chunk_cat copies the gradients in
    # (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: foreach_all_gather,
    # foreach_all_gather_copy_out, foreach_reduce); the next unit's gather in flight while one is in
    # use (_fsdp_param_group.py: wait_for_unshard's all_gather_state; _fsdp_state.py's implicit
    # forward and backward prefetch), all at PYTORCH
    # Under torch.distributed.pipelining, an FSDPModule stage's every backward runs with
    # set_reshard_after_backward(False) and set_requires_gradient_sync(False), the last one followed
    # by the param groups' post_backward (reduce-scatter, reshard): torch 2.6's
    # torch/distributed/pipelining/stage.py backward_maybe_with_nosync, recent torch's
    # schedules.py REDUCE_GRAD action (stage.perform_reduce_grad) after the last backward; meanwhile
    # FSDPParam.to_accumulated_grad_if_needed keeps the unsharded gradient in reduce_dtype
    # (_fsdp_param_group.py post_backward).
    # The root's group is never resharded after the forward (_fsdp_state.py FSDPState._lazy_init: "For the
    # root, do not reshard after forward since for training, the parameters would be freed and
    # all-gathered immediately": post_forward_mesh_info = None); torchtitan's apply_fsdp wraps the blocks,
    # then the whole model, whose own parameters are the embedding, the final norm and the output
    # (pytorch/torchtitan@ba2469780 torchtitan/parallelisms/parallelize_llama.py).
    # foreach_reduce allocates the reduce-scatter's output under `device_handle.stream(reduce_scatter_stream)`
    # and views the sharded gradients out of it ("The RS output is allocated in the RS stream and used in the
    # default stream (for optimizer)", torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py @010ae4a8).
    Zero3Flavour("fsdp", gather_copy_in=1, gather_copy_out=1, reduce_copy_in=1, pipeline_defers_reduction=True,
                 root_kept_through_backward=True, grad_shards_on_reduce_stream=True),
    # FSDP1 (FullyShardedDataParallel): one FlatParameter per wrapped unit, all-gathered from its
    # shard straight into the padded flat buffer the parameters are views of, and reduce-scattered
    # from the flat gradient, no copies (torch/distributed/fsdp/_flat_param.py: _all_gather_flat_param;
    # _runtime_utils.py: _reduce_grad); limit_all_gathers's rate limiter holds at most two gathers in
    # flight (_limiter_utils.py: _max_num_inflight_all_gathers = 2), all at PYTORCH
    Zero3Flavour("fsdp1"),
    Zero3Flavour("yafsdp", preallocated_buffers=True),
    # DeepSpeed stage 3, default config (deepspeed/runtime/zero/config.py: stage3_prefetch_bucket_size
    # 5e7, stage3_param_persistence_threshold 1e5, reduce_bucket_size 5e8): the coordinator gathers a
    # submodule's parameters and prefetches the trace's next ones until a bucket's worth, each set
    # one all_gather_coalesced call (partitioned_param_coordinator.py: fetch_sub_module,
    # __all_gather_params_); parameters under the threshold persist unsharded (ds_persist);
    # gradients are copied into the ipg bucket and reduce-scattered a bucket at a time
    # (stage3.py: __add_grad_to_ipg_bucket, __reduce_and_partition_ipg_grads), all at DEEPSPEED.
    # Its buckets span units; simexec closes them at a unit's end (a bucket per unit below 5e8).
    Zero3Flavour("deepspeed", holds_grad_shards=True, gather_bucket_params=5e7, persist_below_params=1e5,
                 reduce_bucket_params=5e8, reduce_copy_in=1),
    # DeepSpeed stage 3 as released from 0.3.13 (March 2021) to 0.5.5 (until #1188, "ZeRO3, improved
    # parameter all-gather operation", October 2021), read at DEEPSPEED_2021: each parameter above the
    # persistence threshold (1e5) gathered alone, after torch.cuda.synchronize(), through
    # torch.distributed.all_gather(partitions, ...) over world-size views of a flat buffer
    # (partition_parameters.py: _allgather_param); the coordinator fetches a module's parameters and
    # prefetches the next module's, 5e7 elements' worth (stage3.py: fetch_sub_module,
    # prefetch_next_sub_modules); each parameter's gradient copied into the ipg bucket and
    # reduce-scattered alone through reduce_scatter(out, input_list) (_reduce_scatter_gradient).
    Zero3Flavour("deepspeed-2021", holds_grad_shards=True, gather_bucket_params=0.0, persist_below_params=1e5,
                 reduce_bucket_params=0.0, reduce_copy_in=1, list_collectives=True),
)}
DEFAULT_ZERO3_FLAVOUR = "fsdp"


def zero3_flavour(name: str) -> Zero3Flavour:
    """The ZeRO-3 flavour named `name`."""
    try:
        return ZERO3_FLAVOURS[name]
    except KeyError:
        raise PlanError(f"unknown zero_impl {name!r}; flavours: {', '.join(ZERO3_FLAVOURS)}") from None
