# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""How closely two runs of the same requests agree: per-token logprobs (eager vs CUDA
graphs + torch.compile) and greedy continuations (TP=1 vs TP=2). Pure Python,
unit-tested on the CPU."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens two continuations share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def logprob_agreement(
    a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]
) -> dict:
    """Max and mean |a - b| over matching positions of equally long sequences."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} vs {len(b)} sequences")
    diffs = []
    for i, (x, y) in enumerate(zip(a, b)):
        if len(x) != len(y):
            raise ValueError(f"sequence {i}: {len(x)} vs {len(y)} positions")
        diffs += [abs(p - q) for p, q in zip(x, y)]
    if not diffs:
        raise ValueError("no positions to compare")
    return {
        "max_abs": max(diffs),
        "mean_abs": sum(diffs) / len(diffs),
        "positions": len(diffs),
    }


def decode_logprob_agreement(
    a_tokens: Sequence[Sequence[int]],
    a_logprobs: Sequence[Sequence[float]],
    b_tokens: Sequence[Sequence[int]],
    b_logprobs: Sequence[Sequence[float]],
) -> dict:
    """logprob_agreement of the sampled tokens' logprobs, over each pair of greedy
    continuations' common prefix only (after a divergence the two runs condition on
    different text)."""
    if not (len(a_tokens) == len(a_logprobs) == len(b_tokens) == len(b_logprobs)):
        raise ValueError(
            "token and logprob lists of both runs must have one entry per request"
        )
    xs, ys = [], []
    for ta, la, tb, lb in zip(a_tokens, a_logprobs, b_tokens, b_logprobs):
        if len(ta) != len(la) or len(tb) != len(lb):
            raise ValueError("each continuation needs one logprob per token")
        n = common_prefix(ta, tb)
        xs.append(list(la[:n]))
        ys.append(list(lb[:n]))
    return logprob_agreement(xs, ys)


def continuation_agreement(
    a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]
) -> dict:
    """Identical continuations and the mean fraction of tokens before the first
    divergence."""
    if len(a) != len(b) or not a:
        raise ValueError(
            f"{len(a)} vs {len(b)} continuations (need the same, non-zero count)"
        )
    prefixes = [common_prefix(x, y) for x, y in zip(a, b)]
    lengths = [max(len(x), len(y)) for x, y in zip(a, b)]
    identical = sum(1 for x, y in zip(a, b) if list(x) == list(y))
    return {
        "identical": identical,
        "count": len(a),
        "matched_fraction": sum(p / n if n else 1.0 for p, n in zip(prefixes, lengths))
        / len(a),
        "first_divergence": [p if p < n else None for p, n in zip(prefixes, lengths)],
    }
