# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The qwen3-tiny fixture model: its files, and perplexity on the fixture's validation
text with the method of the recorded ExLlamaV3 values (tests/fixtures/README.md):
tokenized without special tokens, non-overlapping 512-token windows (last partial one
dropped), each window scored alone, its first token context only. transformers is
imported only where a model or the tokenizer is needed."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from .fixtures import QWEN3_TINY as FIXTURES
from .fixtures import TOKENIZER

VAL_TEXT = FIXTURES / "val.txt"
# The two real ExLlamaV3 1.6.5 conversions: name -> (decoder bits, head bits, codebook
# name).
EXL3_FIXTURES = {
    "exl3-4.0bpw": (4, 6, "3inst"),
    "exl3-3.0bpw-mcg": (3, 6, "mcg"),
}

# Perplexity.

# How close the fixture model with reference-reconstructed weights, run in transformers
# on the CPU in fp32, comes to ExLlamaV3's own perplexity for that checkpoint. ExLlamaV3
# runs fp16 activations through its kernels with the same decoded weights, so a small
# difference is expected (measured: +0.016 % at 4.0 bpw, +0.012 % at 3.0 bpw mcg); a
# decoding error of any kind moves the perplexity by far more (the 3-bit vs 4-bit
# quantization alone is 6 %).
TOLERANCE = 0.005
# The window method the recorded perplexities used: 360 windows of 511 scored tokens.
RECORDED_SCORED_TOKENS = 360 * 511

WINDOW = 512
# Windows per forward pass: large enough to keep the 2 CPU cores busy with few Python
# round trips, small enough that fp32 logits (8 x 512 x 4096 x 4 B = 64 MiB) stay
# modest.
BATCH = 8
# The CI machine has 2 cores; more threads than cores only adds contention.
THREADS = 2


def validation_windows() -> torch.Tensor:
    import transformers

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER / "tokenizer.json")
    )
    ids = tokenizer(VAL_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)[
        "input_ids"
    ]
    count = len(ids) // WINDOW
    return torch.tensor(ids[: count * WINDOW]).view(count, WINDOW)


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def perplexity(
    model: torch.nn.Module,
    windows: torch.Tensor,
    device: str = "cpu",
    batch_size: int = BATCH,
) -> float:
    """Perplexity of `model` over the validation windows; non-finite logits are an
    error (a NaN would otherwise surface as a NaN perplexity, or vanish in a mean)."""
    model.eval()
    nll, scored = 0.0, 0
    with _threads(THREADS), torch.inference_mode():
        for start in range(0, windows.shape[0], batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model(batch).logits[:, :-1].float()
            if not torch.isfinite(logits).all():
                raise AssertionError(f"non-finite logits in windows from {start}")
            targets = batch[:, 1:]
            nll += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                targets.reshape(-1),
                reduction="sum",
            ).item()
            scored += targets.numel()
    return math.exp(nll / scored)


def model_from_state_dict(
    config_path: Path, state: dict[str, torch.Tensor]
) -> torch.nn.Module:
    """An fp32 transformers model of the config (its quantization block dropped) with
    `state`."""
    import transformers

    cfg = json.loads(Path(config_path).read_text())
    cfg.pop("quantization_config", None)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model


def reconstructed_state_dict(fmt, ref, ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """HF-layout weights of an EXL3 checkpoint: every EXL3 linear reconstructed (fp32,
    W^T), every other tensor as stored. The fixture model has no padding to trim."""
    index = fmt.read_safetensors_index(ckpt_dir)
    specs = fmt.find_exl3_modules(index)
    owned = {n for s in specs.values() for n in s.tensor_names}
    state = {}
    for prefix, spec in specs.items():
        w = fmt.load_module(ckpt_dir, spec, index=index)
        state[f"{prefix}.weight"] = ref.reconstruct(
            w.trellis, w.suh, w.svh, w.codebook
        ).t()
    for name, entry in index.items():
        if name not in owned:
            state[name] = fmt.read_tensor(ckpt_dir, name, entry)
    return state


def recorded_perplexity(ckpt: str) -> float:
    """ExLlamaV3 1.6.5's perplexity for a fixture conversion, from its raw log."""
    runs = json.loads((FIXTURES / "ppl_exllamav3_dense.json").read_text())
    (run,) = [r for r in runs if r["label"] == ckpt]
    assert run["scored_tokens"] == RECORDED_SCORED_TOKENS
    return run["ppl"]
