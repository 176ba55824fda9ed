# SPDX-License-Identifier: Apache-2.0
"""The fixture model with reference-reconstructed weights, run in transformers on CPU (fp32),
reaches ExLlamaV3's own perplexity for that checkpoint within 0.5%.

ExLlamaV3 runs fp16 activations through its kernels; we run fp32 with the same decoded weights,
so a small difference is expected (measured: +0.016% at 4.0 bpw, +0.012% at 3.0 bpw mcg). A
decoding error of any kind moves the perplexity by far more than 0.5% (the 3-bit vs 4-bit
quantization alone is 6%)."""

from __future__ import annotations

import json

import pytest

from fixture_paths import EXL3_FIXTURES, FIXTURES

TOLERANCE = 0.005
# The values the fixtures README states (copied from the raw log, which the test also reads).
README_VALUES = {"exl3-4.0bpw": 6.5847, "exl3-3.0bpw-mcg": 7.0024}


def recorded_perplexity(ckpt: str) -> float:
    runs = json.loads((FIXTURES / "ppl_exllamav3_dense.json").read_text())
    (run,) = [r for r in runs if r["label"] == ckpt]
    assert run["scored_tokens"] == 360 * 511  # the window method the tests use
    return run["ppl"]


def test_validation_windows(val_windows):
    assert tuple(val_windows.shape) == (360, 512)
    assert val_windows.numel() + 184368 % 512 == 184368  # the README's token count


@pytest.mark.parametrize("ckpt", sorted(EXL3_FIXTURES))
def test_reconstructed_model_matches_exllamav3_perplexity(reconstructed_ppl, ckpt):
    recorded = recorded_perplexity(ckpt)
    assert recorded == pytest.approx(README_VALUES[ckpt], abs=5e-5)
    ppl = reconstructed_ppl(ckpt)
    assert abs(ppl / recorded - 1) < TOLERANCE, f"{ckpt}: {ppl:.4f} vs ExLlamaV3 {recorded:.4f}"
