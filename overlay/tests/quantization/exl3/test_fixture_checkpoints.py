# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The two real ExLlamaV3 1.6.5 conversions decoded by the reference codec: every
reconstructed weight against the bf16 original it was quantized from, and the
reconstructed model's perplexity against ExLlamaV3's own for that checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from vllm_exl3.testing.qwen3_tiny import (
    EXL3_FIXTURES,
    FIXTURES,
    TOLERANCE,
    recorded_perplexity,
)

BOUND_FACTOR = 1.6


def bound(bits: float) -> float:
    return BOUND_FACTOR * 2.0**-bits


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "bf16" / "model.safetensors"))


def reconstruction_errors(
    fmt, ref, ckpt: str, original: dict[str, torch.Tensor]
) -> dict[str, tuple[float, float]]:
    """{module: (bits, relative Frobenius error)} for every EXL3 linear of a fixture."""
    path = FIXTURES / ckpt
    index = fmt.read_safetensors_index(path)
    errors = {}
    for prefix, spec in fmt.find_exl3_modules(index).items():
        w = fmt.load_module(path, spec, index=index)
        rec = ref.reconstruct(w.trellis, w.suh, w.svh, w.codebook, w.bits)
        orig = original[f"{prefix}.weight"].float().t()  # HF (out, in) -> W (in, out)
        errors[prefix] = (spec.bits, ((rec - orig).norm() / orig.norm()).item())
    return errors


def violations(errors: dict[str, tuple[float, float]]) -> list[str]:
    return [
        f"{name}: {err:.4f} > {bound(bits):.4f} at {bits} bits"
        for name, (bits, err) in errors.items()
        if not err <= bound(bits)
    ]


@pytest.mark.parametrize("ckpt", sorted(EXL3_FIXTURES))
def test_every_tensor_within_bitrate_bound(fmt, ref, original, ckpt):
    decoder_bits, head_bits, codebook = EXL3_FIXTURES[ckpt]
    errors = reconstruction_errors(fmt, ref, ckpt, original)
    # Every linear of the model is EXL3: 4 layers x 7 projections + lm_head.
    linears = {
        name[: -len(".weight")]
        for name in original
        if name.endswith("_proj.weight") or name == "lm_head.weight"
    }
    assert set(errors) == linears and len(errors) == 29
    for name, (bits, _) in errors.items():
        assert bits == (head_bits if name == "lm_head" else decoder_bits), name
    assert not violations(errors)


def _reverse_bits16(t: torch.Tensor) -> torch.Tensor:
    v = t.to(torch.int32) & 0xFFFF
    out = torch.zeros_like(v)
    for b in range(16):
        out |= ((v >> b) & 1) << (15 - b)
    return torch.where(out >= 1 << 15, out - (1 << 16), out).to(torch.int16)


def _break(ref, monkeypatch, bug: str) -> None:
    states = ref._states
    if bug == "bit order: LSB-first words":
        monkeypatch.setattr(
            ref, "_states", lambda t, b, o: states(_reverse_bits16(t), b, o)
        )
    elif bug == "bit order: uint32 halves not swapped":
        monkeypatch.setattr(
            ref,
            "_states",
            lambda t, b, o: states(t.unflatten(-1, (-1, 2)).flip(-1).flatten(-2), b, o),
        )
    elif bug == "wrong codebook":
        table = ref.codebook_table
        monkeypatch.setattr(
            ref,
            "codebook_table",
            lambda cb, device=None: table((int(cb) + 1) % 3, device),
        )
    elif bug == "tile permutation: row-major":
        monkeypatch.setattr(ref, "_tile_to_positions", lambda: tuple(range(256)))
    else:
        raise AssertionError(bug)


BUGS = (
    "bit order: LSB-first words",
    "bit order: uint32 halves not swapped",
    "wrong codebook",
    "tile permutation: row-major",
)


@pytest.mark.parametrize("bug", BUGS)
@pytest.mark.parametrize("ckpt", sorted(EXL3_FIXTURES))
def test_broken_decoder_fails_the_bounds(fmt, ref, original, monkeypatch, ckpt, bug):
    _break(ref, monkeypatch, bug)
    errors = reconstruction_errors(fmt, ref, ckpt, original)
    failed = violations(errors)
    assert len(failed) == len(errors) == 29, bug
    # Not a near miss: a broken decoder produces errors of the order of the weights
    # themselves.
    assert min(err for _, err in errors.values()) > 0.9


# The fixture model with reference-reconstructed weights, run in transformers on CPU
# (fp32), reaches ExLlamaV3's own perplexity for that checkpoint within TOLERANCE.

# The values the fixtures README states (copied from the raw log, which the test also
# reads).
README_VALUES = {"exl3-4.0bpw": 6.5847, "exl3-3.0bpw-mcg": 7.0024}


def test_validation_windows(val_windows):
    assert tuple(val_windows.shape) == (360, 512)
    assert val_windows.numel() + 184368 % 512 == 184368  # the README's token count


@pytest.mark.parametrize("ckpt", sorted(EXL3_FIXTURES))
def test_reconstructed_model_matches_exllamav3_perplexity(reconstructed_ppl, ckpt):
    recorded = recorded_perplexity(ckpt)
    assert recorded == pytest.approx(README_VALUES[ckpt], abs=5e-5)
    ppl = reconstructed_ppl(ckpt)
    assert abs(ppl / recorded - 1) < TOLERANCE, (
        f"{ckpt}: {ppl:.4f} vs ExLlamaV3 {recorded:.4f}"
    )
