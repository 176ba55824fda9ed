# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the CPU integration tests (real vLLM 0.26 layer classes, gloo world)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from exl3_harness import FIXTURES, gloo_world

# tests/synthetic_checkpoint.py lives one folder up; importable before any test
# module imports it.
TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


@pytest.fixture(scope="session")
def world1(tmp_path_factory: pytest.TempPathFactory):
    """A world of size 1 over gloo; layers must be built inside it (parameters read the
    TP rank when constructed)."""
    if not FIXTURES.is_dir():
        pytest.fail(f"fixture checkpoints missing: {FIXTURES}")
    init_file = tmp_path_factory.mktemp("dist") / "init"
    with gloo_world(1, 0, str(init_file)) as vllm_config:
        yield vllm_config
