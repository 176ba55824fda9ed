# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tearing down a vLLM `LLM` so the next one in the process starts on a clean GPU."""

from __future__ import annotations

import gc


def free_llm(llm) -> None:
    # The engine core runs in its own process; without an explicit shutdown it outlives
    # `del` and keeps its GPU memory until the interpreter exits.
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
