# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Architectures refused while vLLM builds the config (unsupported_models.py), and,
through vLLM's real DeepSeek V4 attention classes on CPU, the facts the refusal states.

The checkpoint is a tiny DeepSeek V4 in ExLlamaV3 1.6.5's layout (architecture/
deepseek_v4.py, modules/dsv4.py): DeepSeek's own tensor names (`layers.N.attn.wq_a`,
`layers.N.ffn.experts.E.w1`, `head`), one sliding, one CSA and one HCA layer. EXL3:
wq_a, wq_b, wkv, wo_a as o_groups slices (`attn.wo_a.slice.G`), wo_b, the compressors'
wkv / wgate (HCA, CSA, and the CSA indexer's own), indexer.wq_b, routed and shared
experts, head. fp16: indexer.weights_proj, the router. Norms, mHC and the other plain
tensors are left out: nothing here reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from vllm.model_executor.layers.quantization.exl3.config import Exl3Config
from vllm.model_executor.layers.quantization.exl3.unsupported_models import (
    UNSUPPORTED_ARCHITECTURES,
    refuse_unsupported_architecture,
)
from vllm_exl3.testing import synthetic_checkpoint as synth

from .exl3_harness import config_from_tensors

HIDDEN, HEADS, HEAD_DIM, ROPE_DIM = 256, 4, 128, 64
Q_LORA, O_LORA, O_GROUPS = 128, 128, 2
INDEX_HEADS, INDEX_HEAD_DIM = 2, 128
EXPERTS, TOP_K, MOE_INTERMEDIATE, VOCAB = 4, 2, 128, 512
# compress_ratios: 0 = sliding window only, 4 = CSA (overlapping compressor + indexer),
# 128 = HCA (plain compressor).
CSA_RATIO, HCA_RATIO = 4, 128
RATIOS = [0, CSA_RATIO, HCA_RATIO]
CSA_LAYER = RATIOS.index(CSA_RATIO)
BITS, CODEBOOK = 4, "mcg"

V4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": HIDDEN,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 1,
    "head_dim": HEAD_DIM,
    "qk_rope_head_dim": ROPE_DIM,
    "q_lora_rank": Q_LORA,
    "o_lora_rank": O_LORA,
    "o_groups": O_GROUPS,
    "sliding_window": 128,
    "compress_ratios": RATIOS,
    "num_hidden_layers": len(RATIOS),
    "index_n_heads": INDEX_HEADS,
    "index_head_dim": INDEX_HEAD_DIM,
    "index_topk": 16,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 3,
    "hc_eps": 1e-6,
    "n_routed_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "moe_intermediate_size": MOE_INTERMEDIATE,
    "n_shared_experts": 1,
    "num_hash_layers": 1,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "norm_topk_prob": True,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def v4_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny V4 checkpoint's tensors, named and shaped as ExLlamaV3 writes them."""
    gen = torch.Generator().manual_seed(seed)
    codebook = synth.CODEBOOK_NAMES[CODEBOOK]
    named: dict[str, torch.Tensor] = {}

    def exl3(name: str, k: int, n: int) -> None:
        slot = synth.LinearSlot(name, k, n, "replicated", name)
        named.update(synth._exl3_tensors(slot, BITS, codebook, False, gen))

    def fp16(name: str, k: int, n: int) -> None:
        named[f"{name}.weight"] = (0.02 * torch.randn((n, k), generator=gen)).half()

    for layer, ratio in enumerate(RATIOS):
        attn, ffn = f"layers.{layer}.attn", f"layers.{layer}.ffn"
        exl3(f"{attn}.wq_a", HIDDEN, Q_LORA)
        exl3(f"{attn}.wq_b", Q_LORA, HEADS * HEAD_DIM)
        exl3(f"{attn}.wkv", HIDDEN, HEAD_DIM)
        for group in range(O_GROUPS):
            exl3(f"{attn}.wo_a.slice.{group}", HEADS * HEAD_DIM // O_GROUPS, O_LORA)
        exl3(f"{attn}.wo_b", O_GROUPS * O_LORA, HIDDEN)
        if ratio:
            # CSA's compressor projects to two overlapping windows, HCA's to one.
            width = 2 * HEAD_DIM if ratio == CSA_RATIO else HEAD_DIM
            exl3(f"{attn}.compressor.wkv", HIDDEN, width)
            exl3(f"{attn}.compressor.wgate", HIDDEN, width)
        if ratio == CSA_RATIO:
            exl3(f"{attn}.indexer.compressor.wkv", HIDDEN, 2 * INDEX_HEAD_DIM)
            exl3(f"{attn}.indexer.compressor.wgate", HIDDEN, 2 * INDEX_HEAD_DIM)
            exl3(f"{attn}.indexer.wq_b", Q_LORA, INDEX_HEADS * INDEX_HEAD_DIM)
            fp16(f"{attn}.indexer.weights_proj", HIDDEN, INDEX_HEADS)
        fp16(f"{ffn}.gate", HIDDEN, EXPERTS)
        for expert in range(EXPERTS):
            exl3(f"{ffn}.experts.{expert}.w1", HIDDEN, MOE_INTERMEDIATE)
            exl3(f"{ffn}.experts.{expert}.w3", HIDDEN, MOE_INTERMEDIATE)
            exl3(f"{ffn}.experts.{expert}.w2", MOE_INTERMEDIATE, HIDDEN)
        exl3(f"{ffn}.shared_experts.w1", HIDDEN, MOE_INTERMEDIATE)
        exl3(f"{ffn}.shared_experts.w3", HIDDEN, MOE_INTERMEDIATE)
        exl3(f"{ffn}.shared_experts.w2", MOE_INTERMEDIATE, HIDDEN)
    named["embed.weight"] = (0.02 * torch.randn((VOCAB, HIDDEN), generator=gen)).to(
        torch.bfloat16
    )
    exl3("head", HIDDEN, VOCAB)
    return named


def write_v4_checkpoint(out_dir: Path) -> Path:
    out_dir.mkdir(parents=True)
    save_file(
        v4_tensors(), str(out_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    config = dict(V4_CONFIG)
    config["quantization_config"] = {
        "quant_method": "exl3",
        "version": synth.EXLLAMAV3_VERSION,
        "bits": float(BITS),
        "head_bits": BITS,
        "codebook": CODEBOOK,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=4))
    return out_dir


def v4_hf_config(**overrides):
    from vllm.transformers_utils.configs.deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(**{**V4_CONFIG, **overrides})


def _assert_names_v4_and_why(message: str) -> None:
    assert "architecture DeepseekV4ForCausalLM is not supported" in message
    for fact in ("wo_a.weight_scale_inv", "fused_wkv_wgate", "swiglu_limit"):
        assert fact in message, fact


def test_vllm_refuses_a_deepseek_v4_exl3_checkpoint(tmp_path):
    """ModelConfig picks "exl3" from config.json; building the VllmConfig fails with
    the refusal, not with the validator's or the loader's view of the tensors."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    ckpt = write_v4_checkpoint(tmp_path / "v4")
    model_config = ModelConfig(model=str(ckpt), dtype="bfloat16")
    assert model_config.quantization == "exl3"
    assert model_config.architectures == ["DeepseekV4ForCausalLM"]
    with pytest.raises(NotImplementedError) as info:
        VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"))
    _assert_names_v4_and_why(str(info.value))
    assert str(ckpt) in str(info.value)


def test_refused_before_the_checkpoint_is_read():
    """A hub id (nothing local, no network here): the refusal comes from the config
    alone, before any header or tensor_storage is fetched."""
    config = Exl3Config({"quant_method": "exl3"})
    with pytest.raises(NotImplementedError) as info:
        config.maybe_update_config("example/DeepSeek-V4-exl3", hf_config=v4_hf_config())
    _assert_names_v4_and_why(str(info.value))
    assert config.modules is None


@pytest.mark.parametrize(
    "overrides",
    [
        # What SpeculativeConfig makes of a V4 target's config for its MTP draft.
        {"architectures": ["DeepSeekV4MTPModel"], "model_type": "deepseek_mtp"},
        {"architectures": ["DSparkDeepseekV4ForCausalLM"]},
        # A V4 config without an architectures list.
        {"architectures": None},
    ],
    ids=["mtp-draft", "dspark-draft", "model-type-only"],
)
def test_v4_drafts_and_bare_configs_are_refused(overrides):
    hf_config = v4_hf_config(**overrides)
    if "model_type" in overrides:
        hf_config.model_type = overrides["model_type"]
    with pytest.raises(NotImplementedError, match="is not supported"):
        refuse_unsupported_architecture(hf_config, "ckpt")


def test_other_architectures_pass():
    from transformers import PretrainedConfig

    v3 = PretrainedConfig(architectures=["DeepseekV3ForCausalLM"])
    v3.model_type = "deepseek_v3"
    assert refuse_unsupported_architecture(v3, "ckpt") is None
    assert refuse_unsupported_architecture(None, "ckpt") is None
    assert "DeepseekV4ForCausalLM" in UNSUPPORTED_ARCHITECTURES


# Why: vLLM 0.26's V4 attention layer built on CPU with the EXL3 config, as the loader
# would hand it over. If a later vLLM routes these projections through the quant
# method, these tests fail, and the refusal is to be revisited.


@pytest.fixture
def v4_csa_attention(world1, tmp_path, monkeypatch):
    """(layer, prefixes the EXL3 config was asked about, the config) for the CSA
    layer: vLLM's FlashMLA V4 attention (the CUDA default off SM 12.x) with its indexer
    and both compressors, built under the EXL3 config of the V4 checkpoint, configured
    as vLLM's loader configures it for DeepseekV4ForCausalLM."""
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM
    from vllm.models.deepseek_v4.nvidia import flashmla
    from vllm.platforms import current_platform

    # Constructor-only CUDA handles (aux-stream events, the DeepGEMM einsum recipe read
    # from the device capability) and the device type of the top-k buffer.
    monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kwargs: None)
    monkeypatch.setattr(
        flashmla, "compute_fp8_einsum_recipe", lambda: ((1, 1, 1), False)
    )
    if not current_platform.device_type:
        monkeypatch.setattr(current_platform, "device_type", "cpu")

    ckpt = write_v4_checkpoint(tmp_path / "v4")
    vllm_config = VllmConfig(device_config=DeviceConfig("cpu"))
    model_config = ModelConfig(model=str(ckpt), dtype="bfloat16")
    object.__setattr__(vllm_config, "model_config", model_config)
    # V4's FlashMLA layout stores the KV cache as fp8_ds_mla only.
    vllm_config.cache_config.cache_dtype = "fp8"
    quant_config = config_from_tensors(v4_tensors())
    configure_quant_config(quant_config, DeepseekV4ForCausalLM)
    vllm_config.quant_config = quant_config

    asked: list[str] = []
    get_quant_method = Exl3Config.get_quant_method

    def recording(self, layer, prefix):
        asked.append(prefix)
        return get_quant_method(self, layer, prefix)

    monkeypatch.setattr(Exl3Config, "get_quant_method", recording)
    with set_current_vllm_config(vllm_config):
        layer = flashmla.DeepseekV4FlashMLAAttention(
            vllm_config,
            prefix=f"model.layers.{CSA_LAYER}.attn",
            topk_indices_buffer=torch.empty(16, V4_CONFIG["index_topk"]),
        )
    return layer, asked, quant_config


def test_v4_compressors_never_ask_the_quant_config(v4_csa_attention):
    """ExLlamaV3 quantizes compressor.wkv / wgate; vLLM builds the compressors'
    fused_wkv_wgate without a quant config, a dense weight its attention multiplies
    directly."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer, asked, quant_config = v4_csa_attention
    prefix = f"model.layers.{CSA_LAYER}.attn"
    for stored in ("compressor", "indexer.compressor"):
        for projection in ("wkv", "wgate"):
            assert (
                f"layers.{CSA_LAYER}.attn.{stored}.{projection}" in quant_config.modules
            )
    for compressor in (layer.compressor, layer.indexer.compressor):
        fused = compressor.fused_wkv_wgate
        assert type(fused.quant_method) is UnquantizedLinearMethod
        assert isinstance(fused.weight, torch.nn.Parameter)
    assert not [p for p in asked if ".compressor." in p]
    # The layers that do ask get the EXL3 method: only the compressors are hardwired.
    assert f"{prefix}.wq_b" in asked and f"{prefix}.indexer.wq_b" in asked


def test_v4_output_projection_reads_an_fp8_wo_a(v4_csa_attention, monkeypatch):
    """The checkpoint has no `wo_a` module (ExLlamaV3 writes o_groups slices), and the
    FlashMLA layer's output projection takes wo_a.weight with its FP8 block scales from
    the module, never through the layer's method."""
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod
    from vllm.models.deepseek_v4.nvidia.ops import o_proj

    layer, _, quant_config = v4_csa_attention
    slices = [f"layers.{CSA_LAYER}.attn.wo_a.slice.{g}" for g in range(O_GROUPS)]
    assert all(name in quant_config.modules for name in slices)
    assert not isinstance(layer.wo_a.quant_method, Exl3LinearMethod)
    assert not hasattr(layer.wo_a, "weight_scale_inv")
    tokens = 3
    o = torch.zeros(tokens, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    # Stand-in for the CUDA inverse-RoPE + FP8 activation quantization before it.
    monkeypatch.setattr(
        o_proj, "fused_inv_rope_fp8_quant", lambda o, *args, **kwargs: (o, None)
    )
    with pytest.raises(AttributeError, match="weight_scale_inv"):
        layer._o_proj(o, torch.arange(tokens))
