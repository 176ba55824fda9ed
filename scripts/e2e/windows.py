# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Perplexity on the fixture validation text from vLLM prompt logprobs, by the method of
the recorded ExLlamaV3 values (tests/fixtures/README.md): the text tokenized without
special tokens, cut into non-overlapping WINDOW-token windows (the last partial one
dropped), each window scored alone with its first token as context only, perplexity =
exp(mean NLL over the scored tokens).

Pure Python (no torch, no vLLM), so the arithmetic is unit-tested on the CPU against a
fake logprob source; on the GPU host the logprobs are vLLM's
`RequestOutput.prompt_logprobs`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The window length of the recorded values (and of the model's training).
WINDOW = 512


def split_windows(ids: Sequence[int], window: int = WINDOW) -> list[list[int]]:
    """Non-overlapping windows of `window` ids; the last partial window is dropped."""
    if window < 2:
        raise ValueError(
            f"window must hold a context token and a scored token, got {window}"
        )
    count = len(ids) // window
    if count == 0:
        raise ValueError(f"{len(ids)} tokens do not fill one {window}-token window")
    return [list(ids[i * window : (i + 1) * window]) for i in range(count)]


def _logprob_value(entry: Any) -> float:
    # vLLM gives Logprob objects; plain floats are accepted for tests and saved results.
    return float(entry.logprob if hasattr(entry, "logprob") else entry)


def next_token_logprobs(
    window: Sequence[int], prompt_logprobs: Sequence[Mapping[int, Any] | None]
) -> list[float]:
    """The logprob of the actual token at positions 1..len-1 of `window` (position 0 is
    context only). `prompt_logprobs[p]` maps token id -> logprob of position p given
    tokens < p, as vLLM returns them (None at position 0)."""
    if len(prompt_logprobs) != len(window):
        raise ValueError(
            f"{len(prompt_logprobs)} prompt logprob positions for a "
            f"{len(window)}-token window (expected one per token)"
        )
    out = []
    for pos in range(1, len(window)):
        entry, token = prompt_logprobs[pos], window[pos]
        if entry is None or token not in entry:
            raise ValueError(
                f"position {pos}: no logprob for the actual token {token} "
                f"(have {None if entry is None else sorted(entry)[:8]})"
            )
        value = _logprob_value(entry[token])
        if not math.isfinite(value):
            raise ValueError(f"position {pos}: logprob of token {token} is {value}")
        out.append(value)
    return out


@dataclass(frozen=True)
class Perplexity:
    nll_sum: float
    scored: int
    windows: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.scored

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll)


def perplexity(per_window_logprobs: Iterable[Sequence[float]]) -> Perplexity:
    """Perplexity from each window's next-token logprobs (next_token_logprobs)."""
    nll, scored, windows = 0.0, 0, 0
    for logprobs in per_window_logprobs:
        nll -= math.fsum(logprobs)
        scored += len(logprobs)
        windows += 1
    if scored == 0:
        raise ValueError("no scored tokens")
    return Perplexity(nll_sum=nll, scored=scored, windows=windows)


def relative_difference(value: float, reference: float) -> float:
    """(value - reference) / reference."""
    return value / reference - 1.0
