# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""pytest fixtures of the codec: the format reader and the reference decoder of this
repository's overlay sources (scripts/vllm_exl3/codec.py, so the tool's tests and vLLM's
see the same module objects whether or not a patched vLLM is installed), and the
qwen3-tiny validation windows and reference perplexities. A conftest imports the ones
its tests use."""

from __future__ import annotations

import pytest

from ..codec import exl3_format, reference
from .fixtures import QWEN3_TINY
from .qwen3_tiny import (
    model_from_state_dict,
    perplexity,
    reconstructed_state_dict,
    validation_windows,
)


@pytest.fixture(scope="session")
def fmt():
    return exl3_format


@pytest.fixture(scope="session")
def ref():
    return reference


@pytest.fixture(scope="session")
def val_windows():
    return validation_windows()


@pytest.fixture(scope="session")
def reconstructed_ppl(val_windows):
    """ckpt name -> perplexity of the fixture model with reference-reconstructed weights
    (computed once per session; the dequantize test compares against the same number).
    """
    cache: dict[str, float] = {}

    def get(ckpt: str) -> float:
        if ckpt not in cache:
            state = reconstructed_state_dict(exl3_format, reference, QWEN3_TINY / ckpt)
            model = model_from_state_dict(QWEN3_TINY / ckpt / "config.json", state)
            cache[ckpt] = perplexity(model, val_windows)
        return cache[ckpt]

    return get
