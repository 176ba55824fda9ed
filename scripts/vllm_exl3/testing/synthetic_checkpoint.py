#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Write EXL3 checkpoints with random trellis codes in ExLlamaV3 1.6.5's on-disk layout.

Covers architectures we have no real checkpoint for: any config the architecture plan
knows (scripts/vllm_exl3/architecture.py: dense, qwen2/qwen3 MoE, Mixtral, GLM-4.5 MoE,
Qwen3-Next (with MTP layers under `mtp.`), DeepSeek-style MLA + MoE + MTP, DeepSeek-V3.2
/ GLM-5 DSA). Layout as in
exl3-format.md §1: per-projection tensor sets (trellis int16, suh/svh fp16, an int32
scalar marker for mcg/mul1), k and n padded to 128 with svh = 0 on padded output
columns, an lm_head always present (padded vocab), norms/embeddings in the model dtype,
routers, kv_b_proj and the DSA indexer's wk / weights_proj fp16 unquantized at their
real dims; config.json with the quantization_config block
(tie_word_embeddings forced to false where present), quantization_config.json with
tensor_storage, shards + index over a cap.

Random words are valid trellis content: every int16 word sequence decodes (the
tail-biting ring has no invalid states), so the reference decodes these checkpoints like
real ones. `embed_bits` 1..8 stores the token embedding as ExLlamaV3's `--embed_bits`
does (exl3-format.md §8): `embed_tokens.trellis` int16 [vocab, groups * (1 + 16K)] of
random rings, each with a realistic fp16 scale in word 0, and `embed_tokens.signs` fp16
[groups, 256] of +-1; nothing in the JSON files says so (the converter writes no
`embed_bits` key).

As a script:
    python -m vllm_exl3.testing.synthetic_checkpoint --config qwen3-tiny --bits 4 \
        --codebook mul1 --out DIR
    python -m vllm_exl3.testing.synthetic_checkpoint --config path/to/config.json \
        --bits 2.5 --layers 2 ...
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..architecture import (
    MTP_LAYER_KEYS,
    LinearSlot,
    ModelPlan,
    mtp_layer_count,
    plan_model,
    round_up,
)
from ..codec import exl3_format as fmt

EXLLAMAV3_VERSION = "1.6.5"  # the converter release whose layout this reproduces
DEFAULT_HEAD_BITS = 6  # ExLlamaV3's default head_bits
UNQUANTIZED_HEAD_BITS = 16  # head_bits 16 = lm_head stored as fp16 .weight
DEFAULT_SHARD_MIB = 8192  # ExLlamaV3's --shard_size default
CALIBRATION = {"rows": 250, "cols": 2048}  # converter defaults, informational
CODEBOOK_NAMES = {
    "3inst": fmt.Codebook.THREE_INST,
    "mcg": fmt.Codebook.MCG,
    "mul1": fmt.Codebook.MUL1,
}
# RMS of the decoded codebook values (exl3-format.md §4 table); svh divides by it so the
# synthetic W has a realistic RMS (~0.02) whatever the codebook.
CODEBOOK_RMS = {
    fmt.Codebook.THREE_INST: 1.2437,
    fmt.Codebook.MCG: 1.2441,
    fmt.Codebook.MUL1: 1.0003,
}
# suh * svh * codebook RMS ~ 0.02: the weight scale of a trained transformer.
SUH_RANGE = (0.08, 0.12)
SVH_RANGE = (0.16, 0.24)
MARKERS = {
    fmt.Codebook.MCG: ("mcg", fmt.MCG_MARKER_VALUE),
    fmt.Codebook.MUL1: ("mul1", fmt.MUL1_MARKER_VALUE),
}
MULTIPLIER_KEYS = {
    fmt.Codebook.MCG: ("mcg_multiplier", fmt.MCG_MARKER_VALUE),
    fmt.Codebook.MUL1: ("mul1_multiplier", fmt.MUL1_MARKER_VALUE),
}
# A quantized embedding's group scales: the decoded group's RMS is its scale times the
# mul1 codebook's RMS (~1), so this is the RMS of the "embed" plain tensors below.
EMBED_SCALE_RANGE = (0.015, 0.025)
# ExLlamaV3's --embed_bits default: the table stays unquantized (`.weight`).
UNQUANTIZED_EMBED_BITS = 16
# Files a converter copies from the source directory besides the weights and config.
COPIED_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".py", ".tiktoken")
NOT_COPIED = {"config.json", "model.safetensors.index.json", "quantization_config.json"}

_QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 1,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 768,
    "layer_types": ["full_attention"] * 4,
    "max_position_embeddings": 2048,
    "max_window_layers": 28,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "rope_theta": 10000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 4096,
}
_QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
_QWEN3_MOE_TINY = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 1,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 768,
    "max_position_embeddings": 2048,
    "max_window_layers": 28,
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 4096,
    "num_experts": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "router_aux_loss_coef": 0.01,
}
# DeepSeek-V3-like MLA + MoE + shared expert + one dense layer + MTP, shrunk. Odd sizes
# on purpose: vocab 4000 (lm_head padded to 4096), q_lora_rank 192 and kv_a output
# 128+32 = 160 (padded to 256), so padding paths are exercised.
_DEEPSEEK_V3_TINY = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 3,
    "q_lora_rank": 192,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 4000,
}
# DeepSeek-V3.2, shrunk: the DeepSeek-V3 body above with the DSA lightning indexer on
# every layer (index_topk present: vLLM builds its sparse MLA path). index_topk is
# above any CPU test's sequence, so the selection keeps every token.
_DEEPSEEK_V32_TINY = {
    **_DEEPSEEK_V3_TINY,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 256,
    "index_n_heads": 4,
    "index_head_dim": 64,
}
# GLM-5 (glm_moe_dsa), shrunk: the DeepSeek-V3 body above without its MTP layer, with
# other MLA widths, sigmoid MoE over one group, interleaved rope in
# attention and indexer, and a DSA schedule with a "shared" layer that reuses the
# previous layer's selection and stores no indexer (indexer_types, as ExLlamaV3 reads
# it, and index_topk_freq / index_skip_topk_offset, as vLLM derives it, agree).
_GLM5_TINY = {
    **{
        k: v
        for k, v in _DEEPSEEK_V3_TINY.items()
        if k not in ("moe_layer_freq", "num_nextn_predict_layers")
    },
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "q_lora_rank": 128,
    "v_head_dim": 96,
    "n_group": 1,
    "rms_norm_eps": 1e-05,
    "vocab_size": 4096,
    "index_topk": 256,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "indexer_types": ["full", "full", "shared"],
    "index_topk_freq": 2,
    "index_skip_topk_offset": 2,
    "rope_interleave": True,
    "indexer_rope_interleave": True,
}
# GLM-4.5/4.6 MoE, shrunk: q/k/v bias without o bias, q/k norms, one dense layer first,
# sigmoid routing with the correction bias over 2 groups, a shared expert.
_GLM4_MOE_TINY = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 1,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "use_qk_norm": True,
    "vocab_size": 4096,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "first_k_dense_replace": 1,
    "n_group": 2,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}
# Mixtral, shrunk: experts under block_sparse_moe as w1/w2/w3, expert width
# intermediate_size.
_MIXTRAL_TINY = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 256,
    "max_position_embeddings": 2048,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 4096,
    "router_aux_loss_coef": 0.02,
    "output_router_logits": False,
}
# Qwen3-Next, shrunk: Gated DeltaNet in layer 0, gated attention in layer 1 (interval
# 2), every layer MoE with a sigmoid-gated shared expert.
_QWEN3_NEXT_TINY = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "max_position_embeddings": 2048,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "full_attention_interval": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 4096,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
# Qwen3-30B-A3B's published config (the e2e throughput run's MoE dims).
_QWEN3_30B_A3B = {
    **_QWEN3_MOE_TINY,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "pad_token_id": None,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "num_attention_heads": 32,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rope_theta": 1000000.0,
    "vocab_size": 151936,
    "num_experts": 128,
    "num_local_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
}
PRESETS: dict[str, dict] = {
    "qwen3-tiny": _QWEN3_TINY,
    "qwen3-8b": _QWEN3_8B,
    "qwen3-moe-tiny": _QWEN3_MOE_TINY,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "deepseek-v3-tiny": _DEEPSEEK_V3_TINY,
    "deepseek-v32-tiny": _DEEPSEEK_V32_TINY,
    "glm5-tiny": _GLM5_TINY,
    "glm4-moe-tiny": _GLM4_MOE_TINY,
    "mixtral-tiny": _MIXTRAL_TINY,
    "qwen3-next-tiny": _QWEN3_NEXT_TINY,
}

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
_TORCH_DTYPE_NAMES = {
    torch.int16: "torch.int16",
    torch.int32: "torch.int32",
    torch.float16: "torch.float16",
    torch.bfloat16: "torch.bfloat16",
    torch.float32: "torch.float32",
}


def load_config(config: str | os.PathLike | Mapping) -> dict:
    """A preset name, a config.json path (or its directory), or a dict."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if str(config) in PRESETS:
        return copy.deepcopy(PRESETS[str(config)])
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    with open(path) as f:
        return json.load(f)


def _codebook(value: str | int | fmt.Codebook) -> fmt.Codebook:
    if isinstance(value, str):
        if value not in CODEBOOK_NAMES:
            raise ValueError(
                f"unknown codebook {value!r} (choose {', '.join(CODEBOOK_NAMES)})"
            )
        return CODEBOOK_NAMES[value]
    return fmt.Codebook(value)


def _check_rate(name: str, bits: float, codebook: fmt.Codebook) -> float:
    if bits == int(bits):
        bits = int(bits)
    if bits not in fmt.VALID_BITS:
        raise ValueError(f"{name}: {bits} bits is not an EXL3 rate ({fmt.VALID_BITS})")
    if bits in fmt.HALF_BITS and codebook != fmt.Codebook.MUL1:
        raise ValueError(f"{name}: half rate {bits} needs the mul1 codebook")
    return bits


def _pick(name: str, overrides: Mapping[str, object] | None, default):
    """The first fnmatch pattern (in insertion order) matching the module name wins."""
    for pattern, value in (overrides or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            return value
    return default


class _ShardWriter:
    """Fills shards module by module (a module is never split), like the converter."""

    def __init__(self, out_dir: Path, cap_bytes: int) -> None:
        self.out_dir, self.cap = out_dir, cap_bytes
        self.shards: list[list[str]] = []
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.total = 0
        self.tmp_names: list[str] = []

    def add_module(self, tensors: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if self.current and self.current_bytes + size > self.cap:
            self._flush()
        self.current.update(tensors)
        self.current_bytes += size
        self.total += size

    def _flush(self) -> None:
        # Written to a temporary name now (bounded memory); renamed once the count is
        # known.
        name = f".shard-{len(self.tmp_names):05}.safetensors"
        save_file(self.current, str(self.out_dir / name))
        self.tmp_names.append(name)
        self.shards.append(list(self.current))
        self.current, self.current_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        if self.current or not self.tmp_names:
            self._flush()
        count = len(self.tmp_names)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(zip(self.tmp_names, self.shards)):
            final = (
                "model.safetensors"
                if count == 1
                else f"model-{i + 1:05}-of-{count:05}.safetensors"
            )
            os.replace(self.out_dir / tmp, self.out_dir / final)
            weight_map.update({n: final for n in names})
        if count > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
            with open(self.out_dir / fmt.SAFETENSORS_INDEX, "w") as f:
                json.dump(index, f, indent=2)
        return weight_map


def _signed_uniform(
    gen: torch.Generator, size: int, lo: float, hi: float
) -> torch.Tensor:
    mag = lo + (hi - lo) * torch.rand(size, generator=gen, dtype=torch.float64)
    sign = torch.where(torch.rand(size, generator=gen) < 0.5, -1.0, 1.0).double()
    return mag * sign


def _exl3_tensors(
    slot: LinearSlot,
    bits: float,
    codebook: fmt.Codebook,
    legacy: bool,
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    k_pad, n_pad = slot.padded
    width = int(bits * fmt.WORDS_PER_BIT)
    # Drawn as int16 directly: an int32 draw and a conversion take 8x as long, most of
    # the writer's time at real dims (Qwen3-30B-A3B's 48 layers).
    trellis = torch.randint(
        -(1 << 15),
        1 << 15,
        (k_pad // fmt.TILE, n_pad // fmt.TILE, width),
        generator=gen,
        dtype=torch.int16,
    )
    out: dict[str, torch.Tensor] = {}
    if legacy:
        out[f"{slot.name}.su"] = torch.randint(
            -(1 << 15), 1 << 15, (k_pad // fmt.TILE,), generator=gen, dtype=torch.int32
        ).to(torch.int16)
        out[f"{slot.name}.sv"] = torch.randint(
            -(1 << 15), 1 << 15, (n_pad // fmt.TILE,), generator=gen, dtype=torch.int32
        ).to(torch.int16)
    else:
        out[f"{slot.name}.suh"] = _signed_uniform(gen, k_pad, *SUH_RANGE).half()
        svh = _signed_uniform(gen, n_pad, *SVH_RANGE) / CODEBOOK_RMS[codebook]
        svh[slot.out_features :] = (
            0.0  # padded output columns come out exactly 0 (§1.7)
        )
        out[f"{slot.name}.svh"] = svh.half()
    if codebook in MARKERS:
        suffix, value = MARKERS[codebook]
        out[f"{slot.name}.{suffix}"] = torch.tensor(value, dtype=torch.int32)
    out[f"{slot.name}.trellis"] = trellis
    if slot.has_bias:
        bias = 0.02 * torch.randn(n_pad, generator=gen, dtype=torch.float64)
        bias[slot.out_features :] = 0.0
        out[f"{slot.name}.bias"] = bias.half()
    return out


def quantized_embedding_tensors(
    prefix: str, vocab: int, hidden: int, bits: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """`prefix.trellis` and `prefix.signs` of a quantized token embedding (§8)."""
    if bits not in fmt.EMBED_BITS:
        raise ValueError(f"{prefix}: embed_bits {bits} is not one of {fmt.EMBED_BITS}")
    groups = -(-hidden // fmt.EMBED_GROUP)
    words = fmt.EMBED_SCALE_WORDS + fmt.EMBED_STREAM_WORDS_PER_BIT * bits
    trellis = torch.randint(
        -(1 << 15), 1 << 15, (vocab, groups, words), generator=gen, dtype=torch.int16
    )
    lo, hi = EMBED_SCALE_RANGE
    scales = lo + (hi - lo) * torch.rand((vocab, groups), generator=gen)
    trellis[:, :, 0] = scales.half().view(torch.int16)
    signs = torch.randint(0, 2, (groups, fmt.EMBED_GROUP), generator=gen) * 2 - 1
    return {
        f"{prefix}.trellis": trellis.view(vocab, groups * words),
        f"{prefix}.{fmt.EMBED_SIGNS_SUFFIX}": signs.half(),
    }


def _plain_tensor(
    kind: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    if kind == "norm":
        return (1.0 + 0.05 * torch.randn(shape, generator=gen)).to(dtype)
    if kind == "router_bias":
        return 0.01 * torch.randn(shape, generator=gen, dtype=torch.float32)
    return (0.02 * torch.randn(shape, generator=gen)).to(dtype)


def _storage_entry(tensors: dict[str, torch.Tensor]) -> dict:
    return {
        name: {
            "shape": list(t.shape),
            "n_bytes": t.numel() * t.element_size(),
            "dtype": _TORCH_DTYPE_NAMES[t.dtype],
        }
        for name, t in tensors.items()
    }


def write_checkpoint(
    config: str | os.PathLike | Mapping,
    out_dir: str | os.PathLike,
    *,
    bits: float = 4,
    codebook: str | int = "mul1",
    head_bits: float = DEFAULT_HEAD_BITS,
    embed_bits: int = UNQUANTIZED_EMBED_BITS,
    mtp_bits: float | None = None,
    bits_overrides: Mapping[str, float] | None = None,
    codebook_overrides: Mapping[str, str | int] | None = None,
    layers: int | None = None,
    mtp: bool | None = None,
    legacy_signs: bool = False,
    shard_size_bytes: int = DEFAULT_SHARD_MIB << 20,
    copy_from: str | os.PathLike | None = None,
    seed: int = 0,
    progress: bool = False,
) -> dict[str, tuple[float, fmt.Codebook]]:
    """Write the checkpoint; returns {module: (bits, codebook)} of every EXL3 linear
    written.

    bits_overrides / codebook_overrides map fnmatch patterns of module names to a rate /
    codebook (first match wins), e.g. {"*.mlp.down_proj": 6, "*.experts.*": 2.5}.
    `layers` overrides num_hidden_layers; `mtp=False` drops the MTP layers (either
    layout), True requires some. `embed_bits` 1..8 quantizes the token embedding (16:
    stored as is).
    """
    cfg = load_config(config)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        for key in ("layer_types", "indexer_types", "mlp_layer_types"):
            if isinstance(cfg.get(key), list):
                cfg[key] = (cfg[key] * layers)[:layers]
        if cfg.get("mlp_only_layers"):
            cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < layers]
    if mtp is False:
        for key in MTP_LAYER_KEYS:
            cfg.pop(key, None)
    elif mtp and not mtp_layer_count(cfg):
        raise ValueError(f"mtp=True but the config has no {' / '.join(MTP_LAYER_KEYS)}")
    default_cb = _codebook(codebook)
    rates = {
        "bits": bits,
        "head_bits": head_bits,
        "mtp_bits": bits if mtp_bits is None else mtp_bits,
    }
    plan: ModelPlan = plan_model(cfg)
    dtype = _DTYPES.get(
        cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16", torch.bfloat16
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    writer = _ShardWriter(out, shard_size_bytes)
    storage: dict[str, dict] = {}
    written: dict[str, tuple[float, fmt.Codebook]] = {}
    plain_by_module: dict[str, list] = {}
    for p in plan.plain:
        plain_by_module.setdefault(p.module, []).append(p)
    linears = {s.name: s for s in plan.linears}
    budget_bits = budget_weights = 0.0
    for i, module in enumerate(plan.modules):
        tensors: dict[str, torch.Tensor] = {}
        entry: dict = {}
        slot = linears.get(module)
        if (
            slot is not None
            and slot.quantized
            and not (
                slot.bits_key == "head_bits"
                and rates["head_bits"] == UNQUANTIZED_HEAD_BITS
            )
        ):
            cb = _codebook(_pick(module, codebook_overrides, default_cb))
            k_bits = _check_rate(
                module, float(_pick(module, bits_overrides, rates[slot.bits_key])), cb
            )
            tensors = _exl3_tensors(slot, k_bits, cb, legacy_signs, gen)
            written[module] = (k_bits, cb)
            k_pad, n_pad = slot.padded
            # ExLlamaV3's `bits` is the main budget's average: the head and the MTP
            # layers are targets outside it (allocation.py's aux targets).
            if slot.bits_key == "bits":
                budget_bits += k_bits * k_pad * n_pad
                budget_weights += k_pad * n_pad
            entry = {"quant_format": "exl3", "bits_per_weight": k_bits}
            if cb in MULTIPLIER_KEYS:
                key, value = MULTIPLIER_KEYS[cb]
                entry[key] = value & 0xFFFFFFFF
        elif slot is not None:
            # Unquantized linear: fp16 in HF orientation (out, in). The lm_head at
            # head_bits 16 keeps the padded shape like every pad_to=128 Linear; routers
            # etc. use pad_to=1.
            n, k = slot.out_features, slot.in_features
            if slot.bits_key == "head_bits":
                n, k = round_up(n), round_up(k)
            w = 0.02 * torch.randn((n, k), generator=gen)
            if slot.bits_key == "head_bits":
                w[slot.out_features :] = 0.0
            tensors[f"{module}.weight"] = w.half()
        for p in plain_by_module.get(module, []):
            if p.kind == "embed" and embed_bits != UNQUANTIZED_EMBED_BITS:
                tensors.update(
                    quantized_embedding_tensors(module, *p.shape, embed_bits, gen)
                )
            else:
                tensors[p.name] = _plain_tensor(p.kind, p.shape, dtype, gen)
        writer.add_module(tensors)
        storage[module] = {"stored_tensors": _storage_entry(tensors), **entry}
        if progress:
            print(f"[{i + 1}/{len(plan.modules)}] {module}", file=sys.stderr)
    writer.finish()

    qcfg = {
        "quant_method": "exl3",
        "version": EXLLAMAV3_VERSION,
        "bits": round(budget_bits / budget_weights, 2)
        if budget_weights
        else float(bits),
        "head_bits": head_bits,
        "calibration": dict(CALIBRATION),
        "out_scales": "auto",
        "codebook": next(n for n, c in CODEBOOK_NAMES.items() if c == default_cb),
    }
    if mtp_layer_count(cfg):
        qcfg["mtp_bits"] = rates["mtp_bits"]
    if "tie_word_embeddings" in cfg:
        cfg["tie_word_embeddings"] = (
            False  # the converter always writes a separate lm_head
        )
    cfg["quantization_config"] = qcfg
    with open(out / "config.json", "w") as f:
        json.dump(cfg, f, indent=4)
    with open(out / "quantization_config.json", "w") as f:
        json.dump({**qcfg, "tensor_storage": storage}, f, indent=4)
    if copy_from is not None:
        for src in Path(copy_from).iterdir():
            if (
                src.is_file()
                and src.suffix in COPIED_SUFFIXES
                and src.name not in NOT_COPIED
            ):
                shutil.copy2(src, out / src.name)
    return written


def _parse_overrides(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items or []:
        pattern, sep, value = item.rpartition("=")
        if not sep or not pattern:
            raise SystemExit(f"override {item!r}: expected PATTERN=VALUE")
        out[pattern] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--config",
        required=True,
        help=f"config.json (or its directory) or a preset: {', '.join(PRESETS)}",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--bits", type=float, default=4, help="rate of the decoder linears")
    p.add_argument("--codebook", default="mul1", choices=sorted(CODEBOOK_NAMES))
    p.add_argument(
        "--head-bits",
        type=float,
        default=DEFAULT_HEAD_BITS,
        help="lm_head rate (16 = unquantized fp16)",
    )
    p.add_argument(
        "--embed-bits",
        type=int,
        default=UNQUANTIZED_EMBED_BITS,
        help="token embedding rate 1-8 (16 = unquantized, the default)",
    )
    p.add_argument(
        "--mtp-bits", type=float, default=None, help="MTP layer rate (default --bits)"
    )
    p.add_argument("--no-mtp", action="store_true", help="drop the config's MTP layers")
    p.add_argument(
        "--layers", type=int, default=None, help="override num_hidden_layers"
    )
    p.add_argument(
        "--bits-override",
        action="append",
        metavar="PATTERN=BITS",
        help="per-module rate by fnmatch pattern, e.g. '*.down_proj=6' (repeatable)",
    )
    p.add_argument("--codebook-override", action="append", metavar="PATTERN=CODEBOOK")
    p.add_argument("--legacy-signs", action="store_true", help="write su/sv bitfields")
    p.add_argument(
        "--shard-size", type=int, default=DEFAULT_SHARD_MIB, help="shard cap in MiB"
    )
    p.add_argument(
        "--copy-from", default=None, help="copy tokenizer etc. files from this dir"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    written = write_checkpoint(
        args.config,
        args.out,
        bits=args.bits,
        codebook=args.codebook,
        head_bits=args.head_bits,
        embed_bits=args.embed_bits,
        mtp_bits=args.mtp_bits,
        layers=args.layers,
        mtp=False if args.no_mtp else None,
        bits_overrides={
            k: float(v) for k, v in _parse_overrides(args.bits_override).items()
        },
        codebook_overrides=_parse_overrides(args.codebook_override),
        legacy_signs=args.legacy_signs,
        shard_size_bytes=args.shard_size << 20,
        copy_from=args.copy_from,
        seed=args.seed,
        progress=True,
    )
    print(f"wrote {len(written)} EXL3 linears to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
