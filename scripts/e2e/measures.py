# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the end-to-end scripts measure, shared by them.

Perplexity on the fixture validation text from vLLM prompt logprobs, by the method of
the recorded ExLlamaV3 values (tests/fixtures/README.md): the text tokenized without
special tokens, cut into non-overlapping WINDOW-token windows (the last partial one
dropped), each window scored alone with its first token as context only, perplexity =
exp(mean NLL over the scored tokens).

How closely two runs of the same requests agree: per-token logprobs (eager vs CUDA
graphs + torch.compile) and greedy continuations (TP=1 vs TP=2, with and without
speculation).

Pure Python (no torch, no vLLM at import), so the arithmetic is unit-tested on the CPU
against fake logprob sources; on the GPU host the logprobs are vLLM's
`RequestOutput.prompt_logprobs`. free_llm tears a measured `LLM` down so the next one in
the process starts on a clean GPU.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Perplexity over windows.

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


# Agreement of two runs.


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


# Speculative vs plain greedy decoding. Speculation verifies each draft with the target
# model, so its output is plain greedy decoding's but for rounding: verify steps run
# other batch shapes (other kernels, other summation orders) than plain decode steps,
# and where plain's top tokens nearly tie, that rounding may pick another of them.

# Top logprobs a plain run keeps per generated token. Not only the runner-up: where
# logits are flat (a random-weight model's), three or more tokens lie within a few
# hundredths of a nat, and the synthetic Qwen3-Next MTP run took plain's third twice.
TIE_LOGPROBS = 8
# The widest gap (nats) between plain's token and the speculative one, both among
# plain's kept top tokens, at which a speculative run may leave plain. Batch shapes
# alone move a token's logprob by up to about a quarter of a nat on the fixtures (their
# eager-vs-graphs records); a flip moves two tokens' apart.
TIE_NATS = 0.5


def top_logprobs(positions: Sequence[Mapping[int, Any]]) -> list[list[list]]:
    """vLLM's per-position logprob dicts (token id -> Logprob) as [[token, logprob],
    ...] per position, best first (JSON-friendly)."""
    return [
        sorted(([t, lp.logprob] for t, lp in pos.items()), key=lambda e: -e[1])
        for pos in positions
    ]


def divergence_gaps(
    plain: Sequence[Sequence[int]],
    plain_top: Sequence[Sequence[Sequence]],
    spec: Sequence[Sequence[int]],
) -> list[float | None]:
    """For each continuation speculation left: plain's logprob gap, at the first
    divergence, between its own token and the speculative one; None where the
    speculative token is not among plain's kept top tokens there."""
    if not (len(plain) == len(plain_top) == len(spec)):
        raise ValueError(
            f"{len(plain)} plain, {len(plain_top)} top-logprob and {len(spec)} "
            "speculative continuations (need one each per request)"
        )
    gaps: list[float | None] = []
    for p, top, s in zip(plain, plain_top, spec):
        i = common_prefix(p, s)
        if i >= min(len(p), len(s)):
            continue
        if len(top) != len(p):
            raise ValueError(
                f"{len(top)} top-logprob positions for a {len(p)}-token continuation"
            )
        kept = {int(t): float(lp) for t, lp in top[i]}
        gaps.append(kept[p[i]] - kept[s[i]] if s[i] in kept and p[i] in kept else None)
    return gaps


def tie_verdict(gaps: Sequence[float | None]) -> dict:
    """Whether every divergence in `gaps` is a near tie of plain's top tokens."""
    widest = max((math.inf if g is None else g for g in gaps), default=0.0)
    return {
        "diverged": len(gaps),
        "gaps": list(gaps),
        "widest_gap": widest,
        "pass": widest <= TIE_NATS,
    }


# Between two measured runs in one process.


def free_llm(llm) -> None:
    # The engine core runs in its own process; without an explicit shutdown it outlives
    # `del` and keeps its GPU memory until the interpreter exits.
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
