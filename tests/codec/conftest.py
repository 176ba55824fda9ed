# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Shared setup of the codec tests: import paths, fixture locations, the codec modules.

The codec is imported from this repository's overlay sources through
scripts/vllm_exl3/codec.py (a private package), so these tests check the files in the
tree whether or not the series has been applied to an installed vLLM.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO = Path(__file__).resolve().parents[2]
for path in (_REPO / "scripts", _REPO / "tests", Path(__file__).resolve().parent):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


@pytest.fixture(scope="session")
def fmt():
    from vllm_exl3.codec import exl3_format

    return exl3_format


@pytest.fixture(scope="session")
def ref():
    from vllm_exl3.codec import reference

    return reference


@pytest.fixture(scope="session")
def val_windows():
    from qwen3_tiny import validation_windows

    return validation_windows()


@pytest.fixture(scope="session")
def reconstructed_ppl(fmt, ref, val_windows):
    """ckpt name -> perplexity of the fixture model with reference-reconstructed weights
    (computed once per session; the dequantize test compares against the same number).
    """
    from qwen3_tiny import (
        FIXTURES,
        model_from_state_dict,
        perplexity,
        reconstructed_state_dict,
    )

    cache: dict[str, float] = {}

    def get(ckpt: str) -> float:
        if ckpt not in cache:
            state = reconstructed_state_dict(fmt, ref, FIXTURES / ckpt)
            model = model_from_state_dict(FIXTURES / ckpt / "config.json", state)
            cache[ckpt] = perplexity(model, val_windows)
        return cache[ckpt]

    return get
