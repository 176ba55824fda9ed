# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Every case of damage.py through the three readers of a checkpoint (`inspect
--values`,
`dequantize`, vLLM's real loader on the CPU): the same verdict from each, a message that
names the file or tensor and the rule, and never a crash (a traceback, a MemoryError, a
KeyError...). Valid but unusual checkpoints load everywhere without a word."""

from __future__ import annotations

from collections import Counter

import pytest
from damage import CASES, ERROR, LOADS, PATHS, WARNING
from three_paths import run_all

# The bar for the corpus: at least this many cases across every class of damage.
MIN_CASES = 40
CLASSES = (
    "file",
    "json",
    "shards",
    "config",
    "declared",
    "values",
    "module",
    "unusual",
)


def test_the_corpus_covers_every_class():
    kinds = Counter(case.kind for case in CASES)
    assert len(CASES) >= MIN_CASES
    assert set(kinds) == set(CLASSES), kinds
    assert len({case.id for case in CASES}) == len(CASES)
    for (
        case
    ) in CASES:  # every error and warning is checked for what it says, on every path
        if case.expect.verdict != LOADS:
            assert all(case.expect.phrases(path) for path in PATHS), case.id


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_three_paths_give_the_same_named_verdict(case, tmp_path, vllm_world):
    ckpt = case.make(tmp_path)
    outcomes = run_all(ckpt, tmp_path)
    for path in PATHS:
        outcome = outcomes[path]
        where = f"{case.id} through {path}: {outcome.message or outcome.warnings}"
        assert not outcome.crashed, f"{where}\n{outcome.tool_output}"
        if case.expect.verdict == ERROR:
            assert outcome.failed, (
                f"{case.id} through {path}: accepted\n{outcome.tool_output}"
            )
            text = outcome.message
            if (
                path != "vllm"
            ):  # the tools: exactly one line on stderr names the problem
                assert len(text.splitlines()) == 1, where
        else:
            assert not outcome.failed, where
            text = outcome.warnings
        for phrase in case.expect.phrases(path):
            assert phrase in text, f"{where}\n  missing: {phrase!r}"
        if case.expect.verdict == LOADS:
            assert outcome.warnings == "" or path == "inspect", where
        if case.expect.verdict == WARNING:
            assert text, where


def test_gated_attention_q_proj_width():
    """Qwen3-Next's q_proj also carries the output gate (vLLM's default), unless
    config.json turns the gate off; other models' q_proj is the query alone."""
    from vllm.model_executor.layers.quantization.exl3.checkpoint import implied_dims

    cfg = {"hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}
    q = "model.layers.0.self_attn.q_proj"
    o = "model.layers.0.self_attn.o_proj"
    assert implied_dims({**cfg, "model_type": "qwen3_next"}, q)[:2] == (256, 512)
    assert implied_dims({**cfg, "model_type": "qwen3_next"}, o)[:2] == (256, 256)
    off = {**cfg, "model_type": "qwen3_next", "attn_output_gate": False}
    assert implied_dims(off, q)[:2] == (256, 256)
    assert implied_dims({**cfg, "model_type": "qwen3"}, q)[:2] == (256, 256)
