# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""MoE checkpoints for the CPU tests, and the independent oracle they are checked
against.

Fixtures (tests/fixtures/moe, see its README): the leading layers of real ExLlamaV3
1.6.5 conversions of qwen3moe-e16-tiny and dsv3-tiny. `assemble` turns one into a
loadable checkpoint directory: config.json with num_hidden_layers cut to the kept
layers, the kept tensors as ExLlamaV3 wrote them, plus a generated bf16 embedding and a
generated 6-bit EXL3 lm_head (the converter's layout, random codes), tensor_storage
extended to match, and the tokenizer.

The oracle never touches vLLM: transformers' own model class for the architecture, with
every EXL3 module replaced by its weight decoded by the reference codec
(reference.reconstruct, fp32), padding trimmed, experts stacked as transformers stores
them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from vllm.model_executor.layers.quantization.exl3 import reference
from vllm.model_executor.layers.quantization.exl3.format import (
    Codebook,
    find_exl3_modules,
    load_module,
    read_safetensors_index,
)
from vllm_exl3.testing import synthetic_checkpoint as synth
from vllm_exl3.testing.fixtures import (
    MOE_FIXTURES,
    TOKENIZER,  # the MoE fixtures use the same one
)

# name -> (codebook, SHA-256 of layers.safetensors)
FIXTURE_SUBSETS = {
    "qwen3moe-e16-3.0bpw-mcg": (
        "mcg",
        "29356ac2f234f677978994c3c7b972d3e1ceeef00ae52375872022c727fa8c94",
    ),
    "qwen3moe-e16-5.0bpw-mul1": (
        "mul1",
        "d692318ba512066fa6f8df4294c931b2a1d24d89dd956e3f79e28bc26612949f",
    ),
    "dsv3-4.0bpw-mcg": (
        "mcg",
        "e1bff817b2279d0d0e45c5574a4f25d81da7ebbeb14fe6996b67dcfecea2a05b",
    ),
}
# The real embeddings' standard deviation is 0.054-0.062; the generated one matches it.
EMBED_STD = 0.06
HEAD_BITS = 6  # ExLlamaV3's default head_bits
DEEPSEEK_V3_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assemble(name: str, out_dir: Path, seed: int = 0) -> Path:
    """A loadable checkpoint directory from the fixture subset `name`."""
    src = MOE_FIXTURES / name
    codebook = synth.CODEBOOK_NAMES[FIXTURE_SUBSETS[name][0]]
    out_dir.mkdir(parents=True)
    tensors = load_file(src / "layers.safetensors")
    layers = 1 + max(
        int(k.split(".")[2]) for k in tensors if k.startswith("model.layers.")
    )
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    if cfg.get("model_type") == "deepseek_v3":
        # transformers 5 writes DeepSeek-V3 configs without these two keys (its model
        # always scores with a sigmoid plus the correction bias); vLLM 0.26 reads them
        # with the defaults "softmax" and no bias, which would be another model.
        cfg.update(DEEPSEEK_V3_ROUTING)
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    generated = {
        "model.embed_tokens.weight": (
            EMBED_STD * torch.randn((vocab, hidden), generator=gen)
        ).to(torch.bfloat16)
    }
    head = synth.LinearSlot(
        "lm_head", hidden, vocab, "vocab", "lm_head", bits_key="head_bits"
    )
    generated.update(synth._exl3_tensors(head, HEAD_BITS, codebook, False, gen))
    save_file(
        {**tensors, **generated},
        str(out_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    document = json.loads((src / "quantization_config.json").read_text())
    storage = document["tensor_storage"]
    storage["model.embed_tokens"] = {
        "stored_tensors": synth._storage_entry(
            {"model.embed_tokens.weight": generated["model.embed_tokens.weight"]}
        )
    }
    head_entry = {"quant_format": "exl3", "bits_per_weight": HEAD_BITS}
    if codebook in synth.MULTIPLIER_KEYS:
        key, value = synth.MULTIPLIER_KEYS[codebook]
        head_entry[key] = value & 0xFFFFFFFF
    storage["lm_head"] = {
        "stored_tensors": synth._storage_entry(
            {k: v for k, v in generated.items() if k.startswith("lm_head.")}
        ),
        **head_entry,
    }
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=4))
    (out_dir / "quantization_config.json").write_text(json.dumps(document, indent=4))
    link_tokenizer(out_dir)
    return out_dir


def link_tokenizer(ckpt_dir: Path) -> None:
    for f in TOKENIZER.iterdir():
        if not (ckpt_dir / f.name).exists():
            os.symlink(f, ckpt_dir / f.name)


# ---- the oracle
# ----------------------------------------------------------------------------


def decoded_modules(
    ckpt_dir: Path, under: tuple[str, ...] = ("",)
) -> dict[str, torch.Tensor]:
    """Every EXL3 module of a checkpoint (whose name starts with one of `under`) as W
    fp32 [k_pad, n_pad] (y = x @ W)."""
    index = read_safetensors_index(ckpt_dir)
    out = {}
    for prefix, spec in find_exl3_modules(index).items():
        if not prefix.startswith(under):
            continue
        w = load_module(ckpt_dir, spec, index=index)
        out[prefix] = reference.reconstruct(
            w.trellis, w.suh, w.svh, int(w.codebook), dtype=torch.float32
        )
    return out


def _hf_weight(dense: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A decoded [k_pad, n_pad] module as an HF (out, in) weight of `shape`, padding
    cut."""
    out, inp = shape
    return dense[:inp, :out].t()


def transformers_model(ckpt_dir: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of the checkpoint's architecture with the reference-decoded
    weights."""
    import transformers

    cfg = json.loads((ckpt_dir / "config.json").read_text())
    cfg.pop("quantization_config", None)
    arch = cfg["architectures"][0]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    model = getattr(transformers, arch)(config_cls(**cfg)).eval()
    plain = load_file(str(ckpt_dir / "model.safetensors"))
    dense = decoded_modules(ckpt_dir)
    state = {}
    for name, param in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj") and module.endswith(".experts"):
            # transformers stacks experts: gate_up_proj [E, 2I, H], down_proj [E, H, I].
            num = param.shape[0]
            if leaf == "gate_up_proj":
                inter = param.shape[1] // 2
                state[name] = torch.stack(
                    [
                        torch.cat(
                            [
                                _hf_weight(
                                    dense[f"{module}.{e}.gate_proj"],
                                    (inter, param.shape[2]),
                                ),
                                _hf_weight(
                                    dense[f"{module}.{e}.up_proj"],
                                    (inter, param.shape[2]),
                                ),
                            ]
                        )
                        for e in range(num)
                    ]
                )
            else:
                state[name] = torch.stack(
                    [
                        _hf_weight(
                            dense[f"{module}.{e}.down_proj"], tuple(param.shape[1:])
                        )
                        for e in range(num)
                    ]
                )
        elif leaf == "weight" and module in dense:
            state[name] = _hf_weight(dense[module], tuple(param.shape))
        else:
            state[name] = plain[name].float()
    model.load_state_dict(state)
    return model.to(dtype)


def codebook_of(name: str) -> Codebook:
    return synth.CODEBOOK_NAMES[FIXTURE_SUBSETS[name][0]]
