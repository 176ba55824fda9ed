# SPDX-License-Identifier: Apache-2.0
"""The perplexity arithmetic of the GPU e2e record (scripts/e2e/windows.py), fed by a fake
logprob source shaped like vLLM's prompt logprobs: a known next-token distribution per position,
so the expected perplexity is computed independently here."""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "e2e"))

from windows import (WINDOW, next_token_logprobs, perplexity,  # noqa: E402
                     relative_difference, split_windows)

FIXTURE_TOKENS = 184368  # tests/fixtures/README.md: val.txt's token count
FIXTURE_SCORED = 183960  # ... and the scored tokens of the recorded runs
PEAK = 3.0  # spread of the fake model's logits


@dataclass
class FakeLogprob:  # vLLM's Logprob: the value is in .logprob
    logprob: float
    rank: int | None = None


class FakeModel:
    """p(next = t | prefix) depends on the previous token only: a fixed random bigram table, so
    the true log-likelihood of a window is a plain sum the test computes on its own."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.vocab = vocab
        self.logp = []
        for _ in range(vocab):
            # Peaked rows (like a trained model's): a wrong target is far less likely.
            w = [math.exp(PEAK * rng.gauss(0, 1)) for _ in range(vocab)]
            z = sum(w)
            self.logp.append([math.log(x / z) for x in w])

    def sample(self, rng: random.Random, length: int) -> list[int]:
        ids = [rng.randrange(self.vocab)]
        while len(ids) < length:
            probs = [math.exp(x) for x in self.logp[ids[-1]]]
            ids.append(rng.choices(range(self.vocab), weights=probs)[0])
        return ids

    def prompt_logprobs(self, window: list[int], top: int = 0) -> list:
        """As vLLM returns them: None at position 0, then {token: Logprob} holding the actual
        token and the `top` most likely ones."""
        out: list = [None]
        for pos in range(1, len(window)):
            row = self.logp[window[pos - 1]]
            ranked = sorted(range(self.vocab), key=lambda t: -row[t])
            entry = {t: FakeLogprob(row[t], i + 1) for i, t in enumerate(ranked[:top])}
            entry[window[pos]] = FakeLogprob(row[window[pos]])
            out.append(entry)
        return out


def test_fixture_window_count_matches_the_recorded_runs():
    windows = split_windows(list(range(FIXTURE_TOKENS)))
    assert len(windows) == 360
    assert all(len(w) == WINDOW for w in windows)
    assert sum(len(w) - 1 for w in windows) == FIXTURE_SCORED
    # Non-overlapping and in order: window i starts at token i * WINDOW; the tail is dropped.
    assert [w[0] for w in windows[:3]] == [0, 512, 1024]
    assert windows[-1][-1] == 360 * 512 - 1


def test_split_rejects_too_short_text_and_windows():
    with pytest.raises(ValueError, match="do not fill"):
        split_windows([1, 2, 3], window=4)
    with pytest.raises(ValueError, match="context token"):
        split_windows([1, 2, 3], window=1)


@pytest.mark.parametrize("top", [0, 1, 5])
def test_perplexity_from_fake_prompt_logprobs(top):
    vocab, model = 23, FakeModel(23)
    rng = random.Random(1)
    ids = [rng.randrange(vocab) for _ in range(5 * 40 + 17)]
    windows = split_windows(ids, window=40)
    got = perplexity(next_token_logprobs(w, model.prompt_logprobs(w, top)) for w in windows)
    # Independent computation: the bigram log-likelihood, first token of each window unscored.
    nll = -sum(model.logp[w[i - 1]][w[i]] for w in windows for i in range(1, len(w)))
    assert got.scored == 5 * 39 and got.windows == 5
    assert got.nll_sum == pytest.approx(nll, rel=1e-12)
    assert got.ppl == pytest.approx(math.exp(nll / (5 * 39)), rel=1e-12)


def test_off_by_one_target_changes_the_answer():
    """Scoring the token at p with the distribution for p+1 (a classic slip) is detected."""
    vocab, model = 23, FakeModel(23, seed=3)
    w = model.sample(random.Random(2), 64)
    right = perplexity([next_token_logprobs(w, model.prompt_logprobs(w, top=vocab))]).ppl
    shifted = model.prompt_logprobs(w, top=vocab)
    shifted = [None] + shifted[2:] + [shifted[-1]]
    wrong = perplexity([next_token_logprobs(w, shifted)]).ppl
    assert relative_difference(wrong, right) > 0.5


def test_missing_or_bad_logprobs_are_errors():
    w = [3, 4, 5]
    with pytest.raises(ValueError, match="3 prompt logprob positions"):
        next_token_logprobs(w + [6], [None, {4: -1.0}, {5: -1.0}])
    with pytest.raises(ValueError, match="position 2: no logprob for the actual token 5"):
        next_token_logprobs(w, [None, {4: -1.0}, {6: -1.0}])
    with pytest.raises(ValueError, match="position 1: no logprob"):
        next_token_logprobs(w, [None, None, {5: -1.0}])
    with pytest.raises(ValueError, match="is nan"):
        next_token_logprobs(w, [None, {4: float("nan")}, {5: -1.0}])
    with pytest.raises(ValueError, match="no scored tokens"):
        perplexity([])


def test_relative_difference():
    assert relative_difference(6.5847 * 1.003, 6.5847) == pytest.approx(0.003)
    assert relative_difference(6.5, 6.5) == 0.0
