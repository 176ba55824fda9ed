# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures of the EXL3 tests: a gloo world of size 1 (real vLLM 0.26 layer classes on
the CPU), the codec's fixtures (vllm_exl3.testing.codec_fixtures), the `gpu` marker, and
no global cleanup after each test: these tests hold one gloo world per session, which
vLLM's per-test `cleanup_dist_env_and_memory` would tear down."""

from __future__ import annotations

import pytest
from vllm_exl3.testing import codec_fixtures

from .exl3_harness import FIXTURES, gloo_world

# The codec's fixtures, for the tests under this folder.
fmt = codec_fixtures.fmt
ref = codec_fixtures.ref
val_windows = codec_fixtures.val_windows
reconstructed_ppl = codec_fixtures.reconstructed_ppl


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")


@pytest.fixture
def should_do_global_cleanup_after_test() -> bool:
    return False


@pytest.fixture(scope="session")
def world1(tmp_path_factory: pytest.TempPathFactory):
    """A world of size 1 over gloo; layers must be built inside it (parameters read the
    TP rank when constructed)."""
    if not FIXTURES.is_dir():
        pytest.fail(f"fixture checkpoints missing: {FIXTURES}")
    init_file = tmp_path_factory.mktemp("dist") / "init"
    with gloo_world(1, 0, str(init_file)) as vllm_config:
        yield vllm_config
