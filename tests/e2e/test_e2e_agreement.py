# SPDX-License-Identifier: Apache-2.0
"""Agreement measures of the GPU e2e record (scripts/e2e/agreement.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "e2e"))

from agreement import (common_prefix, continuation_agreement,  # noqa: E402
                       decode_logprob_agreement, logprob_agreement)


def test_logprob_agreement_max_and_mean():
    a = [[-1.0, -2.0], [-0.5]]
    b = [[-1.1, -2.0], [-0.2]]
    got = logprob_agreement(a, b)
    assert got["positions"] == 3
    assert got["max_abs"] == pytest.approx(0.3)
    assert got["mean_abs"] == pytest.approx(0.4 / 3)


def test_logprob_agreement_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="2 vs 1 sequences"):
        logprob_agreement([[0.0], [0.0]], [[0.0]])
    with pytest.raises(ValueError, match="sequence 0: 2 vs 1 positions"):
        logprob_agreement([[0.0, 1.0]], [[0.0]])
    with pytest.raises(ValueError, match="no positions"):
        logprob_agreement([[]], [[]])


def test_decode_agreement_stops_at_the_first_divergence():
    # Tokens agree for 2 positions; after that the logprobs condition on different text and
    # their (large) difference must not count.
    got = decode_logprob_agreement([[5, 6, 7, 8]], [[-0.1, -0.2, -0.3, -0.4]],
                                   [[5, 6, 9, 8]], [[-0.1, -0.25, -5.0, -9.0]])
    assert got["positions"] == 2
    assert got["max_abs"] == pytest.approx(0.05)


def test_continuation_agreement():
    a = [[1, 2, 3, 4], [1, 2, 3, 4], [9, 9]]
    b = [[1, 2, 3, 4], [1, 2, 0, 4], [8, 9]]
    got = continuation_agreement(a, b)
    assert got["identical"] == 1 and got["count"] == 3
    assert got["first_divergence"] == [None, 2, 0]
    assert got["matched_fraction"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    with pytest.raises(ValueError):
        continuation_agreement([], [])
