# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the tooling tests (builders in minitree.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from minitree import MINI_SDIST, MadeSeries, make_series, write_tree


@pytest.fixture
def mini_sdist(tmp_path: Path) -> Path:
    return write_tree(tmp_path / "sdist", MINI_SDIST)


@pytest.fixture
def series(tmp_path: Path, mini_sdist: Path) -> MadeSeries:
    return make_series(mini_sdist, tmp_path / "series")
