# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM 0.26's real linear classes built with Exl3LinearMethod at world size 1 (gloo,
CPU), loaded with real fixture tensors through vLLM's own weight loaders, against the
dense product decoded by the reference. One test per loading/padding rule and per error
rule. Also: ParallelLMHead with Exl3LMHeadMethod (its own loader, vLLM's 64-padding of
the vocab, the logits processor on top), and a model whose real dims are not multiples
of 128 (hidden 320, stored 384, exl3-format.md §1.7): EXL3 and unquantized linears of
one hand-made in-memory checkpoint against the dense product with the padding cut off.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization.exl3.format import (
    MCG_MARKER_VALUE,
    Exl3FormatError,
)
from vllm.model_executor.layers.quantization.exl3.kernels import ReferenceExl3Kernel
from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError
from vllm.model_executor.layers.quantization.exl3.linear import (
    Exl3LinearMethod,
    Exl3LMHeadMethod,
    Exl3PaddedUnquantizedLinearMethod,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.qwen2 import Qwen2Model
from vllm.model_executor.models.utils import AutoWeightsLoader

from .exl3_harness import (
    CKPT_3INST,
    CKPT_MCG,
    assert_matches,
    config_for,
    config_from_tensors,
    dense,
    load_module,
    tensors,
)

pytestmark = pytest.mark.usefixtures("world1")

ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
HIDDEN, HEAD_DIM, HEADS, KV_HEADS, INTER = 256, 64, 4, 2, 768


def x_for(k: int, dtype: torch.dtype, rows: int = 7) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(k + rows)).to(
        dtype
    )


def finish(layer: nn.Module) -> None:
    layer.quant_method.process_weights_after_loading(layer)


def qkv_layer(
    config,
    prefix: str = f"{ATTN}.qkv_proj",
    dtype=torch.float32,
    head_dim: int = HEAD_DIM,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    bias: bool = False,
) -> QKVParallelLinear:
    return QKVParallelLinear(
        HIDDEN,
        head_dim,
        heads,
        kv_heads,
        bias=bias,
        quant_config=config,
        prefix=prefix,
        params_dtype=dtype,
    )


def load_qkv(layer: nn.Module, named) -> None:
    for shard, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
        load_module(layer, named, f"{ATTN}.{proj}", shard)


def dense_cat(named, *prefixes: str) -> torch.Tensor:
    return torch.cat([dense(named, p) for p in prefixes], dim=1)


# ---- every layer type, real tensors, vLLM's loaders
# -------------------------------------------


@pytest.mark.parametrize("ckpt", [CKPT_3INST, CKPT_MCG], ids=["3inst-4bpw", "mcg-3bpw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_qkv_shards_by_id(ckpt, dtype):
    named = tensors(ckpt)
    layer = qkv_layer(config_for(ckpt), dtype=dtype)
    assert isinstance(layer.quant_method, Exl3LinearMethod)
    load_qkv(layer, named)
    finish(layer)
    assert isinstance(layer.quant_method.kernel, ReferenceExl3Kernel)
    x = x_for(HIDDEN, dtype)
    y, _ = layer(x)
    assert y.dtype == dtype and y.shape == (7, 512)
    w = dense_cat(named, f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj")
    assert_matches(y, x.float() @ w, f"qkv {ckpt.name} {dtype}")


@pytest.mark.parametrize("ckpt", [CKPT_3INST, CKPT_MCG], ids=["3inst-4bpw", "mcg-3bpw"])
def test_merged_gate_up_and_row_down(ckpt):
    named, config = tensors(ckpt), config_for(ckpt)
    gate_up = MergedColumnParallelLinear(
        HIDDEN,
        [INTER, INTER],
        bias=False,
        quant_config=config,
        prefix=f"{MLP}.gate_up_proj",
        params_dtype=torch.float32,
    )
    down = RowParallelLinear(
        INTER,
        HIDDEN,
        bias=False,
        quant_config=config,
        prefix=f"{MLP}.down_proj",
        params_dtype=torch.float32,
    )
    load_module(gate_up, named, f"{MLP}.gate_proj", 0)
    load_module(gate_up, named, f"{MLP}.up_proj", 1)
    load_module(down, named, f"{MLP}.down_proj")
    finish(gate_up)
    finish(down)
    x = x_for(HIDDEN, torch.float32)
    h, _ = gate_up(x)
    assert_matches(
        h, x @ dense_cat(named, f"{MLP}.gate_proj", f"{MLP}.up_proj"), "gate_up"
    )
    y, _ = down(h[:, INTER:])
    assert_matches(y, h[:, INTER:] @ dense(named, f"{MLP}.down_proj"), "down")


def test_column_and_replicated_single_modules():
    named, config = tensors(CKPT_MCG), config_for(CKPT_MCG)
    q = ColumnParallelLinear(
        HIDDEN,
        HEADS * HEAD_DIM,
        bias=False,
        quant_config=config,
        prefix=f"{ATTN}.q_proj",
        params_dtype=torch.float32,
    )
    o = ReplicatedLinear(
        HEADS * HEAD_DIM,
        HIDDEN,
        bias=False,
        quant_config=config,
        prefix=f"{ATTN}.o_proj",
        params_dtype=torch.float32,
    )
    load_module(q, named, f"{ATTN}.q_proj")
    load_module(o, named, f"{ATTN}.o_proj")  # ReplicatedLinear: v1 loader path
    finish(q)
    finish(o)
    x = x_for(HIDDEN, torch.float32)
    assert_matches(q(x)[0], x @ dense(named, f"{ATTN}.q_proj"), "column q_proj")
    assert_matches(o(x)[0], x @ dense(named, f"{ATTN}.o_proj"), "replicated o_proj")


class _Attn(nn.Module):
    def __init__(self, config, prefix):
        super().__init__()
        self.qkv_proj = qkv_layer(config, f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(
            HIDDEN,
            HIDDEN,
            bias=False,
            quant_config=config,
            prefix=f"{prefix}.o_proj",
            params_dtype=torch.float32,
        )


class _Mlp(nn.Module):
    def __init__(self, config, prefix):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            HIDDEN,
            [INTER, INTER],
            bias=False,
            quant_config=config,
            prefix=f"{prefix}.gate_up_proj",
            params_dtype=torch.float32,
        )
        self.down_proj = RowParallelLinear(
            INTER,
            HIDDEN,
            bias=False,
            quant_config=config,
            prefix=f"{prefix}.down_proj",
            params_dtype=torch.float32,
        )


class _Layer(nn.Module):
    def __init__(self, config, prefix):
        super().__init__()
        self.self_attn = _Attn(config, f"{prefix}.self_attn")
        self.mlp = _Mlp(config, f"{prefix}.mlp")


class _Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList([_Layer(config, "model.layers.0")])


def test_auto_weights_loader_with_stacked_mapper():
    """The new-style model path: WeightsMapper sets tensor.shard_id, AutoWeightsLoader
    hands the group to QKVParallelLinear/MergedColumnParallelLinear.load_weights."""
    named, config = tensors(CKPT_3INST), config_for(CKPT_3INST)
    root = _Model(config)
    layer0 = {
        k: v.clone()
        for k, v in named.items()
        if k.startswith("model.layers.0.") and not k.endswith("norm.weight")
    }
    loaded = AutoWeightsLoader(root).load_weights(
        layer0.items(), mapper=Qwen2Model.hf_to_vllm_mapper
    )
    stacked = {
        ".q_proj.": ".qkv_proj.",
        ".k_proj.": ".qkv_proj.",
        ".v_proj.": ".qkv_proj.",
        ".gate_proj.": ".gate_up_proj.",
        ".up_proj.": ".gate_up_proj.",
    }
    expected = set()
    for name in layer0:
        for old, new in stacked.items():
            name = name.replace(old, new)
        expected.add(name)
    assert loaded == expected
    for module in root.modules():
        if isinstance(getattr(module, "quant_method", None), Exl3LinearMethod):
            finish(module)
    layer = root.model.layers[0]
    x = x_for(HIDDEN, torch.float32)
    w_qkv = dense_cat(named, f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj")
    assert_matches(
        layer.self_attn.qkv_proj(x)[0], x @ w_qkv, "qkv via AutoWeightsLoader"
    )
    assert_matches(
        layer.self_attn.o_proj(x)[0], x @ dense(named, f"{ATTN}.o_proj"), "o_proj"
    )
    w_gu = dense_cat(named, f"{MLP}.gate_proj", f"{MLP}.up_proj")
    assert_matches(
        layer.mlp.gate_up_proj(x)[0], x @ w_gu, "gate_up via AutoWeightsLoader"
    )


def test_memory_is_exactly_trellis_suh_svh():
    named, config = tensors(CKPT_MCG), config_for(CKPT_MCG)
    layer = qkv_layer(config)
    assert set(dict(layer.named_parameters())) == {"trellis", "suh", "svh", "mcg"}
    load_qkv(layer, named)
    finish(layer)
    params = dict(layer.named_parameters())
    assert set(params) == {"trellis", "suh", "svh"}
    assert all(type(p) is nn.Parameter for p in params.values())
    stored = sum(
        named[f"{ATTN}.{p}.{s}"].nbytes
        for p in ("q_proj", "k_proj", "v_proj")
        for s in ("trellis", "suh", "svh")
    )
    assert sum(p.nbytes for p in params.values()) == stored


# ---- fused shards of different bitrates / codebooks: one kernel call per run
# ------------------


def _mixed_qkv() -> dict[str, torch.Tensor]:
    """q from the 4 bpw 3inst checkpoint, k and v from the 3 bpw mcg one (real
    tensors).
    """
    a, b = tensors(CKPT_3INST), tensors(CKPT_MCG)
    out = {k: v for k, v in a.items() if k.startswith(f"{ATTN}.q_proj.")}
    out.update(
        {
            k: v
            for k, v in b.items()
            if k.startswith((f"{ATTN}.k_proj.", f"{ATTN}.v_proj."))
        }
    )
    return out


def test_mixed_bitrate_and_codebook_shards_split_into_runs():
    named = _mixed_qkv()
    layer = qkv_layer(config_from_tensors(named))
    layout = layer.quant_method.layout
    assert [(r.first, r.stop, r.bits) for r in layout.runs] == [(0, 1, 4), (1, 3, 3)]
    assert layer.trellis.dim() == 1  # flat storage, one block per run
    load_qkv(layer, named)
    finish(layer)
    x = x_for(HIDDEN, torch.float32)
    w = dense_cat(named, f"{ATTN}.q_proj", f"{ATTN}.k_proj", f"{ATTN}.v_proj")
    assert_matches(layer(x)[0], x @ w, "mixed qkv")


def test_marker_for_a_shard_without_one_is_rejected():
    named = _mixed_qkv()
    layer = qkv_layer(config_from_tensors(named))
    stray = torch.tensor(MCG_MARKER_VALUE, dtype=torch.int32)
    with pytest.raises(Exl3LayoutError, match=r"q_proj\.mcg.*not listed"):
        layer.mcg.weight_loader(layer.mcg, stray, "q")


# ---- legacy sign bitfields
# --------------------------------------------------------------------


def test_legacy_su_sv_are_consumed_into_suh_svh():
    src = tensors(CKPT_MCG)
    gen = torch.Generator().manual_seed(3)
    prefix = f"{ATTN}.q_proj"
    named = {
        f"{prefix}.trellis": src[f"{prefix}.trellis"],
        f"{prefix}.mcg": src[f"{prefix}.mcg"],
        f"{prefix}.su": torch.randint(
            -(2**15), 2**15, (HIDDEN // 16,), generator=gen, dtype=torch.int32
        ).to(torch.int16),
        f"{prefix}.sv": torch.randint(
            -(2**15), 2**15, (256 // 16,), generator=gen, dtype=torch.int32
        ).to(torch.int16),
    }
    layer = ColumnParallelLinear(
        HIDDEN,
        256,
        bias=False,
        quant_config=config_from_tensors(named),
        prefix=prefix,
        params_dtype=torch.float32,
    )
    load_module(layer, named, prefix)
    finish(layer)
    assert set(dict(layer.named_parameters())) == {"trellis", "suh", "svh"}
    x = x_for(HIDDEN, torch.float32)
    assert_matches(layer(x)[0], x @ dense(named, prefix), "legacy signs")


# ---- padding: the format's (k, n to 128) and vLLM's (whole blocks past the checkpoint)
# ---------


def test_row_input_narrower_than_checkpoint_is_zero_extended():
    named, config = tensors(CKPT_MCG), config_for(CKPT_MCG)
    down = RowParallelLinear(
        700,
        HIDDEN,
        bias=False,
        quant_config=config,
        prefix=f"{MLP}.down_proj",
        params_dtype=torch.float32,
    )
    load_module(down, named, f"{MLP}.down_proj")
    finish(down)
    x = x_for(700, torch.float32)
    w = dense(named, f"{MLP}.down_proj")[:700]
    assert_matches(down(x)[0], x @ w, "k 700 in a k=768 checkpoint")


def test_row_input_padded_past_checkpoint_contributes_zero():
    named, config = tensors(CKPT_MCG), config_for(CKPT_MCG)
    down = RowParallelLinear(
        INTER + 128,
        HIDDEN,
        bias=False,
        quant_config=config,
        prefix=f"{MLP}.down_proj",
        params_dtype=torch.float32,
    )
    load_module(down, named, f"{MLP}.down_proj")
    finish(down)
    assert torch.all(down.suh[0, INTER:] == 0)
    x = x_for(INTER + 128, torch.float32)  # non-zero in the padded block too
    assert_matches(
        down(x)[0], x[:, :INTER] @ dense(named, f"{MLP}.down_proj"), "k padded"
    )


def test_column_output_narrower_than_checkpoint_is_cut():
    named, config = tensors(CKPT_3INST), config_for(CKPT_3INST)
    gate_up = MergedColumnParallelLinear(
        HIDDEN,
        [700, 700],
        bias=False,
        quant_config=config,
        prefix=f"{MLP}.gate_up_proj",
        params_dtype=torch.float32,
    )
    load_module(gate_up, named, f"{MLP}.gate_proj", 0)
    load_module(gate_up, named, f"{MLP}.up_proj", 1)
    finish(gate_up)
    x = x_for(HIDDEN, torch.float32)
    w = torch.cat(
        [
            dense(named, f"{MLP}.gate_proj")[:, :700],
            dense(named, f"{MLP}.up_proj")[:, :700],
        ],
        dim=1,
    )
    assert_matches(gate_up(x)[0], x @ w, "n 700+700 from n=768 shards")


def test_column_output_padded_past_checkpoint_is_exactly_zero():
    named, config = tensors(CKPT_3INST), config_for(CKPT_3INST)
    up = ColumnParallelLinear(
        HIDDEN,
        INTER + 128,
        bias=False,
        quant_config=config,
        prefix=f"{MLP}.up_proj",
        params_dtype=torch.float32,
    )
    load_module(up, named, f"{MLP}.up_proj")
    finish(up)
    x = x_for(HIDDEN, torch.float32)
    y = up(x)[0]
    assert torch.all(y[:, INTER:] == 0)
    assert_matches(y[:, :INTER], x @ dense(named, f"{MLP}.up_proj"), "n padded")


def test_padding_that_is_not_whole_blocks_is_an_error():
    config = config_for(CKPT_3INST)
    with pytest.raises(Exl3LayoutError, match=r"whole 128-wide blocks.*got 64"):
        RowParallelLinear(
            INTER + 64,
            HIDDEN,
            bias=False,
            quant_config=config,
            prefix=f"{MLP}.down_proj",
        )


def test_checkpoint_wider_than_layer_is_an_error():
    config = config_for(CKPT_3INST)
    with pytest.raises(
        Exl3LayoutError, match=r"has 768 output features but the layer has 512"
    ):
        ColumnParallelLinear(
            HIDDEN, 512, bias=False, quant_config=config, prefix=f"{MLP}.up_proj"
        )


# ---- bias: the layer's own parameter
# ----------------------------------------------------------


def _with_bias(prefix: str, n: int) -> dict[str, torch.Tensor]:
    named = {
        k: v for k, v in tensors(CKPT_MCG).items() if k.rpartition(".")[0] == prefix
    }
    gen = torch.Generator().manual_seed(5)
    named[f"{prefix}.bias"] = torch.randn(n, generator=gen).to(torch.float16)
    return named


@pytest.mark.parametrize(
    "width", [INTER, 700], ids=["fused-into-kernel", "added-after-cut"]
)
def test_bias_is_the_layers_own(width):
    prefix = f"{MLP}.up_proj"
    named = _with_bias(prefix, INTER)
    layer = ColumnParallelLinear(
        HIDDEN,
        width,
        bias=True,
        quant_config=config_from_tensors(named),
        prefix=prefix,
        params_dtype=torch.float32,
    )
    load_module(layer, named, prefix)
    layer.bias.weight_loader(layer.bias, named[f"{prefix}.bias"])
    finish(layer)
    assert set(dict(layer.named_parameters())) == {"trellis", "suh", "svh", "bias"}
    x = x_for(HIDDEN, torch.float32)
    expected = (
        x @ dense(named, prefix)[:, :width] + named[f"{prefix}.bias"][:width].float()
    )
    assert_matches(layer(x)[0], expected, f"bias width {width}")


def test_bias_mismatch_is_an_error():
    prefix = f"{MLP}.up_proj"
    with pytest.raises(
        Exl3LayoutError, match="checkpoint has a bias but the model builds"
    ):
        ColumnParallelLinear(
            HIDDEN,
            INTER,
            bias=False,
            quant_config=config_from_tensors(_with_bias(prefix, INTER)),
            prefix=prefix,
        )
    with pytest.raises(Exl3LayoutError, match="checkpoint lacks a bias"):
        ColumnParallelLinear(
            HIDDEN, INTER, bias=True, quant_config=config_for(CKPT_MCG), prefix=prefix
        )


# ---- what the checkpoint must deliver
# ---------------------------------------------------------


def test_shard_never_loaded_is_an_error():
    named = tensors(CKPT_MCG)
    layer = qkv_layer(config_for(CKPT_MCG))
    load_module(layer, named, f"{ATTN}.q_proj", "q")
    load_module(layer, named, f"{ATTN}.k_proj", "k")
    with pytest.raises(
        Exl3LayoutError, match=r"never loaded: .*v_proj\.mcg.*v_proj\.trellis"
    ):
        finish(layer)


def test_wrong_marker_value_is_an_error():
    named = dict(tensors(CKPT_MCG))
    named[f"{ATTN}.k_proj.mcg"] = torch.tensor(12345, dtype=torch.int32)
    layer = qkv_layer(config_for(CKPT_MCG))
    load_qkv(layer, named)
    with pytest.raises(Exl3LayoutError, match=r"k_proj\.mcg.*marker value 12345"):
        finish(layer)


def test_tensor_of_the_wrong_shape_is_an_error():
    named = tensors(CKPT_MCG)
    layer = qkv_layer(config_for(CKPT_MCG))
    with pytest.raises(
        Exl3LayoutError, match=r"q_proj\.trellis.*got \[16, 8, 48\].*\[16, 16, 48\]"
    ):
        layer.trellis.weight_loader(layer.trellis, named[f"{ATTN}.k_proj.trellis"], "q")


def test_fused_on_disk_tensor_is_an_error():
    named = tensors(CKPT_MCG)
    layer = qkv_layer(config_for(CKPT_MCG))
    fused = torch.cat(
        [named[f"{ATTN}.{p}.svh"] for p in ("q_proj", "k_proj", "v_proj")]
    )
    with pytest.raises(AttributeError, match="fused-on-disk"):
        layer.svh.weight_loader(layer.svh, fused)  # no shard id


def test_fused_module_narrower_than_the_layer_is_an_error():
    src = tensors(CKPT_MCG)
    named = {
        k.replace(".q_proj.", ".qkv_proj."): v
        for k, v in src.items()
        if k.startswith(f"{ATTN}.q_proj.")
    }
    # One module may cover the whole layer (test_exl3_spanning_shards.py), but only
    # with the layer's width: here q_proj's 256 columns stand for q, k and v.
    with pytest.raises(
        Exl3LayoutError,
        match=r"qkv_proj: 1 checkpoint modules \(.*qkv_proj: n=256\) for 3 output "
        r"shards of widths \[256, 128, 128\]: no cut",
    ):
        qkv_layer(config_from_tensors(named))


def test_fused_layer_mixing_exl3_and_plain_shards_is_an_error():
    src = tensors(CKPT_MCG)
    named = {
        k: v
        for k, v in src.items()
        if k.startswith((f"{ATTN}.q_proj.", f"{ATTN}.k_proj."))
    }
    named[f"{ATTN}.v_proj.weight"] = torch.zeros(128, HIDDEN, dtype=torch.float16)
    with pytest.raises(
        Exl3LayoutError, match=r"mixes EXL3 and non-EXL3 shards.*v_proj -> not EXL3"
    ):
        qkv_layer(config_from_tensors(named))


def test_non_exl3_linear_falls_through_unquantized():
    config = config_for(CKPT_MCG)
    layer = ReplicatedLinear(
        HIDDEN, 8, bias=False, quant_config=config, prefix="model.layers.0.mlp.gate"
    )
    # vLLM's unquantized method, with a loader that trims the format's 128-padding.
    assert type(layer.quant_method) is Exl3PaddedUnquantizedLinearMethod
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)


def test_unknown_tensor_suffix_fails_at_config_time():
    named = {
        k: v for k, v in tensors(CKPT_MCG).items() if k.startswith(f"{ATTN}.q_proj.")
    }
    named[f"{ATTN}.q_proj.extra"] = torch.zeros(4, dtype=torch.float16)
    with pytest.raises(Exl3FormatError, match=r"q_proj\.extra: unexpected tensor"):
        config_from_tensors(named)


def test_dummy_load_needs_no_checkpoint():
    """load_format=dummy: nothing is loaded, process_weights_after_loading still
    finishes."""
    layer = qkv_layer(config_for(CKPT_MCG))
    finish(layer)
    assert set(dict(layer.named_parameters())) == {"trellis", "suh", "svh"}
    y, _ = layer(x_for(HIDDEN, torch.float32))
    assert y.shape == (7, 512) and torch.all(y == 0)  # zero-initialised svh


def test_marker_of_the_wrong_dtype_is_an_error():
    layer = qkv_layer(config_for(CKPT_MCG))
    with pytest.raises(Exl3LayoutError, match=r"k_proj\.mcg.*marker must be one int32"):
        layer.mcg.weight_loader(layer.mcg, torch.tensor([1.0, 2.0]), "k")


def test_unsupported_linear_class_is_an_error():
    from vllm.model_executor.layers.linear import LinearBase

    class OddLinear(LinearBase):
        def __init__(self, config):
            self.output_partition_sizes = [256]
            super().__init__(HIDDEN, 256, quant_config=config, prefix=f"{ATTN}.q_proj")
            self.quant_method.create_weights(
                self, HIDDEN, [256], HIDDEN, 256, torch.float32, weight_loader=None
            )

    with pytest.raises(Exl3LayoutError, match="unsupported linear class OddLinear"):
        OddLinear(config_for(CKPT_MCG))


# ParallelLMHead with Exl3LMHeadMethod at world size 1: its own loader (the vocab is
# the trellis' dim 1), vLLM's 64-padding of the vocab, and the logits processor on top.

HIDDEN, CKPT_VOCAB = 256, 4096


def head(vocab: int, **kwargs) -> ParallelLMHead:
    return ParallelLMHead(
        vocab,
        HIDDEN,
        quant_config=config_for(CKPT_MCG),
        prefix="lm_head",
        params_dtype=torch.float32,
        **kwargs,
    )


def load_head(layer: ParallelLMHead) -> None:
    for name, tensor in tensors(CKPT_MCG).items():
        if name.startswith("lm_head."):
            param = getattr(layer, name.rpartition(".")[2])
            param.weight_loader(param, tensor)
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize(
    "vocab", [CKPT_VOCAB, 4000], ids=["vocab-4096", "vocab-4000-padded"]
)
def test_lm_head_logits(vocab):
    layer = head(vocab)
    assert isinstance(layer.quant_method, Exl3LMHeadMethod)
    padded = layer.num_embeddings_per_partition
    assert padded == -(-vocab // 64) * 64
    load_head(layer)
    assert set(dict(layer.named_parameters())) == {"trellis", "suh", "svh"}
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    w = dense(tensors(CKPT_MCG), "lm_head")
    y = layer.quant_method.apply(layer, x)
    assert y.shape == (5, padded)
    assert_matches(y[:, :vocab], x @ w[:, :vocab], f"lm_head vocab {vocab}")
    assert torch.all(y[:, vocab:] == 0), "vLLM's vocab padding must come out exactly 0"
    logits = LogitsProcessor(vocab)(layer, x)
    assert logits.shape == (5, vocab)
    assert_matches(logits, x @ w[:, :vocab], "logits processor")


def test_lm_head_with_vocab_mismatch_is_an_error():
    with pytest.raises(
        Exl3LayoutError,
        match=r"4096 vocab columns, expected the model's vocab "
        r"3900 padded to 3968",
    ):
        head(3900)


def test_lm_head_added_vocab_is_an_error():
    with pytest.raises(Exl3LayoutError, match="added \\(LoRA\\) vocabulary"):
        head(4016, org_num_embeddings=4000)


def test_lm_head_cannot_be_tied():
    layer = head(CKPT_VOCAB)
    embed = VocabParallelEmbedding(
        CKPT_VOCAB,
        HIDDEN,
        quant_config=config_for(CKPT_MCG),
        prefix="model.embed_tokens",
    )
    with pytest.raises(Exl3LayoutError, match="cannot be tied"):
        layer.tie_weights(embed)


# A model whose real dims are not multiples of 128 (hidden 320, stored 384,
# exl3-format.md §1.7): EXL3 linears and unquantized linears (fp16 `.weight` (n_pad,
# k_pad), `.bias` n_pad) of one hand-made in-memory checkpoint, loaded through vLLM
# 0.26's real layers and loaders at world size 1, against the dense product with the
# padding cut off.

REAL, PADDED = 320, 384  # hidden and its 128-multiple as ExLlamaV3 stores it
ROUTER, ROUTER_PADDED = 8, 128  # a replicated unquantized linear with a tiny n
WORDS_4BPW = 64  # int16 words per 16x16 tile at 4 bits


def _exl3(gen: torch.Generator, prefix: str, bias: bool) -> dict[str, torch.Tensor]:
    """A 4 bpw 3inst module, k = n = 384 stored for 320 real: svh (and bias) zero on the
    padded output columns, as the quantizer leaves them."""
    svh = torch.where(torch.rand(PADDED, generator=gen) < 0.5, -1.0, 1.0)
    svh[REAL:] = 0
    named = {
        f"{prefix}.trellis": torch.randint(
            -(2**15),
            2**15,
            (PADDED // 16, PADDED // 16, WORDS_4BPW),
            generator=gen,
            dtype=torch.int32,
        ).to(torch.int16),
        f"{prefix}.suh": torch.where(
            torch.rand(PADDED, generator=gen) < 0.5, -1.0, 1.0
        ).half(),
        f"{prefix}.svh": svh.half(),
    }
    if bias:
        b = torch.randn(PADDED, generator=gen)
        b[REAL:] = 0
        named[f"{prefix}.bias"] = b.half()
    return named


def _plain(
    gen: torch.Generator, prefix: str, n: int, n_pad: int, bias: bool
) -> dict[str, torch.Tensor]:
    """An unquantized linear stored as the format does: (n_pad, k_pad), padded output
    rows zero; padded input columns hold garbage on purpose (x is zero there, so they
    must not matter)."""
    w = torch.randn(n_pad, PADDED, generator=gen)
    w[n:] = 0
    named = {f"{prefix}.weight": w.half()}
    if bias:
        b = torch.randn(n_pad, generator=gen)
        b[n:] = 0
        named[f"{prefix}.bias"] = b.half()
    return named


def checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(320)
    return {
        **_exl3(gen, f"{ATTN}.q_proj", bias=False),
        **_exl3(gen, f"{ATTN}.o_proj", bias=True),
        **_plain(gen, f"{MLP}.gate_proj", REAL, PADDED, bias=False),
        **_plain(gen, f"{MLP}.up_proj", REAL, PADDED, bias=False),
        **_plain(gen, f"{MLP}.down_proj", REAL, PADDED, bias=True),
        **_plain(gen, f"{MLP}.gate", ROUTER, ROUTER_PADDED, bias=False),
    }


def _load(layer: torch.nn.Module, named, prefix: str, shard_id=None) -> None:
    """Every tensor of one checkpoint module through its parameter's own
    weight_loader.
    """
    for name, tensor in named.items():
        mod, _, suffix = name.rpartition(".")
        if mod == prefix:
            param = getattr(layer, suffix)
            args = () if shard_id is None else (shard_id,)
            param.weight_loader(param, tensor, *args)


def _finish(layer: torch.nn.Module) -> torch.nn.Module:
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _x(k: int = REAL) -> torch.Tensor:
    return torch.randn(5, k, generator=torch.Generator().manual_seed(k))


def _dense_plain(named, prefix: str, n: int) -> torch.Tensor:
    """W^T [k, n] of an unquantized module, padding cut off."""
    return named[f"{prefix}.weight"][:n, :REAL].float().t()


def test_exl3_linears_with_padded_dims_and_padded_bias():
    named = checkpoint()
    config = config_from_tensors(named)
    q = RowParallelLinear(
        REAL,
        REAL,
        bias=False,
        quant_config=config,
        prefix=f"{ATTN}.q_proj",
        params_dtype=torch.float32,
    )
    o = RowParallelLinear(
        REAL,
        REAL,
        bias=True,
        quant_config=config,
        prefix=f"{ATTN}.o_proj",
        params_dtype=torch.float32,
    )
    assert isinstance(o.quant_method, Exl3LinearMethod)
    load_module(q, named, f"{ATTN}.q_proj")
    load_module(o, named, f"{ATTN}.o_proj")
    # RowParallelLinear's bias loader asserts equal shapes: the 384 stored entries are
    # cut to 320.
    o.bias.weight_loader(o.bias, named[f"{ATTN}.o_proj.bias"])
    _finish(q), _finish(o)
    x = _x()
    assert_matches(
        q(x)[0], x @ dense(named, f"{ATTN}.q_proj")[:REAL, :REAL], "exl3 q 320"
    )
    expected = (
        x @ dense(named, f"{ATTN}.o_proj")[:REAL, :REAL]
        + named[f"{ATTN}.o_proj.bias"][:REAL].float()
    )
    assert_matches(o(x)[0], expected, "exl3 o 320 + padded bias")


def test_unquantized_linears_stored_padded_are_trimmed():
    named = checkpoint()
    config = config_from_tensors(named)
    gate_up = MergedColumnParallelLinear(
        REAL,
        [REAL, REAL],
        bias=False,
        quant_config=config,
        prefix=f"{MLP}.gate_up_proj",
        params_dtype=torch.float32,
    )
    down = RowParallelLinear(
        REAL,
        REAL,
        bias=True,
        quant_config=config,
        prefix=f"{MLP}.down_proj",
        params_dtype=torch.float32,
    )
    router = ReplicatedLinear(
        REAL,
        ROUTER,
        bias=False,
        quant_config=config,
        prefix=f"{MLP}.gate",
        params_dtype=torch.float32,
    )
    for layer in (gate_up, down, router):
        assert type(layer.quant_method) is Exl3PaddedUnquantizedLinearMethod
    _load(gate_up, named, f"{MLP}.gate_proj", 0)
    _load(gate_up, named, f"{MLP}.up_proj", 1)
    _load(down, named, f"{MLP}.down_proj")
    _load(router, named, f"{MLP}.gate")
    assert gate_up.weight.shape == (2 * REAL, REAL) and down.bias.shape == (REAL,)
    for layer in (gate_up, down, router):
        _finish(layer)
    x = _x()
    w = torch.cat(
        [
            _dense_plain(named, f"{MLP}.gate_proj", REAL),
            _dense_plain(named, f"{MLP}.up_proj", REAL),
        ],
        dim=1,
    )
    assert_matches(gate_up(x)[0], x @ w, "gate_up from padded shards")
    expected = (
        x @ _dense_plain(named, f"{MLP}.down_proj", REAL)
        + named[f"{MLP}.down_proj.bias"][:REAL].float()
    )
    assert_matches(down(x)[0], expected, "down + bias, padded")
    assert_matches(
        router(x)[0], x @ _dense_plain(named, f"{MLP}.gate", ROUTER), "router 8/128"
    )


def test_unpadded_unquantized_weight_loads_unchanged():
    named = checkpoint()
    named[f"{MLP}.down_proj.weight"] = named[f"{MLP}.down_proj.weight"][
        :REAL, :REAL
    ].clone()
    named[f"{MLP}.down_proj.bias"] = named[f"{MLP}.down_proj.bias"][:REAL].clone()
    down = RowParallelLinear(
        REAL,
        REAL,
        bias=True,
        quant_config=config_from_tensors(named),
        prefix=f"{MLP}.down_proj",
        params_dtype=torch.float32,
    )
    _load(down, named, f"{MLP}.down_proj")
    _finish(down)
    x = _x()
    expected = (
        x @ _dense_plain(named, f"{MLP}.down_proj", REAL)
        + named[f"{MLP}.down_proj.bias"]
    )
    assert_matches(down(x)[0], expected.float(), "exact shapes")


@pytest.mark.parametrize(
    "shape",
    [(400, PADDED), (PADDED, REAL), (REAL, 512)],
    ids=["n-not-128-padding", "k-unpadded-n-padded", "k-over-padded"],
)
def test_wrongly_padded_unquantized_weight_is_an_error(shape):
    named = checkpoint()
    down = RowParallelLinear(
        REAL,
        REAL,
        bias=True,
        quant_config=config_from_tensors(named),
        prefix=f"{MLP}.down_proj",
        params_dtype=torch.float32,
    )
    bad = torch.zeros(shape, dtype=torch.float16)
    match = (
        rf"EXL3 {MLP}\.down_proj\.weight: stored shape \[{shape[0]}, {shape[1]}\], "
        rf"expected the layer's \[320, 320\] or .* \[384, 384\]"
    )
    with pytest.raises(Exl3FormatError, match=match):
        down.weight.weight_loader(down.weight, bad)


def test_wrongly_padded_bias_is_an_error():
    named = checkpoint()
    gate_up = MergedColumnParallelLinear(
        REAL,
        [REAL, REAL],
        bias=True,
        quant_config=config_from_tensors(named),
        prefix=f"{MLP}.gate_up_proj",
        params_dtype=torch.float32,
    )
    with pytest.raises(
        Exl3FormatError,
        match=rf"{MLP}\.gate_up_proj\.bias \(shard 1\): stored shape \[448\]",
    ):
        gate_up.bias.weight_loader(
            gate_up.bias, torch.zeros(448, dtype=torch.float16), 1
        )
