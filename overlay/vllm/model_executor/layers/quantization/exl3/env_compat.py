# SPDX-License-Identifier: Apache-2.0
"""Deprecated `CUDA_EXL3_*` environment names of the earlier out-of-tree plugin.

The variables themselves are registered in `vllm/envs.py` as `VLLM_EXL3_*` and read through
`vllm.envs`. An old spelling is copied into the process environment under its new name (with a
deprecation warning) before anything reads it, so the Python side and the C++ side (which reads
`VLLM_EXL3_*` with getenv) both see it.
"""

import os
from collections.abc import MutableMapping

from vllm.logger import init_logger

logger = init_logger(__name__)

EXL3_ENV_NAMES = (
    "VLLM_EXL3_DETERMINISTIC",
    "VLLM_EXL3_BM",
    "VLLM_EXL3_SPLIT_K",
    "VLLM_EXL3_SPLIT_K_TRAFFIC",
    "VLLM_EXL3_RECONSTRUCT_M",
    "VLLM_EXL3_RECONSTRUCT_BASIS",
    "VLLM_EXL3_WGMMA",
    "VLLM_EXL3_STREAM_K",
    "VLLM_EXL3_SPREAD",
    "VLLM_EXL3_LOG_PLANS",
    "VLLM_EXL3_DEBUG_NAMES",
    "VLLM_EXL3_FORCE_REFERENCE",
)
NEW_PREFIX = "VLLM_EXL3_"
OLD_PREFIX = "CUDA_EXL3_"


def deprecated_name(name: str) -> str:
    return OLD_PREFIX + name.removeprefix(NEW_PREFIX)


def adopt_deprecated_env_names(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Copy each set `CUDA_EXL3_X` to `VLLM_EXL3_X` unless that is set; returns the new names
    that were filled in."""
    adopted = []
    for name in EXL3_ENV_NAMES:
        old = deprecated_name(name)
        if old not in environ:
            continue
        if name in environ:
            if environ[name] != environ[old]:
                logger.warning(
                    "%s=%r is ignored: %s=%r is set and takes precedence (%s is deprecated)",
                    old, environ[old], name, environ[name], old)
            continue
        logger.warning("%s is deprecated; use %s (taking its value %r)", old, name, environ[old])
        environ[name] = environ[old]
        adopted.append(name)
    return adopted
