# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Deprecated environment names, resolved in Python only.

The settings are registered in `vllm/envs.py` as `VLLM_EXL3_*` and read through
`vllm.envs`; the kernels read no environment. Two older spellings still work, with a
deprecation warning, when the first EXL3 config is built:

- `CUDA_EXL3_X` (the earlier out-of-tree plugin) is copied to `VLLM_EXL3_X`;
- the per-knob plan variables `VLLM_EXL3_BM`, `_SPLIT_K`, `_SPLIT_K_TRAFFIC`,
  `_RECONSTRUCT_M`, `_RECONSTRUCT_BASIS`, `_WGMMA`, `_STREAM_K`, `_SPREAD` (or their
  `CUDA_EXL3_` forms) become the matching keys of the one debug setting
  `VLLM_EXL3_PLAN`.
"""

import os
from collections.abc import MutableMapping

from vllm.logger import init_logger

logger = init_logger(__name__)

NEW_PREFIX = "VLLM_EXL3_"
OLD_PREFIX = "CUDA_EXL3_"
EXL3_ENV_NAMES = (
    "VLLM_EXL3_DETERMINISTIC",
    "VLLM_EXL3_LOG_PLANS",
    "VLLM_EXL3_DEBUG_NAMES",
    "VLLM_EXL3_FORCE_REFERENCE",
    "VLLM_EXL3_WARMUP",
)
PLAN_SETTING = "VLLM_EXL3_PLAN"
# Old per-knob variable -> VLLM_EXL3_PLAN key, and how its value translates.
PLAN_KNOBS = {
    "VLLM_EXL3_BM": "bm",
    "VLLM_EXL3_SPLIT_K": "split_k",
    "VLLM_EXL3_SPLIT_K_TRAFFIC": "split_k_traffic",
    "VLLM_EXL3_RECONSTRUCT_M": "reconstruct_m",
    "VLLM_EXL3_RECONSTRUCT_BASIS": "path",
    "VLLM_EXL3_WGMMA": "wgmma",
    "VLLM_EXL3_STREAM_K": "stream_k",
    "VLLM_EXL3_SPREAD": "spread",
}


def deprecated_name(name: str) -> str:
    return OLD_PREFIX + name.removeprefix(NEW_PREFIX)


def _knob_value(name: str, value: str) -> str:
    if name == "VLLM_EXL3_RECONSTRUCT_M":
        # The old knob: a value <= 0 meant "never reconstruct".
        try:
            return str(max(int(value), 0))
        except ValueError:
            return value
    return value


def adopt_deprecated_env_names(
    environ: MutableMapping[str, str] = os.environ,
) -> list[str]:
    """Resolve the deprecated names into `environ`; returns the new names filled in."""
    adopted = []
    for name in (*EXL3_ENV_NAMES, *PLAN_KNOBS):
        old = deprecated_name(name)
        if old not in environ:
            continue
        if name in environ:
            if environ[name] != environ[old]:
                logger.warning(
                    "%s=%r is ignored: %s=%r is set and takes precedence (%s is "
                    "deprecated)",
                    old,
                    environ[old],
                    name,
                    environ[name],
                    old,
                )
            continue
        logger.warning(
            "%s is deprecated; use %s (taking its value %r)", old, name, environ[old]
        )
        environ[name] = environ[old]
        adopted.append(name)
    knobs = [(name, PLAN_KNOBS[name]) for name in PLAN_KNOBS if environ.get(name)]
    if knobs:
        items = ",".join(
            f"{key}={_knob_value(name, environ[name])}" for name, key in knobs
        )
        names = ", ".join(name for name, _ in knobs)
        if environ.get(PLAN_SETTING):
            logger.warning(
                "%s are deprecated and ignored: %s=%r is set",
                names,
                PLAN_SETTING,
                environ[PLAN_SETTING],
            )
        else:
            logger.warning(
                "%s are deprecated; use %s=%r (taken from them)",
                names,
                PLAN_SETTING,
                items,
            )
            environ[PLAN_SETTING] = items
            adopted.append(PLAN_SETTING)
        for name, _ in knobs:
            # vLLM warns about VLLM_* names it does not know; they are consumed here.
            del environ[name]
    return adopted
