# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Exl3Config and name resolution on real checkpoints: from_config + maybe_update_config
(tensors win over quantization_config.json, modules missing from it recovered from the
safetensors headers), the per-layer method choice, vLLM resolving "exl3" from
config.json with no extra flag; name resolution (exact, model mapper, wrapper segments
dropped, fused expansion), the deprecated CUDA_EXL3_* environment names and the kernel
choice; and the per-rank layout rules (layout.py) at tensor-parallel sizes this machine
cannot run, with the row-split errors naming module, rank, numbers.
"""

from __future__ import annotations

import json
import logging
import pickle

import pytest
import torch
from vllm.model_executor.layers.quantization.exl3 import ops
from vllm.model_executor.layers.quantization.exl3.config import Exl3Config
from vllm.model_executor.layers.quantization.exl3.env_compat import (
    adopt_deprecated_env_names,
)
from vllm.model_executor.layers.quantization.exl3.format import (
    Codebook,
    Exl3FormatError,
    Exl3ModuleSpec,
    round_up,
)
from vllm.model_executor.layers.quantization.exl3.kernels import (
    Exl3KernelConfig,
    ReferenceExl3Kernel,
    choose_exl3_linear_kernel,
)
from vllm.model_executor.layers.quantization.exl3.layout import (
    Exl3LayoutError,
    Split,
    plan_linear,
    plan_lm_head,
)
from vllm.model_executor.layers.quantization.exl3.names import (
    ModuleNameResolver,
    shard_names,
    strip_wrappers,
)
from vllm.model_executor.models.utils import WeightsMapper

from .exl3_harness import (
    CKPT_3INST,
    CKPT_MCG,
    checkpoint_copy,
    config_for,
    config_from_tensors,
    tensors,
)

CONFIG_LOGGER = "vllm.model_executor.layers.quantization.exl3.config"
NAMES_LOGGER = "vllm.model_executor.layers.quantization.exl3.names"
LAYERS, LINEARS_PER_LAYER = 4, 7


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def config_log():
    handler, logger = _Records(), logging.getLogger(CONFIG_LOGGER)
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


@pytest.mark.parametrize(
    "ckpt,bits,codebook",
    [(CKPT_3INST, 4, Codebook.THREE_INST), (CKPT_MCG, 3, Codebook.MCG)],
)
def test_fixture_is_described_from_its_tensors(ckpt, bits, codebook, config_log):
    config = config_for(ckpt)
    assert config.get_name() == "exl3"
    assert len(config.modules) == LAYERS * LINEARS_PER_LAYER + 1
    assert config.embeddings == {}
    for key, spec in config.modules.items():
        assert spec.codebook == codebook, key
        assert spec.bits == (6 if key == "lm_head" else bits), key
    head = config.modules["lm_head"]
    assert (head.in_features, head.out_features) == (256, 4096)
    assert not any("recovered" in m or "tensors decide" in m for m in config_log)
    # VllmConfig (and so the quant config) is pickled to the worker processes.
    assert pickle.loads(pickle.dumps(config)).modules == config.modules


def test_tensors_win_over_tensor_storage(tmp_path, config_log):
    storage = json.loads((CKPT_MCG / "quantization_config.json").read_text())
    entries = storage["tensor_storage"]
    k_proj = entries["model.layers.0.self_attn.k_proj"]
    k_proj["bits_per_weight"] = 5
    del k_proj["mcg_multiplier"]
    k_proj["mul1_multiplier"] = 2212286765
    del entries["model.layers.1.mlp.down_proj"]  # like an MTP head the JSON forgot
    entries["model.layers.9.mlp.up_proj"] = dict(entries["model.layers.0.mlp.up_proj"])
    ckpt = checkpoint_copy(CKPT_MCG, tmp_path / "ckpt", storage=storage)
    config = config_for(ckpt)
    spec = config.modules["model.layers.0.self_attn.k_proj"]
    assert (spec.bits, spec.codebook) == (3, Codebook.MCG)
    assert "model.layers.1.mlp.down_proj" in config.modules
    assert "model.layers.9.mlp.up_proj" not in config.modules
    text = "\n".join(config_log)
    assert (
        "model.layers.0.self_attn.k_proj: quantization_config.json says 5 bits, "
        "codebook "
        "mul1; its tensors say 3 bits, codebook mcg; the tensors decide"
    ) in text
    assert (
        "model.layers.1.mlp.down_proj: EXL3 in the tensors but missing from "
        "quantization_config.json's tensor_storage (1 modules"
    ) in text
    assert (
        "model.layers.9.mlp.up_proj: quantization_config.json lists it as EXL3" in text
    )


def test_headers_alone_describe_the_checkpoint(tmp_path):
    ckpt = checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", storage=False)
    assert config_for(ckpt).modules == config_for(CKPT_3INST).modules


def test_tensor_storage_alone_when_headers_are_unreadable(tmp_path, config_log):
    ckpt = checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", weights=False)
    assert config_for(ckpt).modules == config_for(CKPT_3INST).modules
    assert any("safetensors headers not readable" in m for m in config_log)


def test_block_from_quantization_config_json_carries_tensor_storage(tmp_path):
    """get_config_filenames path (config.json without a block): from_config receives
    quantization_config.json itself, tensor_storage included."""
    document = json.loads((CKPT_3INST / "quantization_config.json").read_text())
    config = Exl3Config.from_config(document)
    assert config.tensor_storage is not None
    config.maybe_update_config(str(CKPT_3INST))
    assert len(config.modules) == LAYERS * LINEARS_PER_LAYER + 1


def test_nothing_readable_is_an_error(tmp_path):
    ckpt = checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", weights=False, storage=False)
    with pytest.raises(ValueError, match="neither the safetensors headers nor"):
        config_for(ckpt)


def test_contract():
    config = Exl3Config({"quant_method": "exl3"})
    assert config.get_supported_act_dtypes() == [torch.bfloat16, torch.float16]
    assert Exl3Config.get_min_capability() == 80
    assert Exl3Config.get_config_filenames() == ["quantization_config.json"]
    assert config.packed_modules_mapping == {}
    with pytest.raises(ValueError, match="before maybe_update_config"):
        config.get_quant_method(torch.nn.Identity(), "x")


def test_non_linear_layers_get_no_method():
    assert (
        config_for(CKPT_MCG).get_quant_method(
            torch.nn.Identity(), "model.layers.0.attn"
        )
        is None
    )


def _expert_tensors() -> dict[str, torch.Tensor]:
    src = tensors(CKPT_MCG)
    return {
        k.replace("mlp.gate_proj", "mlp.experts.3.gate_proj"): v
        for k, v in src.items()
        if k.startswith("model.layers.0.mlp.gate_proj.")
    }


def test_exl3_moe_experts_fail_closed():
    """Routed experts with EXL3 modules get the EXL3 MoE method, which needs every
    expert: a checkpoint with one expert projection names the first missing one; a layer
    without EXL3 experts keeps vLLM's own method (None)."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    experts = RoutedExperts.__new__(
        RoutedExperts
    )  # its type and these attributes matter here
    experts.moe_config = SimpleNamespace(
        num_logical_experts=8,
        hidden_dim=256,
        hidden_dim_unpadded=256,
        intermediate_size=768,
    )
    experts.ckpt_gate_proj_name, experts.ckpt_up_proj_name = "gate_proj", "up_proj"
    experts.ckpt_down_proj_name = "down_proj"
    config = config_from_tensors(_expert_tensors())
    with pytest.raises(
        Exl3LayoutError,
        match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj"
        r"\.trellis: missing tensor",
    ):
        config.get_quant_method(experts, "model.layers.0.mlp.experts")
    assert config.get_quant_method(experts, "model.layers.1.mlp.experts") is None


def test_quantized_token_embedding_gets_its_method(world1):
    from vllm.model_executor.layers.quantization.exl3.embedding import (
        Exl3EmbeddingMethod,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        VocabParallelEmbedding,
    )

    named = {
        "model.embed_tokens.trellis": torch.zeros(4096, 2 * 65, dtype=torch.int16),
        "model.embed_tokens.signs": torch.zeros(2, 256, dtype=torch.float16),
    }
    layer = VocabParallelEmbedding(
        4096, 512, quant_config=config_from_tensors(named), prefix="model.embed_tokens"
    )
    assert isinstance(layer.quant_method, Exl3EmbeddingMethod)
    # Two groups of 256 are the table of a 257..512-wide model, not of a 256-wide one.
    with pytest.raises(Exl3FormatError, match=r"model\.embed_tokens\.signs: 2 groups"):
        VocabParallelEmbedding(
            4096,
            256,
            quant_config=config_from_tensors(named),
            prefix="model.embed_tokens",
        )


def test_vllm_resolves_exl3_from_config_json(tmp_path):
    """ModelConfig reads config.json's block and picks "exl3" (patch 0001 registers it);
    VllmConfig builds Exl3Config and calls maybe_update_config with the model directory.
    """
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    ckpt = checkpoint_copy(CKPT_MCG, tmp_path / "ckpt", tokenizer=True)
    model_config = ModelConfig(model=str(ckpt), dtype="bfloat16")
    assert model_config.quantization == "exl3"
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    assert isinstance(vllm_config.quant_config, Exl3Config)
    assert len(vllm_config.quant_config.modules) == LAYERS * LINEARS_PER_LAYER + 1


# Name resolution (exact, model mapper, wrapper segments dropped, fused expansion), the
# deprecated CUDA_EXL3_* environment names, and the kernel choice.

CKPT_MODULES = [
    "model.language_model.layers.0.self_attn.q_proj",
    "model.language_model.layers.0.self_attn.k_proj",
    "model.visual.blocks.0.attn.qkv",
    "lm_head",
]


def test_exact_first_then_wrappers_dropped():
    r = ModuleNameResolver(CKPT_MODULES)
    assert r.resolve("lm_head") == "lm_head"
    assert (
        r.resolve("model.visual.blocks.0.attn.qkv") == "model.visual.blocks.0.attn.qkv"
    )
    # vLLM nests the text model as language_model.model.*, the checkpoint as
    # model.language_model.*
    assert (
        r.resolve("language_model.model.layers.0.self_attn.q_proj") == CKPT_MODULES[0]
    )
    assert r.resolve("language_model.model.layers.0.self_attn.v_proj") is None
    assert strip_wrappers("language_model.model.layers.0.mlp") == "layers.0.mlp"


def test_ambiguous_stripped_name_is_not_used():
    r = ModuleNameResolver(["model.layers.0.o_proj", "language_model.layers.0.o_proj"])
    assert r.resolve("model.language_model.layers.0.o_proj") is None
    assert r.resolve("model.layers.0.o_proj") == "model.layers.0.o_proj"


def test_model_mapper_renames_checkpoint_modules():
    r = ModuleNameResolver(["transformer.h.0.attn.q_proj"])
    r.set_mapper(WeightsMapper(orig_to_new_prefix={"transformer.h.": "model.layers."}))
    assert r.resolve("model.layers.0.attn.q_proj") == "transformer.h.0.attn.q_proj"


def test_modules_under_a_prefix():
    r = ModuleNameResolver(
        ["model.layers.0.mlp.experts.7.up_proj", "model.layers.0.mlp.gate"]
    )
    assert r.modules_under("model.layers.0.mlp.experts") == [
        "model.layers.0.mlp.experts.7.up_proj"
    ]
    assert r.modules_under("language_model.model.layers.0.mlp.experts") == [
        "model.layers.0.mlp.experts.7.up_proj"
    ]
    assert r.modules_under("model.layers.1.mlp.experts") == []


def test_fused_names_expand_by_mapping_then_fallback():
    mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert shard_names("m.l.0.qkv_proj", mapping) == [
        "m.l.0.q_proj",
        "m.l.0.k_proj",
        "m.l.0.v_proj",
    ]
    # Not in the model's mapping (as in Qwen3-MoE without mlp_only_layers): built-in
    # table.
    assert shard_names("m.l.0.gate_up_proj", mapping) == [
        "m.l.0.gate_proj",
        "m.l.0.up_proj",
    ]
    assert shard_names("m.l.0.in_proj_qkvz", {}) == [
        "m.l.0.in_proj_qkv",
        "m.l.0.in_proj_z",
    ]
    assert shard_names("m.l.0.o_proj", mapping) == ["m.l.0.o_proj"]


def test_debug_names_logs_hits_and_misses(monkeypatch):
    monkeypatch.setenv("VLLM_EXL3_DEBUG_NAMES", "1")
    messages: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logger = logging.getLogger(NAMES_LOGGER)
    handler = Capture()
    logger.addHandler(handler)
    try:
        r = ModuleNameResolver(CKPT_MODULES)
        r.resolve("language_model.model.layers.0.self_attn.q_proj")
        r.resolve("model.layers.0.mlp.down_proj")
    finally:
        logger.removeHandler(handler)
    assert any("segments dropped" in m and "q_proj" in m for m in messages)
    assert any("down_proj" in m and "no EXL3 checkpoint module" in m for m in messages)


def test_deprecated_env_names():
    env = {
        "CUDA_EXL3_FORCE_REFERENCE": "1",
        "CUDA_EXL3_BM": "64",
        "VLLM_EXL3_BM": "128",
    }
    assert adopt_deprecated_env_names(env) == [
        "VLLM_EXL3_FORCE_REFERENCE",
        "VLLM_EXL3_PLAN",
    ]
    assert env["VLLM_EXL3_FORCE_REFERENCE"] == "1"
    # The new spelling wins, and the old per-knob variable becomes a VLLM_EXL3_PLAN key.
    assert env["VLLM_EXL3_PLAN"] == "bm=128"
    assert "VLLM_EXL3_BM" not in env


def test_config_adopts_deprecated_names_into_vllm_envs(monkeypatch):
    import vllm.envs as envs
    from vllm.model_executor.layers.quantization.exl3.config import Exl3Config

    monkeypatch.delenv("VLLM_EXL3_DEBUG_NAMES", raising=False)
    monkeypatch.setenv("CUDA_EXL3_DEBUG_NAMES", "1")
    Exl3Config({"quant_method": "exl3"})
    assert envs.VLLM_EXL3_DEBUG_NAMES is True
    monkeypatch.delenv("VLLM_EXL3_DEBUG_NAMES")


def kernel_config(device: str) -> Exl3KernelConfig:
    """A one-shard 128 x 128 layer whose weights are on `device`."""
    layout = plan_linear(
        "l",
        [spec("l", 128, 128)],
        split=Split.NONE,
        tp_rank=0,
        tp_size=1,
        k_width=128,
        widths=[128],
    )
    return Exl3KernelConfig(layout, torch.device(device), torch.bfloat16)


def test_reference_kernel_on_cpu():
    assert choose_exl3_linear_kernel(kernel_config("cpu")) is ReferenceExl3Kernel


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the GPU-less refusal")
def test_no_kernel_for_cuda_weights_without_the_op():
    with pytest.raises(
        ValueError,
        match=r"l: no kernel can run this layer: "
        r"CudaExl3Kernel: needs compute capability 80.*"
        r"ReferenceExl3Kernel: weights are on cuda",
    ):
        choose_exl3_linear_kernel(kernel_config("cuda"))


def test_force_reference(monkeypatch):
    monkeypatch.setenv("VLLM_EXL3_FORCE_REFERENCE", "1")
    assert choose_exl3_linear_kernel(kernel_config("cuda")) is ReferenceExl3Kernel


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the report without the extension"
)
def test_ops_report_why_they_are_missing():
    ok, why = ops.load_exl3_ops()
    assert not ok and "vllm._exl3_C" in why


# The per-rank layout rules (layout.py) at tensor-parallel sizes this machine cannot
# run: which checkpoint columns/rows each rank computes and which of them it returns
# (every returned column traced back to its checkpoint column, for every rank), and the
# row-split errors naming module, rank, numbers.


def spec(
    prefix: str, k: int, n: int, bits: float = 4, codebook: Codebook = Codebook.MUL1
) -> Exl3ModuleSpec:
    return Exl3ModuleSpec(
        prefix,
        k,
        n,
        bits,
        codebook,
        False,
        False,
        (f"{prefix}.trellis", f"{prefix}.suh", f"{prefix}.svh"),
    )


def test_column_split_reads_each_ranks_block_of_every_shard():
    specs = [spec("q", 4096, 4096), spec("k", 4096, 1024), spec("v", 4096, 1024)]
    for rank in range(4):
        layout = plan_linear(
            "qkv",
            specs,
            split=Split.COLUMN,
            tp_rank=rank,
            tp_size=4,
            k_width=4096,
            widths=[1024, 256, 256],
        )
        assert [(s.src_col, s.col, s.alloc) for s in layout.shards] == [
            (1024 * rank, 0, 1024),
            (256 * rank, 1024, 256),
            (256 * rank, 1280, 256),
        ]
        assert layout.identity_output and layout.trellis_shape == (256, 96, 64)


def test_replicated_kv_heads_read_the_shared_slice():
    specs = [spec("q", 1024, 1024), spec("k", 1024, 256), spec("v", 1024, 256)]
    srcs = [
        [
            s.src_col
            for s in plan_linear(
                "qkv",
                specs,
                split=Split.COLUMN,
                tp_rank=r,
                tp_size=4,
                k_width=1024,
                widths=[256, 128, 128],
                kv_replicas=[1, 2, 2],
            ).shards
        ]
        for r in range(4)
    ]
    assert srcs == [[0, 0, 0], [256, 0, 0], [512, 128, 128], [768, 128, 128]]


def test_row_split_reads_each_ranks_rows():
    layout = plan_linear(
        "down",
        [spec("down", 12288, 4096)],
        split=Split.ROW,
        tp_rank=3,
        tp_size=4,
        k_width=3072,
        widths=[4096],
    )
    assert (layout.src_row, layout.k_alloc) == (9216, 3072)


def _returned_checkpoint_columns(layout) -> list[tuple[int, int | None]]:
    """What each column a rank returns is: (shard, checkpoint column), None for a column
    the rank allocated past the checkpoint (zero-filled, svh = 0)."""
    computed = []
    for s, shard in enumerate(layout.shards):
        for c in range(shard.src_col, shard.src_col + shard.alloc):
            computed.append((s, c if c < shard.ckpt_cols else None))
    kept = layout.kept_columns()
    return computed if kept is None else [computed[c] for c in kept]


def _vllm_qkv(heads: int, kv_heads: int, head_dim: int, tp: int):
    """vLLM's QKVParallelLinear arithmetic: per-rank widths and KV-head replicas."""
    kv_per_rank = max(1, kv_heads // tp)
    replicas = max(1, tp // kv_heads)
    widths = [heads // tp * head_dim, kv_per_rank * head_dim, kv_per_rank * head_dim]
    return widths, [1, replicas, replicas]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,tp",
    [
        (4, 2, 64, 2),  # the fixture: one 64-wide KV head per rank
        (4, 2, 64, 4),  # ... replicated on two ranks each
        (4, 4, 64, 4),  # 4 KV heads x 64 at TP 4
        (16, 2, 64, 8),  # 4 ranks share each KV head
        (40, 8, 64, 8),  # q: 5 heads x 64 = 320 per rank, windows at odd offsets
        (32, 8, 128, 16),  # 8 KV heads x 128 at TP 16: replicated, whole blocks
        (32, 8, 64, 16),
    ],
)
def test_column_split_keeps_each_ranks_columns_of_a_block_window(
    heads, kv_heads, head_dim, tp
):
    hidden = 512
    specs = [
        spec("q", hidden, round_up(heads * head_dim, 128)),
        spec("k", hidden, round_up(kv_heads * head_dim, 128)),
        spec("v", hidden, round_up(kv_heads * head_dim, 128)),
    ]
    widths, replicas = _vllm_qkv(heads, kv_heads, head_dim, tp)
    whole_blocks = all(w % 128 == 0 for w in widths)
    for rank in range(tp):
        layout = plan_linear(
            "qkv",
            specs,
            split=Split.COLUMN,
            tp_rank=rank,
            tp_size=tp,
            k_width=hidden,
            widths=widths,
            kv_replicas=replicas,
        )
        expected = [
            (s, (rank // replicas[s]) * w + c)
            for s, w in enumerate(widths)
            for c in range(w)
        ]
        assert _returned_checkpoint_columns(layout) == expected, (rank, layout)
        for shard in layout.shards:
            assert shard.src_col % 128 == 0 and shard.alloc % 128 == 0
            assert shard.keep + shard.width <= shard.alloc < shard.width + 2 * 128
        assert layout.identity_output == whole_blocks
        assert len(layout.runs) == 1  # still one kernel call over all shards
        assert layout.trellis_shape == (hidden // 16, layout.n_alloc // 16, 64)


def test_fixture_qkv_at_tp2_computes_the_kv_block_on_both_ranks():
    specs = [spec("q", 256, 256), spec("k", 256, 128), spec("v", 256, 128)]
    windows, kept = [], []
    for rank in range(2):
        layout = plan_linear(
            "qkv",
            specs,
            split=Split.COLUMN,
            tp_rank=rank,
            tp_size=2,
            k_width=256,
            widths=[128, 64, 64],
        )
        windows.append(
            [(s.src_col, s.col, s.alloc, s.keep, s.width) for s in layout.shards]
        )
        kept.append(layout.kept_columns())
    assert windows == [
        [(0, 0, 128, 0, 128), (0, 128, 128, 0, 64), (0, 256, 128, 0, 64)],
        [(128, 0, 128, 0, 128), (0, 128, 128, 64, 64), (0, 256, 128, 64, 64)],
    ]
    assert kept[0] == [*range(128), *range(128, 192), *range(256, 320)]
    assert kept[1] == [*range(128), *range(192, 256), *range(320, 384)]


@pytest.mark.parametrize("n,tp", [(704, 2), (704, 4), (768, 8), (1408, 8)])
def test_merged_column_split_off_the_block(n, tp):
    specs = [spec("gate", 256, round_up(n, 128)), spec("up", 256, round_up(n, 128))]
    for rank in range(tp):
        layout = plan_linear(
            "gate_up",
            specs,
            split=Split.COLUMN,
            tp_rank=rank,
            tp_size=tp,
            k_width=256,
            widths=[n // tp, n // tp],
        )
        assert _returned_checkpoint_columns(layout) == [
            (s, rank * (n // tp) + c) for s in range(2) for c in range(n // tp)
        ]


def test_vllm_padding_past_the_checkpoint_comes_out_of_zero_columns():
    # vLLM one block wider than the checkpoint (768 -> 896), split 448 per rank.
    layout = plan_linear(
        "up",
        [spec("up", 256, 768)],
        split=Split.COLUMN,
        tp_rank=1,
        tp_size=2,
        k_width=256,
        widths=[448],
    )
    shard = layout.shards[0]
    assert (shard.src_col, shard.alloc, shard.keep, shard.copy_cols) == (
        384,
        512,
        64,
        384,
    )
    assert _returned_checkpoint_columns(layout) == (
        [(0, c) for c in range(448, 768)] + [(0, None)] * 128
    )


def test_row_split_off_the_block_is_an_error():
    # Qwen3-MoE-like 768 at TP 8: 96 per rank.
    with pytest.raises(
        Exl3LayoutError,
        match=r"down \(rank 5 of 8\): row-parallel input slice "
        r"of 96 features.*768 input features / TP 8",
    ):
        plan_linear(
            "down",
            [spec("down", 768, 256)],
            split=Split.ROW,
            tp_rank=5,
            tp_size=8,
            k_width=96,
            widths=[256],
        )


def test_mixed_shards_become_runs_in_flat_storage():
    specs = [
        spec("q", 256, 256, 4),
        spec("k", 256, 128, 3, Codebook.MCG),
        spec("v", 256, 128, 3, Codebook.MCG),
    ]
    layout = plan_linear(
        "qkv",
        specs,
        split=Split.NONE,
        tp_rank=0,
        tp_size=1,
        k_width=256,
        widths=[256, 128, 128],
    )
    q_words = 16 * 16 * 64
    assert [
        (r.first, r.stop, r.word_start, r.word_stop, r.shard_widths)
        for r in layout.runs
    ] == [
        (0, 1, 0, q_words, (256,)),
        (1, 3, q_words, q_words + 16 * 16 * 48, (128, 128)),
    ]
    assert layout.trellis_shape == (q_words + 16 * 16 * 48,)


def test_shard_count_mismatch_is_an_error():
    with pytest.raises(
        Exl3LayoutError,
        match=r"2 checkpoint modules \(q: n=256, k: n=128\) for 3 output shards of "
        r"widths \[256, 128, 128\]: no cut",
    ):
        plan_linear(
            "qkv",
            [spec("q", 256, 256), spec("k", 256, 128)],
            split=Split.NONE,
            tp_rank=0,
            tp_size=1,
            k_width=256,
            widths=[256, 128, 128],
        )


def test_fused_shards_with_different_k_is_an_error():
    with pytest.raises(Exl3LayoutError, match="different input sizes"):
        plan_linear(
            "gu",
            [spec("g", 256, 256), spec("u", 384, 256)],
            split=Split.NONE,
            tp_rank=0,
            tp_size=1,
            k_width=256,
            widths=[256, 256],
        )


@pytest.mark.parametrize(
    "vocab,tp",
    [(151936, 2), (151936, 8), (4000, 2), (32001, 4), (1000, 8), (128256, 4)],
)
def test_lm_head_ranks_cover_their_vocab_range(vocab, tp):
    """Simulate every rank: which checkpoint column each returned logit comes from."""
    padded = round_up(vocab, 64)
    per_rank = padded // tp
    ckpt = spec("lm_head", 512, round_up(vocab, 128), 6)
    for rank in range(tp):
        start = rank * per_rank
        layout = plan_lm_head(
            "lm_head",
            ckpt,
            tp_rank=rank,
            hidden=512,
            vocab_start=start,
            vocab_per_rank=per_rank,
            org_vocab=vocab,
        )
        shard = layout.shards[0]
        assert shard.src_col % 128 == 0 and shard.alloc % 128 == 0
        returned = [
            c if c is not None and c < shard.real_cols else None
            for _, c in _returned_checkpoint_columns(layout)
        ]
        expected = [c if c < vocab else None for c in range(start, start + per_rank)]
        assert returned == expected, (vocab, tp, rank)
