# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the tooling tests (builders in minitree.py) and the codec's for the
checkpoint tools' tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from minitree import MINI_SDIST, MadeSeries, make_series, write_tree
from vllm_exl3.testing import codec_fixtures

# The codec's fixtures, for the tests under this folder.
fmt = codec_fixtures.fmt
ref = codec_fixtures.ref
val_windows = codec_fixtures.val_windows
reconstructed_ppl = codec_fixtures.reconstructed_ppl


@pytest.fixture
def mini_sdist(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "sdist", MINI_SDIST)


@pytest.fixture
def series(tmp_path: Path, mini_sdist: Path) -> MadeSeries:
    return make_series(mini_sdist, tmp_path / "series")
