#!/usr/bin/env python3
"""Python benchmark runner: every optimized_ops op against its PyTorch counterpart, in one run.

    python bench/benchmark_all.py [--device cuda|cpu] [--ops matmul,fused] [--dtypes bf16,fp16,fp32]
                                  [--variants all|auto|NAME,...] [--shapes 4096,4097x4095x4093,8x1024x1024x1024]
                                  [--out bench/results] [--quick]
    python bench/benchmark_all.py --ops fused [--fused-ops rms_norm,...] [--directions fwd,bwd,fwd+bwd]
                                  [--shapes 16384x8192] [--no-compile]     # see bench/benchmark_fused.py
    python bench/benchmark_all.py --ops attention [--seqlens 1024,4096,16384] [--head-dims 64,128] [--causal both]
                                  [--varlen auto] [--peers flash,cudnn,efficient,math]  # bench/benchmark_attention.py
    python bench/benchmark_all.py --ops kv_cache [--cases decode,page_size,fp8,append,graph]  # bench/benchmark_kv_cache.py
    python bench/benchmark_all.py --ops linear [--linear-cases seed,layer,skinny] [--no-compile]  # bench/benchmark_linear.py
    python bench/benchmark_all.py --ops models [--models-cases train,train_moe,decode,loader]  # bench/benchmark_models.py
    python bench/benchmark_all.py attention-memory [--memory-seqlens 8192,16384]   # the peak-memory table
    python bench/benchmark_all.py plot RESULT.json      # the PNGs again, from a JSON file
    python bench/benchmark_all.py loader [--gib 8 ...]  # the loader's standalone run (bench/loader_bench.py)
    python bench/benchmark_all.py --ops matmul --metrics   # + Nsight Compute counters per row (bench/ncu_metrics.py)

The families are registered in bench/runner.py (the harness and the registry) by their modules:
bench/benchmark_matmul.py (every GEMM variant vs torch.matmul), bench/benchmark_fused.py (the fused
memory-bound ops vs torch eager and torch.compile), bench/benchmark_attention.py (the attention ladder vs
scaled_dot_product_attention's backends, and its peak-memory table), bench/benchmark_kv_cache.py (paged decode
attention vs SDPA on contiguous K/V, append, the CUDA-graph step), bench/benchmark_linear.py (linear layers vs
torch eager F.linear + GELU, torch.compile and the GEMMs alone), bench/loader_bench.py (the streaming loader vs
DataLoader and the disk, a run of its own over a dataset on disk). This file imports them and runs
the runner: --shapes, --dtypes and --variants apply to the families being run; without them each
family has its own defaults. See bench/runner.py for the measurement and the output files.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import runner  # noqa: E402
import benchmark_matmul  # noqa: E402,F401 - registers matmul
import benchmark_fused  # noqa: E402,F401 - registers fused
import benchmark_attention  # noqa: E402,F401 - registers attention (and attention-memory, standalone)
import benchmark_kv_cache  # noqa: E402,F401 - registers kv_cache
import benchmark_linear  # noqa: E402,F401 - registers linear
import benchmark_moe  # noqa: E402,F401 - registers moe
import benchmark_models  # noqa: E402,F401 - registers models (imports optimized_ops.models only when run)
import loader_bench  # noqa: E402,F401 - registers loader (standalone)

main = runner.main

if __name__ == "__main__":
    sys.exit(main())
