# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Load-time preparation of `_C::exl3_linear`: plans, workspace, first launches.

For each distinct layer configuration, right after loading and before vLLM profiles
memory or captures graphs:

- with VLLM_EXL3_TUNE=1, the candidate plans of every token-count bucket (powers of two
  up to the scheduler's token budget) are timed (`_C::exl3_time_plans`) and the fastest
  recorded for this process (plans.record_tuned);
- each bucket's plan is resolved (`_C::exl3_plan`, no kernel runs): the split-k
  workspace is sized to the largest partial sums any of them needs, and with
  VLLM_EXL3_LOG_PLANS=1 each is logged, one line per configuration and bucket, so two
  processes' logs can be compared;
- with VLLM_EXL3_WARMUP=1 (default), the layer runs once per bucket on zeros, so the
  first requests do not pay the kernels' first launches (module loading, cuBLAS
  heuristics).
"""

import time
from collections.abc import Callable

import torch
import vllm.envs as envs
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger

from . import ops, plans
from .kernels import MAX_WORKSPACE_FLOATS, Exl3Run, workspace_for

logger = init_logger(__name__)

# Activations + output of one warm-up or timing call are capped at this many bytes: a
# bucket above it (an lm_head at a huge token budget) is left to the cost model and
# first use rather than risk the memory before vLLM has sized its KV cache.
MAX_WARMUP_BYTES = 1 << 30
# Used when no vLLM config is current (a layer built outside the engine, as in tests).
DEFAULT_MAX_TOKENS = 8192

_warmed: set[tuple] = set()
_tuned: set[str] = set()
_logged: set[tuple] = set()


def warmup_m_values(max_tokens: int) -> list[int]:
    """The token-count buckets (powers of two) up to the one covering max_tokens."""
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


def _fits(m: int, k: int, n: int, dtype: torch.dtype) -> bool:
    return m * (k + n) * dtype.itemsize <= MAX_WARMUP_BYTES


def tune_run(run: Exl3Run, dtype: torch.dtype) -> None:
    """Time every bucket's candidates for run's configuration (once per process)."""
    if run.key in _tuned:
        return
    _tuned.add(run.key)
    k, n = run.trellis.shape[0] * 16, run.trellis.shape[1] * 16
    header = plans.current_header()
    entries, start = [], time.perf_counter()
    for m in warmup_m_values(max_tokens()):
        if not _fits(m, k, n, dtype):
            break
        x = torch.zeros(m, k, dtype=dtype, device=run.trellis.device)
        ws = torch.zeros(
            min(m * n, MAX_WORKSPACE_FLOATS),
            dtype=torch.float32,
            device=run.trellis.device,
        )
        timed = ops.exl3_time_plans(
            x,
            run.trellis,
            run.suh,
            run.svh,
            None,
            run.shard_widths,
            run.codebook,
            header,
            ws,
        )
        if timed:
            entries.append(min(timed, key=lambda t: t[1])[0])
    plans.record_tuned(run.key, entries)
    torch.cuda.synchronize(run.trellis.device)
    logger.info(
        "EXL3: plans timed for %s at %d token counts in %.2f s",
        run.key,
        len(entries),
        time.perf_counter() - start,
    )


def resolve_runs(
    runs: list[Exl3Run], run_plans: list[list[int]], dtype: torch.dtype
) -> None:
    """Size the device's workspace for every bucket's plan; log the plans if asked."""
    if not runs:
        return
    need = 0
    bf16 = dtype == torch.bfloat16
    for run, table in zip(runs, run_plans):
        n = run.trellis.shape[1] * 16
        _, source = plans.table_entries(run.key, run.trellis.device)
        log = envs.VLLM_EXL3_LOG_PLANS and (run.key, tuple(table)) not in _logged
        if log:
            _logged.add((run.key, tuple(table)))
        for m in warmup_m_values(max_tokens()):
            plan = ops.exl3_plan(
                run.trellis,
                len(run.shard_widths),
                run.codebook,
                bf16,
                m,
                table,
                MAX_WORKSPACE_FLOATS,
            )
            entry, src = plan[: ops.PLAN_FIELDS], plan[ops.PLAN_FIELDS]
            if plans.uses_workspace(entry):
                need = max(need, m * n)
            if log:
                origin = (
                    source
                    if src == ops.SOURCE_TABLE
                    else ("pinned" if plans.current_pins().pinned else "cost-model")
                )
                logger.info(
                    "EXL3 plan %s m<=%d: %s (%s)",
                    run.key,
                    m,
                    plans.describe(entry),
                    origin,
                )
    workspace_for(runs[0].trellis.device).reserve(need)


def warm_up_layer(
    key: tuple,
    k: int,
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    forward: Callable[[torch.Tensor], torch.Tensor],
) -> int:
    """Call forward(x) on zeros [m, k] for every bucket, once per distinct key; returns
    the number of calls made (0 when this configuration was already warmed)."""
    if key in _warmed or not envs.VLLM_EXL3_WARMUP:
        return 0
    _warmed.add(key)
    calls, start = 0, time.perf_counter()
    for m in warmup_m_values(max_tokens()):
        if not _fits(m, k, n, dtype):
            logger.debug(
                "EXL3 warm-up %s: m = %d and up left to first use (memory cap)", key, m
            )
            break
        forward(torch.zeros(m, k, dtype=dtype, device=device))
        calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # The warm-up's activations must not look like model memory to vLLM's KV-cache
        # sizing.
        torch.cuda.empty_cache()
    logger.debug(
        "EXL3: warmed up k=%d n=%d %s at %d token counts in %.2f s",
        k,
        n,
        key,
        calls,
        time.perf_counter() - start,
    )
    return calls
