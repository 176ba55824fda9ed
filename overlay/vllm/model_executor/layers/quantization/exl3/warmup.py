# SPDX-License-Identifier: Apache-2.0
"""Tune `_C::exl3_linear`'s plans at load time, so that serving never times candidates.

The op picks its plan (fused GEMM tier x split-k, or reconstruct + cuBLAS) by timing the
candidates the first time it meets a key (device, k, n, bitrate, codebook, shards, dtype and
m rounded up to a power of two), and never inside CUDA-graph capture. vLLM's own start-up
reaches only its CUDA-graph sizes and one profiling batch; every prefill size in between was
tuned on its first request. The H200 throughput run of 2026-11-30 (qwen3-8b, 4 bpw,
max_num_batched_tokens 16384) measured times to first token of 5.9x and 5.2x bf16's where the
prefill was 2048 and 8192 tokens (buckets first met inside the timed requests) but 1.67x where it
ran in 16384-token chunks (the bucket vLLM's profiling batch had tuned); the large-m path itself
is 1.1-1.5x per linear. Here each distinct layer configuration runs once per power of two up to the
scheduler's token budget, on zeros, right after loading; VLLM_EXL3_WARMUP=0 turns it off. With it
(commit 8796f4f, same run) those times to first token fell to 1.7x and 1.08x bf16's; model
loading, warm-up included, took 3.7 s against 2.2 s for bf16's dummy weights (scripts/e2e/results).
"""

import time

import torch

import vllm.envs as envs
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger

logger = init_logger(__name__)

# Activations + output of one warm-up call are capped at this many bytes: a bucket above it (an
# lm_head at a huge token budget) is left to be tuned on first use rather than risk the memory
# before vLLM has sized its KV cache.
MAX_WARMUP_BYTES = 1 << 30
# Used when no vLLM config is current (a layer built outside the engine, as in tests).
DEFAULT_MAX_TOKENS = 8192

_warmed: set[tuple] = set()


def warmup_m_values(max_tokens: int) -> list[int]:
    """The powers of two the op's plan cache is keyed by, up to the one covering max_tokens."""
    values, m = [], 1
    while True:
        values.append(m)
        if m >= max_tokens:
            return values
        m *= 2


def max_tokens() -> int:
    config = get_current_vllm_config_or_none()
    if config is None or config.scheduler_config is None:
        return DEFAULT_MAX_TOKENS
    return int(config.scheduler_config.max_num_batched_tokens)


def warm_up_layer(key: tuple, k: int, n: int, dtype: torch.dtype, device: torch.device,
                  forward) -> int:
    """Call forward(x) on zeros [m, k] for every bucket, once per distinct key; returns the
    number of calls made (0 when this configuration was already warmed)."""
    if key in _warmed or not envs.VLLM_EXL3_WARMUP:
        return 0
    _warmed.add(key)
    calls, start = 0, time.perf_counter()
    for m in warmup_m_values(max_tokens()):
        if m * (k + n) * dtype.itemsize > MAX_WARMUP_BYTES:
            logger.debug("EXL3 warm-up %s: m = %d and up left to first use (memory cap)", key, m)
            break
        forward(torch.zeros(m, k, dtype=dtype, device=device))
        calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # The warm-up's activations must not look like model memory to vLLM's KV-cache sizing.
        torch.cuda.empty_cache()
    logger.info("EXL3: kernel plans tuned for k=%d n=%d %s at %d token counts in %.2f s", k, n,
                key, calls, time.perf_counter() - start)
    return calls
