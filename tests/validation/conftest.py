# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Setup of the damaged-checkpoint corpus: import paths (the tools, the synthetic
writer, the CPU integration harness) and one vLLM world of size 1 over gloo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parents[1]
for path in (
    _REPO / "scripts",
    _REPO / "tests",
    _REPO / "tests" / "integration",
    _HERE,
):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory: pytest.TempPathFactory):
    """vLLM's distributed state on the CPU at TP=1; the integration tests' session world
    is reused when it already exists (vLLM holds one per process)."""
    from exl3_harness import gloo_world
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    with gloo_world(1, 0, str(tmp_path_factory.mktemp("dist") / "init")):
        yield
