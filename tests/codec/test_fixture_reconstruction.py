# SPDX-License-Identifier: Apache-2.0
"""Every quantized tensor of the real ExLlamaV3 checkpoints, reconstructed by the reference,
against the bf16 original it was quantized from.

The bound, per bitrate K: relative Frobenius error ||W_rec - W||_F / ||W||_F <= 1.6 * 2^-K.

Why this shape. After the random-sign Hadamard rotation the weights are close to i.i.d.
Gaussian, and for a Gaussian source the distortion-rate function is D(K) = sigma^2 * 2^(-2K), so
no K-bit code can get below a relative RMS error of 2^-K; a good trellis code (QTIP-style,
L = 16) gets within a few percent of it. ExLlamaV3 does not minimise the plain Frobenius error,
though: LDLQ (GPTQ-style error feedback with the calibration Hessian) minimises the
Hessian-weighted error and pushes part of it into directions the activations do not use, which
raises the plain error above the D(K) floor by a model-dependent factor.

Measured on these fixtures (ratio = error / 2^-K):
    4 bits, 3inst, 28 tensors: 0.0735 .. 0.0910  (ratio 1.18 .. 1.46)
    3 bits, mcg,   28 tensors: 0.1428 .. 0.1760  (ratio 1.14 .. 1.41)
    6 bits (lm_head), both:    0.0216 .. 0.0218  (ratio 1.38 .. 1.40)
The factor 1.6 leaves about 10% headroom above the worst measured ratio while staying far below
what any decoding mistake produces: a wrong bit order, codebook or tile permutation decodes
unrelated values, and the error is then >= 1 (the broken-decoder tests below check that every
tensor then fails).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fixture_paths import EXL3_FIXTURES, FIXTURES

BOUND_FACTOR = 1.6


def bound(bits: float) -> float:
    return BOUND_FACTOR * 2.0 ** -bits


@pytest.fixture(scope="module")
def original() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "bf16" / "model.safetensors"))


def reconstruction_errors(fmt, ref, ckpt: str,
                          original: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
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
    return [f"{name}: {err:.4f} > {bound(bits):.4f} at {bits} bits"
            for name, (bits, err) in errors.items() if not err <= bound(bits)]


@pytest.mark.parametrize("ckpt", sorted(EXL3_FIXTURES))
def test_every_tensor_within_bitrate_bound(fmt, ref, original, ckpt):
    decoder_bits, head_bits, codebook = EXL3_FIXTURES[ckpt]
    errors = reconstruction_errors(fmt, ref, ckpt, original)
    # Every linear of the model is EXL3: 4 layers x 7 projections + lm_head.
    linears = {name[: -len(".weight")] for name in original
               if name.endswith("_proj.weight") or name == "lm_head.weight"}
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
        monkeypatch.setattr(ref, "_states", lambda t, b, o: states(_reverse_bits16(t), b, o))
    elif bug == "bit order: uint32 halves not swapped":
        monkeypatch.setattr(ref, "_states",
                            lambda t, b, o: states(t.unflatten(-1, (-1, 2)).flip(-1).flatten(-2),
                                                   b, o))
    elif bug == "wrong codebook":
        table = ref.codebook_table
        monkeypatch.setattr(ref, "codebook_table",
                            lambda cb, device=None: table((int(cb) + 1) % 3, device))
    elif bug == "tile permutation: row-major":
        monkeypatch.setattr(ref, "_tile_to_positions", lambda: tuple(range(256)))
    else:
        raise AssertionError(bug)


BUGS = ("bit order: LSB-first words", "bit order: uint32 halves not swapped", "wrong codebook",
        "tile permutation: row-major")


@pytest.mark.parametrize("bug", BUGS)
@pytest.mark.parametrize("ckpt", sorted(EXL3_FIXTURES))
def test_broken_decoder_fails_the_bounds(fmt, ref, original, monkeypatch, ckpt, bug):
    _break(ref, monkeypatch, bug)
    errors = reconstruction_errors(fmt, ref, ckpt, original)
    failed = violations(errors)
    assert len(failed) == len(errors) == 29, bug
    # Not a near miss: a broken decoder produces errors of the order of the weights themselves.
    assert min(err for _, err in errors.values()) > 0.9
