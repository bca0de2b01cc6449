"""Beyond one GPU: expert, tensor and data parallelism on ``torch.distributed`` (NCCL on GPUs, gloo on the CPU),
with the library's kernels doing the compute.

* Expert parallelism (:mod:`.expert_parallel`): ``optimized_ops.nn.MoE(..., process_group=group)``, or
  :class:`ExpertParallelMoE` / :func:`moe_layer_ep`: experts partitioned over the ranks, tokens dispatched and
  combined by all-to-all with variable splits (counts first), the local experts on the grouped GEMM, the dispatch
  overlapped with the local experts; capacity and dropless modes equal to the single-GPU layer's.
* Tensor parallelism (:mod:`.tensor_parallel`): :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, the
  MLP and attention split Megatron-style (:class:`TensorParallelSwiGLU`, :class:`TensorParallelAttention`, GQA
  groups whole), sequence parallelism as an option, :func:`parallelize_transformer`.
* Data parallelism (:mod:`.data_parallel`): :func:`wrap_ddp`, :func:`train_data_parallel` (``train_from_nvme``
  under DDP, the loader sharded by rank, checkpoints resumed on the same world size).
* Communication (:mod:`._comm`): :func:`init_process_group` (NVLink multicast forced off: ``NCCL_NVLS_ENABLE=0``,
  ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``; a timeout so a failed rank stops the others
  with an error), and the collectives as autograd Functions (Megatron's f / g pairs, all-to-all).

Examples: ``examples/distributed/`` (``torchrun --nproc_per_node 2 ...``); benchmark:
``bench/benchmark_distributed.py``; design and predictions: ``docs/perf-notes/distributed.md``.
"""

from ._comm import (NO_MULTICAST_ENV, DistributedError, all_to_all, copy_to_parallel_region, force_no_multicast_env,
                    gather_from_sequence_region, init_process_group, reduce_from_parallel_region,
                    scatter_to_sequence_region)
from .data_parallel import train_data_parallel, wrap_ddp
from .expert_parallel import ExpertParallelMoE, expert_range, moe_layer_ep
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TensorParallelAttention, TensorParallelSwiGLU,
                              allreduce_sequence_parallel_grads, parallelize_transformer, sequence_parallel_params)

__all__ = ["init_process_group", "force_no_multicast_env", "NO_MULTICAST_ENV", "DistributedError",
           "copy_to_parallel_region", "reduce_from_parallel_region", "gather_from_sequence_region",
           "scatter_to_sequence_region", "all_to_all",
           "ExpertParallelMoE", "moe_layer_ep", "expert_range",
           "ColumnParallelLinear", "RowParallelLinear", "TensorParallelSwiGLU", "TensorParallelAttention",
           "parallelize_transformer", "allreduce_sequence_parallel_grads", "sequence_parallel_params",
           "wrap_ddp", "train_data_parallel"]
