# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Architectures that ExLlamaV3 converts but vLLM 0.26 cannot run with a foreign
quantization method: refused while the config is built, before any layer exists.

Refusing early is the point. Left alone, such a checkpoint does not fail at one clear
place: some of its layers take the EXL3 method, others are built by the model without
any quantization config and then meet EXL3 tensors they have no parameter for (a bare
`KeyError` from the model's `load_weights`), and a layer the model hands to a hardwired
kernel would fail (or compute garbage) only on the GPU.
"""

from typing import Any

# DeepSeek V4, as vLLM 0.26 builds it (vllm/models/deepseek_v4), against what
# ExLlamaV3 1.6.5 writes for it (architecture/deepseek_v4.py, modules/dsv4.py).
_DEEPSEEK_V4_REASON = (
    "vLLM 0.26's DeepSeek V4 model reads several of its projections directly "
    "instead of through the layer's quantization method, and ExLlamaV3 stores "
    "exactly those as EXL3 trellises: (1) every CUDA attention backend (FlashMLA, "
    "FlashInfer, FlashInfer SM120) runs the grouped output projection `attn.wo_a` "
    "as DeepGEMM's fp8_einsum on `wo_a.weight` and `wo_a.weight_scale_inv`, an FP8 "
    "block-quantized weight by attribute, while ExLlamaV3 writes wo_a as o_groups "
    "separate EXL3 linears `attn.wo_a.slice.<g>`; (2) the KV compressors "
    "`attn.compressor` and `attn.indexer.compressor` are built without a "
    "quantization config and multiplied as a dense `fused_wkv_wgate.weight`, while "
    "ExLlamaV3 quantizes their wkv and wgate; (3) the routed experts clamp the "
    "SwiGLU input (`swiglu_limit`), which the EXL3 MoE method does not apply. "
    "Running these would take a rewrite of vLLM's V4 attention, compressor and "
    "weight loading, not a quantization method"
)

# Architecture names (config.json `architectures`, or what vLLM rewrites them to for a
# draft model) -> why vLLM cannot run them with EXL3 weights.
UNSUPPORTED_ARCHITECTURES: dict[str, str] = {
    "DeepseekV4ForCausalLM": _DEEPSEEK_V4_REASON,
    # The V4 MTP draft (SpeculativeConfig rewrites the target's config to it) and the
    # DSpark drafter share the target's attention classes.
    "DeepSeekV4MTPModel": _DEEPSEEK_V4_REASON,
    "DSparkDeepseekV4ForCausalLM": _DEEPSEEK_V4_REASON,
}
# model_type -> the architecture name the refusal reports, for a config whose
# `architectures` list is missing or names none of the above.
UNSUPPORTED_MODEL_TYPES: dict[str, str] = {"deepseek_v4": "DeepseekV4ForCausalLM"}


def refuse_unsupported_architecture(hf_config: Any, source: str) -> None:
    """Raise NotImplementedError naming the architecture and why, for a model that
    vLLM 0.26 cannot run with EXL3 weights; return for any other (or no) config."""
    if hf_config is None:
        return
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    refused = next((a for a in architectures if a in UNSUPPORTED_ARCHITECTURES), None)
    if refused is None and model_type in UNSUPPORTED_MODEL_TYPES:
        refused = UNSUPPORTED_MODEL_TYPES[model_type]
    if refused is None:
        return
    raise NotImplementedError(
        f"EXL3 checkpoint {source}: architecture {refused} is not supported. "
        f"{UNSUPPORTED_ARCHITECTURES[refused]}."
    )
