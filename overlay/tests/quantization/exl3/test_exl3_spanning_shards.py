# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One EXL3 checkpoint module covering several consecutive output shards of vLLM's
MergedColumnParallelLinear: Qwen3.5's gated-delta-net `in_proj_qkvz` is built with four
shards (q, k, v, z) while ExLlamaV3 stores `in_proj_qkv` (q, k and v, one module) and
`in_proj_z`, and vLLM's loader sends `in_proj_qkv` with the shard id (0, 1, 2).

vLLM 0.26's real layer, loaded through its own loaders (the parameter's weight_loader,
and AutoWeightsLoader with Qwen3.5's own WeightsMapper), at TP=1 and at TP=2 (two
spawned processes, one gloo world), against the dense product of the reference decode:
each rank must return, per shard, its slice of that shard's columns of the module.
Dimensions both 128-aligned (Qwen3.5's real ones) and not (a shard boundary and the rank
boundaries inside 128-blocks, so windows overlap and the output is gathered); one 3inst
and one mcg module, so the layer runs as two kernel runs. Plus the errors: a loader that
names other shards than the module covers, stored widths no cut of the shards matches,
and an ambiguous cut.

Also the other way ExLlamaV3 fuses: one module for a whole multi-shard layer, stored
fused on disk and loaded without a shard id (the Qwen3-VL vision tower of Qwen3.5's
multimodal classes: `attn.qkv`, with a bias, vLLM's QKVParallelLinear). And both in
a checkpoint laid out as ExLlamaV3 writes Qwen3.5's multimodal classes, validated as
vLLM's loader validates it and loaded under vLLM's names; then that whole checkpoint
through vLLM's model loader into the real Qwen3_5ForConditionalGeneration and
Qwen3_5MoeForConditionalGeneration (vision tower built, or left out as
`--language-model-only` serves it): every parameter written, a tensor nothing takes
named, every EXL3 linear equal to the reference decode.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
)
from vllm.model_executor.layers.quantization.exl3.format import (
    MCG_MARKER_VALUE,
    Codebook,
    Exl3ModuleSpec,
)
from vllm.model_executor.layers.quantization.exl3.layout import (
    Exl3LayoutError,
    Split,
    plan_linear,
)
from vllm.model_executor.layers.quantization.exl3.weights import OUT_INDEX

from .exl3_harness import assert_matches, config_from_tensors, dense

GDN = "model.layers.0.linear_attn"
QKVZ = f"{GDN}.in_proj_qkvz"
QKV, Z = f"{GDN}.in_proj_qkv", f"{GDN}.in_proj_z"
HIDDEN = 256
WORLD = 2
TILE = 16
PAD = 128  # the format pads every n to the 128-wide Hadamard block
WORDS = {3: 48, 4: 64, 6: 96}  # int16 words per 16x16 tile: 16 per bit
# (key_dim, value_dim): 128-aligned at TP=1 and TP=2 (Qwen3.5's real dims are multiples
# of 128 heads wide), and not: q/k/v boundaries and every rank boundary inside a block.
DIMS = {"aligned": (256, 512), "unaligned": (192, 320)}


def _module(
    gen: torch.Generator, prefix: str, n: int, bits: int, mcg: bool, k: int = HIDDEN
) -> dict[str, torch.Tensor]:
    """An EXL3 module of real n (stored padded to 128): random codes, +-1 input
    scales, output scales of varied magnitude and sign, zero on the padded columns."""
    n_pad = -(-n // PAD) * PAD
    svh = torch.randn(n_pad, generator=gen)
    svh[n:] = 0
    named = {
        f"{prefix}.trellis": torch.randint(
            -(2**15),
            2**15,
            (k // TILE, n_pad // TILE, WORDS[bits]),
            generator=gen,
            dtype=torch.int32,
        ).to(torch.int16),
        f"{prefix}.suh": torch.where(
            torch.rand(k, generator=gen) < 0.5, -1.0, 1.0
        ).half(),
        f"{prefix}.svh": svh.half(),
    }
    if mcg:
        named[f"{prefix}.mcg"] = torch.tensor(MCG_MARKER_VALUE, dtype=torch.int32)
    return named


def checkpoint(dims: str) -> dict[str, torch.Tensor]:
    key_dim, value_dim = DIMS[dims]
    gen = torch.Generator().manual_seed(key_dim + value_dim)
    return {
        **_module(gen, QKV, 2 * key_dim + value_dim, bits=4, mcg=False),
        **_module(gen, Z, value_dim, bits=3, mcg=True),
    }


def qkvz_layer(dims: str, named) -> MergedColumnParallelLinear:
    """The layer as vLLM 0.26's QwenGatedDeltaNetAttention builds it for Qwen3.5."""
    key_dim, value_dim = DIMS[dims]
    return MergedColumnParallelLinear(
        HIDDEN,
        [key_dim, key_dim, value_dim, value_dim],
        bias=False,
        quant_config=config_from_tensors(named),
        prefix=QKVZ,
        params_dtype=torch.float32,
    )


def load(layer, named, prefix: str, shard_id) -> None:
    for name, tensor in named.items():
        mod, _, suffix = name.rpartition(".")
        if mod == prefix:
            param = getattr(layer, suffix)
            param.weight_loader(param, tensor, shard_id)


def expected(named, dims: str, x: torch.Tensor, rank: int, world: int):
    """x @ (this rank's slice of q, k, v, then z), from the reference decode."""
    key_dim, value_dim = DIMS[dims]
    w_qkv, w_z = dense(named, QKV), dense(named, Z)
    cols = []
    for w, offset, size in (
        (w_qkv, 0, key_dim),
        (w_qkv, key_dim, key_dim),
        (w_qkv, 2 * key_dim, value_dim),
        (w_z, 0, value_dim),
    ):
        per = size // world
        cols.append(w[:, offset + rank * per : offset + (rank + 1) * per])
    return x @ torch.cat(cols, dim=1)


VISION_QKV = "visual.blocks.0.attn.qkv"
VISION_HEADS, VISION_HEAD_DIM = 4, 64


def vision_checkpoint() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    n = 3 * VISION_HEADS * VISION_HEAD_DIM
    named = _module(gen, VISION_QKV, n, bits=4, mcg=False)
    named[f"{VISION_QKV}.bias"] = torch.randn(n, generator=gen).half()
    return named


def vision_qkv_layer(named) -> QKVParallelLinear:
    """As vLLM 0.26's Qwen2_5_VisionAttention builds it (no GQA, with a bias)."""
    return QKVParallelLinear(
        HIDDEN,
        VISION_HEAD_DIM,
        VISION_HEADS,
        VISION_HEADS,
        bias=True,
        quant_config=config_from_tensors(named),
        prefix=VISION_QKV,
        params_dtype=torch.float32,
    )


def vision_expected(named, x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    width = VISION_HEADS * VISION_HEAD_DIM
    per = width // world
    # This rank's slice of each of q, k and v, consecutive in the module.
    starts = [s * width + rank * per for s in range(3)]
    cols = torch.cat([torch.arange(start, start + per) for start in starts])
    w = dense(named, VISION_QKV)[:, cols]
    return x @ w + named[f"{VISION_QKV}.bias"].float()[cols]


def load_unsharded(layer, named, prefix: str) -> None:
    """Every tensor without a shard id, as a fused-on-disk layer is loaded."""
    for name, tensor in named.items():
        mod, _, suffix = name.rpartition(".")
        if mod == prefix:
            param = getattr(layer, suffix)
            param.weight_loader(param, tensor)


def x_in() -> torch.Tensor:
    return torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(5))


def finish(layer) -> None:
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("dims", list(DIMS))
def test_module_covering_three_shards_tp1(dims):
    named = checkpoint(dims)
    layer = qkvz_layer(dims, named)
    load(layer, named, QKV, (0, 1, 2))
    load(layer, named, Z, 3)
    finish(layer)
    layout = layer.quant_method.layout
    assert [s.module for s in layout.shards] == [0, 0, 0, 1]
    assert len(layout.runs) == 2  # 3inst q/k/v, then mcg z
    x = x_in()
    y, _ = layer(x)
    assert y.shape == (5, sum(layer.output_sizes))
    assert_matches(y, expected(named, dims, x, 0, 1), f"qkvz {dims} tp1")
    # Unaligned: k starts inside q's last block, so k's window recomputes it and the
    # output is gathered; aligned shards return what they compute.
    assert hasattr(layer, OUT_INDEX) == (dims == "unaligned")


@pytest.mark.usefixtures("world1")
def test_qwen3_5_mapper_routes_the_module_with_its_shard_tuple():
    """Through AutoWeightsLoader with Qwen3.5's stacked WeightsMapper entries, as
    Qwen3_5Model.load_weights does: the mapper tags in_proj_qkv with (0, 1, 2) and
    MergedColumnParallelLinear.load_weights passes it on."""
    from vllm.model_executor.models.qwen3_5 import Qwen3_5Model
    from vllm.model_executor.models.utils import AutoWeightsLoader

    mapper = Qwen3_5Model.hf_to_vllm_mapper

    named = checkpoint("aligned")

    class Gdn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.in_proj_qkvz = qkvz_layer("aligned", named)

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_attn = Gdn()

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer()])

    root = torch.nn.Module()
    root.model = Model()
    loaded = AutoWeightsLoader(root).load_weights(
        ((k, v.clone()) for k, v in named.items()),
        mapper=mapper,
    )
    layer = root.model.layers[0].linear_attn.in_proj_qkvz
    assert {f"{QKVZ}.trellis", f"{QKVZ}.suh", f"{QKVZ}.svh"} <= loaded
    finish(layer)
    x = x_in()
    assert_matches(layer(x)[0], expected(named, "aligned", x, 0, 1), "mapped qkvz")


@pytest.mark.usefixtures("world1")
def test_one_module_for_the_whole_qkv_layer_loaded_without_shard_id():
    named = vision_checkpoint()
    layer = vision_qkv_layer(named)
    load_unsharded(layer, named, VISION_QKV)
    finish(layer)
    assert [s.module for s in layer.quant_method.layout.shards] == [0, 0, 0]
    x = x_in()
    assert_matches(layer(x)[0], vision_expected(named, x, 0, 1), "vision qkv tp1")


@pytest.mark.usefixtures("world1")
@pytest.mark.parametrize("shard_id", [0, (0, 1), (1, 2, 3)])
def test_loader_naming_other_shards_is_an_error(shard_id):
    named = checkpoint("aligned")
    layer = qkvz_layer("aligned", named)
    with pytest.raises(
        Exl3LayoutError,
        match=r"in_proj_qkvz\.trellis \(rank 0\): a tensor loaded as shard\(s\) "
        r".*, but shard \d is part of checkpoint module .*in_proj_qkv, which covers "
        r"shard\(s\) \[0, 1, 2\]",
    ):
        layer.trellis.weight_loader(layer.trellis, named[f"{QKV}.trellis"], shard_id)


@pytest.mark.usefixtures("world1")
def test_module_loaded_twice_through_shard_tuples_is_an_error():
    named = checkpoint("aligned")
    layer = qkvz_layer("aligned", named)
    load(layer, named, QKV, (0, 1, 2))
    with pytest.raises(Exl3LayoutError, match="in_proj_qkv.trellis written twice"):
        layer.trellis.weight_loader(layer.trellis, named[f"{QKV}.trellis"], (0, 1, 2))


@pytest.mark.usefixtures("world1")
def test_stored_width_matching_no_cut_is_an_error():
    named = checkpoint("aligned")
    with pytest.raises(
        Exl3LayoutError,
        match=r"in_proj_qkvz: 2 checkpoint modules \(.*in_proj_qkv: n=1024, "
        r".*in_proj_z: n=512\) for 4 output shards of widths \[256, 256, 384, 384\]: "
        r"no cut",
    ):
        MergedColumnParallelLinear(
            HIDDEN,
            [256, 256, 384, 384],  # a config from another model
            bias=False,
            quant_config=config_from_tensors(named),
            prefix=QKVZ,
            params_dtype=torch.float32,
        )


def _spec(prefix: str, n: int) -> Exl3ModuleSpec:
    return Exl3ModuleSpec(
        prefix,
        HIDDEN,
        n,
        4,
        Codebook.THREE_INST,
        False,
        False,
        (f"{prefix}.trellis", f"{prefix}.suh", f"{prefix}.svh"),
    )


def test_ambiguous_cut_is_an_error():
    # 100 | 20 + 100 and 100 + 20 | 100 both pad to 128 | 128.
    with pytest.raises(Exl3LayoutError, match=r"2 ways \(ambiguous\)"):
        plan_linear(
            "fused",
            [_spec("a", 128), _spec("b", 128)],
            split=Split.COLUMN,
            tp_rank=0,
            tp_size=1,
            k_width=HIDDEN,
            widths=[100, 20, 100],
        )


def test_windows_of_a_module_covering_three_shards_at_tp2():
    # q, k, v of 192, 192, 320 in one module: rank 1 owns q[96:192], k[96:192] and
    # v[160:320], i.e. module columns 96.., 288.., 544..; each computes its 128-blocks.
    layouts = [
        plan_linear(
            "qkvz",
            [_spec("qkv", 768), _spec("z", 384)],
            split=Split.COLUMN,
            tp_rank=rank,
            tp_size=WORLD,
            k_width=HIDDEN,
            widths=[96, 96, 160, 160],
        )
        for rank in range(WORLD)
    ]
    assert [
        [(s.module, s.src_col, s.alloc, s.keep, s.width) for s in layout.shards]
        for layout in layouts
    ] == [
        [
            (0, 0, 128, 0, 96),
            (0, 128, 256, 64, 96),
            (0, 384, 256, 0, 160),
            (1, 0, 256, 0, 160),
        ],
        [
            (0, 0, 256, 96, 96),
            (0, 256, 128, 32, 96),
            (0, 512, 256, 32, 160),
            (1, 128, 256, 32, 160),
        ],
    ]


def _rank_main(rank: int, init_file: str) -> None:
    # Runs in a spawned process: imports vLLM there.
    from .exl3_harness import gloo_world

    with gloo_world(WORLD, rank, init_file):
        for dims in DIMS:
            named = checkpoint(dims)
            layer = qkvz_layer(dims, named)
            key_dim, value_dim = DIMS[dims]
            assert layer.output_partition_sizes == [
                key_dim // WORLD,
                key_dim // WORLD,
                value_dim // WORLD,
                value_dim // WORLD,
            ]
            load(layer, named, QKV, (0, 1, 2))
            load(layer, named, Z, 3)
            finish(layer)
            x = x_in()
            assert_matches(
                layer(x)[0],
                expected(named, dims, x, rank, WORLD),
                f"rank {rank} qkvz {dims}",
            )
        named = vision_checkpoint()
        layer = vision_qkv_layer(named)
        load_unsharded(layer, named, VISION_QKV)
        finish(layer)
        x = x_in()
        assert_matches(
            layer(x)[0], vision_expected(named, x, rank, WORLD), f"rank {rank} qkv"
        )


def test_module_covering_three_shards_tp2(tmp_path, world1):
    # Spawned children re-import this module and its helpers from the parent's sys.path.
    mp.spawn(_rank_main, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True)


# A Qwen3.5 multimodal checkpoint as ExLlamaV3 1.6.5 writes it (architecture/qwen3_5.py,
# qwen3_vl.py), tiny dims: the text model under model.language_model, a Gated DeltaNet
# layer (in_proj_qkv, in_proj_z and out_proj EXL3, in_proj_b / in_proj_a fp16 at their
# real dims, conv, decay and norm as stored) and a gated full-attention layer, each with
# an EXL3 MLP (or, for the MoE class, per-expert EXL3 experts, an fp16 router and a
# gated EXL3 shared expert); the Qwen3-VL vision tower under model.visual with every
# linear EXL3 at its vision_bits and with its bias (the fused attn.qkv included); an
# EXL3 lm_head. Validated as vLLM's loader does, then vLLM's names (Qwen3-VL's prefix
# mapper, Qwen3.5's packed modules and stacked mapper) resolved and loaded.

VL_TEXT = "model.language_model"
VL_MAPPER_PREFIXES = {  # vllm/model_executor/models/qwen3_vl.py, Qwen3VLForCond...
    "model.visual.": "visual.",
    "lm_head.": "language_model.lm_head.",
    "model.language_model.": "language_model.model.",
}
VL_PACKED = {  # Qwen3_5ForConditionalGeneration.packed_modules_mapping
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "qkv": ["qkv"],
    "in_proj_qkvz": ["in_proj_qkv", "in_proj_z"],
    "in_proj_ba": ["in_proj_b", "in_proj_a"],
}
VOCAB, INTER, V_HEADS = 512, 512, 4
# The full-attention layer's heads (its q_proj carries the output gate: twice as wide).
HEADS, KV_HEADS, HEAD_DIM = 2, 1, 128
EXPERTS, TOP_K, EXPERT_INTER, SHARED_INTER = 4, 2, 128, 256
# The tower's MLP width, like the real one (4304), not a multiple of 128: ExLlamaV3
# stores those linears padded (fc1's n and bias, fc2's k), and vLLM builds them at 200.
VISION_INTER, PATCH, TEMPORAL_PATCH, MERGE = 200, 16, 2, 2
VISION_POSITIONS = 16  # a 4 x 4 grid
VISION_BITS = 6  # ExLlamaV3's default_vision_bits for the Qwen3-VL tower


def _plain(gen: torch.Generator, shape) -> torch.Tensor:
    return (0.02 * torch.randn(shape, generator=gen)).half()


def _mlp(gen, named: dict, prefix: str, inter: int) -> None:
    for proj in ("gate_proj", "up_proj"):
        named.update(_module(gen, f"{prefix}.{proj}", inter, 4, False))
    named.update(_module(gen, f"{prefix}.down_proj", HIDDEN, 4, False, k=inter))


def _text_layers(gen, named: dict, moe: bool) -> None:
    """Layer 0 Gated DeltaNet, layer 1 gated full attention, each with its MLP (or a
    MoE block with a gated shared expert), as ExLlamaV3's qwen3_5 writes them."""
    key_dim, value_dim = DIMS["aligned"]
    gdn = f"{VL_TEXT}.layers.0.linear_attn"
    named.update(_module(gen, f"{gdn}.in_proj_qkv", 2 * key_dim + value_dim, 4, False))
    named.update(_module(gen, f"{gdn}.in_proj_z", value_dim, 4, False))
    named.update(_module(gen, f"{gdn}.out_proj", HIDDEN, 4, False, k=value_dim))
    attn = f"{VL_TEXT}.layers.1.self_attn"
    named.update(_module(gen, f"{attn}.q_proj", 2 * HEADS * HEAD_DIM, 4, False))
    for proj in ("k_proj", "v_proj"):
        named.update(_module(gen, f"{attn}.{proj}", KV_HEADS * HEAD_DIM, 4, True))
    named.update(_module(gen, f"{attn}.o_proj", HIDDEN, 4, False, k=HEADS * HEAD_DIM))
    plain = {
        # Unquantized at their real dims (built without a qmap).
        f"{gdn}.in_proj_b.weight": (V_HEADS, HIDDEN),
        f"{gdn}.in_proj_a.weight": (V_HEADS, HIDDEN),
        f"{gdn}.conv1d.weight": (2 * key_dim + value_dim, 1, 4),
        f"{gdn}.A_log": (V_HEADS,),
        f"{gdn}.dt_bias": (V_HEADS,),
        f"{gdn}.norm.weight": (value_dim // V_HEADS,),
        f"{attn}.q_norm.weight": (HEAD_DIM,),
        f"{attn}.k_norm.weight": (HEAD_DIM,),
    }
    for layer in range(2):
        mlp = f"{VL_TEXT}.layers.{layer}.mlp"
        plain[f"{VL_TEXT}.layers.{layer}.input_layernorm.weight"] = (HIDDEN,)
        plain[f"{VL_TEXT}.layers.{layer}.post_attention_layernorm.weight"] = (HIDDEN,)
        if not moe:
            _mlp(gen, named, mlp, INTER)
            continue
        for e in range(EXPERTS):
            _mlp(gen, named, f"{mlp}.experts.{e}", EXPERT_INTER)
        _mlp(gen, named, f"{mlp}.shared_expert", SHARED_INTER)
        plain[f"{mlp}.gate.weight"] = (EXPERTS, HIDDEN)
        plain[f"{mlp}.shared_expert_gate.weight"] = (1, HIDDEN)
    for name, shape in plain.items():
        named[name] = _plain(gen, shape)


def _vision_tower(gen, named: dict) -> None:
    """The Qwen3-VL tower as ExLlamaV3's qwen3_vl writes it at vision_bits: every
    linear EXL3 with its bias (the fused attn.qkv included), patch embedding, position
    embedding and LayerNorms as stored."""
    v = "model.visual"
    merged = HIDDEN * MERGE**2
    linears = {
        f"{v}.blocks.0.attn.qkv": (HIDDEN, 3 * HIDDEN),
        f"{v}.blocks.0.attn.proj": (HIDDEN, HIDDEN),
        f"{v}.blocks.0.mlp.linear_fc1": (HIDDEN, VISION_INTER),
        f"{v}.blocks.0.mlp.linear_fc2": (VISION_INTER, HIDDEN),
        f"{v}.merger.linear_fc1": (merged, merged),
        f"{v}.merger.linear_fc2": (merged, HIDDEN),
    }
    for prefix, (k, n) in linears.items():
        named.update(_module(gen, prefix, n, VISION_BITS, False, k=-(-k // PAD) * PAD))
        # Zero-extended to the stored n, as ExLlamaV3 pads a bias when it loads one.
        bias = torch.zeros(-(-n // PAD) * PAD, dtype=torch.float16)
        bias[:n] = _plain(gen, (n,))
        named[f"{prefix}.bias"] = bias
    plain = {
        f"{v}.patch_embed.proj.weight": (HIDDEN, 3, TEMPORAL_PATCH, PATCH, PATCH),
        f"{v}.patch_embed.proj.bias": (HIDDEN,),
        f"{v}.pos_embed.weight": (VISION_POSITIONS, HIDDEN),
    }
    for norm in ("blocks.0.norm1", "blocks.0.norm2", "merger.norm"):
        plain[f"{v}.{norm}.weight"] = (HIDDEN,)
        plain[f"{v}.{norm}.bias"] = (HIDDEN,)
    for name, shape in plain.items():
        named[name] = _plain(gen, shape)


def qwen3_5_checkpoint(root, moe: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor ExLlamaV3 1.6.5 writes for Qwen3_5ForConditionalGeneration (with
    `moe`, Qwen3_5MoeForConditionalGeneration), and the config.json."""
    import json

    from safetensors.torch import save_file

    key_dim, value_dim = DIMS["aligned"]
    gen = torch.Generator().manual_seed(35)
    named: dict[str, torch.Tensor] = {}
    _text_layers(gen, named, moe)
    _vision_tower(gen, named)
    named.update(_module(gen, "lm_head", VOCAB, 4, False))
    for name, shape in {
        f"{VL_TEXT}.embed_tokens.weight": (VOCAB, HIDDEN),
        f"{VL_TEXT}.norm.weight": (HIDDEN,),
    }.items():
        named[name] = _plain(gen, shape)
    save_file(named, str(root / "model.safetensors"))
    text = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "linear_num_key_heads": key_dim // 128,
        "linear_num_value_heads": V_HEADS,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": value_dim // V_HEADS,
        "linear_conv_kernel_dim": 4,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [4, 6, 6],
        },
    }
    if moe:
        text.update(
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_INTER,
            shared_expert_intermediate_size=SHARED_INTER,
            norm_topk_prob=True,
        )
    vision = {
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "depth": 1,
        "hidden_size": HIDDEN,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": VISION_INTER,
        "num_heads": VISION_HEADS,
        "in_channels": 3,
        "patch_size": PATCH,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TEMPORAL_PATCH,
        "out_hidden_size": HIDDEN,
        "num_position_embeddings": VISION_POSITIONS,
    }
    config = {
        "architectures": [
            "Qwen3_5MoeForConditionalGeneration"
            if moe
            else "Qwen3_5ForConditionalGeneration"
        ],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": False,
        "quantization_config": {
            "quant_method": "exl3",
            "bits": 4.0,
            "head_bits": 4,
            "vision_bits": VISION_BITS,
        },
    }
    (root / "config.json").write_text(json.dumps(config))
    return named


@pytest.mark.usefixtures("world1")
def test_qwen3_5_multimodal_layout_validates_resolves_and_loads(tmp_path):
    from vllm.model_executor.layers.quantization.exl3.config import Exl3Config
    from vllm.model_executor.models.utils import WeightsMapper

    named = qwen3_5_checkpoint(tmp_path)
    config = Exl3Config.from_config({"quant_method": "exl3"})
    config.maybe_update_config(str(tmp_path))  # validate_checkpoint: must accept it
    config.packed_modules_mapping = dict(VL_PACKED)
    # vLLM hands the quant config the unstacked model mapper (model_loader/utils.py).
    config.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix=VL_MAPPER_PREFIXES))
    key_dim, value_dim = DIMS["aligned"]
    qkvz = MergedColumnParallelLinear(
        HIDDEN,
        [key_dim, key_dim, value_dim, value_dim],
        bias=False,
        quant_config=config,
        prefix="language_model.model.layers.0.linear_attn.in_proj_qkvz",
        params_dtype=torch.float32,
    )
    vision = QKVParallelLinear(
        HIDDEN,
        VISION_HEAD_DIM,
        VISION_HEADS,
        VISION_HEADS,
        bias=True,
        quant_config=config,
        prefix=VISION_QKV,
        params_dtype=torch.float32,
    )
    assert [s.name for s in qkvz.quant_method.layout.shards] == [
        f"{VL_TEXT}.layers.0.linear_attn.in_proj_qkv"
    ] * 3 + [f"{VL_TEXT}.layers.0.linear_attn.in_proj_z"]
    # The checkpoint's names through the model's mappers, as its loaders see them.
    model_mapper = WeightsMapper(orig_to_new_prefix=VL_MAPPER_PREFIXES)
    text_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".in_proj_qkv": (".in_proj_qkvz", (0, 1, 2)),
            ".in_proj_z": (".in_proj_qkvz", 3),
        }
    )
    for name, tensor in named.items():
        mapped = model_mapper._map_name(name)
        for layer, prefix in (
            (qkvz, "language_model.model.layers.0.linear_attn.in_proj_qkvz"),
            (vision, VISION_QKV),
        ):
            mapped_name, shard = text_mapper._map_name_with_shard(mapped)
            module, _, suffix = mapped_name.rpartition(".")
            if module != prefix:
                continue
            param = getattr(layer, suffix)
            args = () if shard is None else (shard,)
            param.weight_loader(param, tensor, *args)
    finish(qkvz)
    finish(vision)
    x = x_in()
    gdn = f"{VL_TEXT}.layers.0.linear_attn"
    ref = {
        f"{short}.{s}": named[f"{gdn}.{short.rpartition('.')[2]}.{s}"]
        for short in (QKV, Z)
        for s in ("trellis", "suh", "svh")
    }
    assert_matches(qkvz(x)[0], expected(ref, "aligned", x, 0, 1), "qwen3.5 qkvz")
    vis = {
        k.removeprefix("model."): v
        for k, v in named.items()
        if k.startswith(f"model.{VISION_QKV}.")
    }
    assert_matches(vision(x)[0], vision_expected(vis, x, 0, 1), "qwen3.5 vision qkv")


# The checkpoint above, whole, through vLLM's own model loader into vLLM 0.26's real
# Qwen3_5ForConditionalGeneration and Qwen3_5MoeForConditionalGeneration (the Qwen3-VL
# vision tower built and loaded too, or left out with language_model_only as
# `--language-model-only` serves it): every parameter written, every EXL3 linear
# against x @ W of its checkpoint modules decoded by the reference (in_proj_qkvz from
# in_proj_qkv's three shards and in_proj_z, the tower's fused qkv with its bias, the
# lm_head through compute_logits), the unquantized in_proj_ba as stored, the MoE blocks
# against the oracle.

# vLLM's fused layers and the checkpoint modules they are made of, in shard order.
VLLM_FUSED = {
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    # The tower's attention: fused on disk, or split as ExLlamaV3 writes it.
    "qkv": ("q_proj", "k_proj", "v_proj"),
}
MODEL_TOKENS = 7


def checkpoint_modules(vllm_name: str, named: dict) -> list[str]:
    """The checkpoint modules of a vLLM layer of the multimodal class (its name mapped
    back through Qwen3-VL's prefix mapper, a fused layer split into its parts unless
    the checkpoint stores it fused)."""
    for ckpt, vllm in VL_MAPPER_PREFIXES.items():
        if vllm_name.startswith(vllm):
            vllm_name = ckpt + vllm_name.removeprefix(vllm)
            break
    if vllm_name == "language_model.lm_head":
        vllm_name = "lm_head"
    parent, _, leaf = vllm_name.rpartition(".")
    if f"{vllm_name}.trellis" in named:
        return [vllm_name]
    return [f"{parent}.{part}" for part in VLLM_FUSED.get(leaf, (leaf,))]


def check_model_linears(model, vllm_config, named: dict) -> set[str]:
    """Every EXL3 linear of the model against the reference decode; returns the
    checkpoint modules checked."""
    from .moe_model_run import assert_linear_matches, exl3_linear_calls

    checked = set()
    calls = exl3_linear_calls(
        model, vllm_config, HIDDEN, torch.float16, 6, MODEL_TOKENS
    )
    for name, _, x, y in calls:
        modules = ["lm_head"] if name == "lm_head" else checkpoint_modules(name, named)
        w = torch.cat([dense(named, m).double()[: x.shape[1]] for m in modules], dim=1)
        expected = x.double() @ w
        if all(f"{m}.bias" in named for m in modules):
            expected += torch.cat([named[f"{m}.bias"].double() for m in modules])
        # A module stored padded past the layer's width (the tower's fc1): the padded
        # columns decode to exact zeros and their bias is zero, so the layer's output
        # is the leading columns.
        n = y.shape[-1]
        if len(modules) == 1 and n < expected.shape[1]:
            assert not expected[:, n:].any(), (name, "padding is not zero")
            expected = expected[:, :n]
        assert_linear_matches(y, expected, name)
        checked.update(modules)
    return checked


def record_passed_over(monkeypatch) -> set[str]:
    """Checkpoint tensors vLLM's AutoWeightsLoader skips or ignores without an error
    (it ignores any unexpected `.bias`, for GPTQ's sake), filled in as it loads."""
    from vllm.model_executor.models.utils import AutoWeightsLoader

    passed_over: set[str] = set()
    for method in ("_can_skip", "_can_ignore_unexpected"):
        original = getattr(AutoWeightsLoader, method)

        def wrapped(self, qualname, original=original):
            if original(self, qualname):
                passed_over.add(qualname)
                return True
            return False

        monkeypatch.setattr(AutoWeightsLoader, method, wrapped)
    return passed_over


def exl3_modules(named: dict) -> set[str]:
    return {k.removesuffix(".trellis") for k in named if k.endswith(".trellis")}


def load_qwen3_5(root, monkeypatch, moe: bool, language_model_only: bool):
    """(model, vllm_config, passed_over): vLLM's real Qwen3.5 class through its loader,
    every parameter written (the routed experts' are reported under the runner's name;
    the EXL3 MoE method checks every expert tensor arrived; a checkpoint tensor with no
    destination fails vLLM's loader by name)."""
    from vllm.model_executor.models.qwen3_5 import (
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForConditionalGeneration,
    )

    from .moe_model_run import load_model, record_unloaded

    cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    unloaded = record_unloaded(monkeypatch, cls)
    passed_over = record_passed_over(monkeypatch)
    model, vllm_config = load_model(
        root, monkeypatch, "float16", language_model_only=language_model_only
    )
    assert type(model) is cls
    unloaded = {n for n in unloaded if ".routed_experts." not in n}
    assert unloaded == set(), sorted(unloaded)
    return model, vllm_config, passed_over


@pytest.mark.parametrize(
    "moe, language_model_only",
    [(False, False), (True, False), (False, True)],
    ids=["dense", "moe", "dense-language-model-only"],
)
def test_qwen3_5_real_model_loads_the_exllamav3_checkpoint(
    moe, language_model_only, tmp_path, monkeypatch, world1
):
    from .moe_checkpoints import link_tokenizer
    from .moe_model_run import check_moe_blocks

    named = qwen3_5_checkpoint(tmp_path, moe=moe)
    link_tokenizer(tmp_path)
    model, vllm_config, passed_over = load_qwen3_5(
        tmp_path, monkeypatch, moe, language_model_only
    )
    # No tensor passed over either (with language_model_only the tower is a
    # StageMissingLayer, whose tensors vLLM drops before these checks).
    assert passed_over == set(), sorted(passed_over)
    tower = any(n.startswith("visual.") for n, _ in model.named_parameters())
    assert tower != language_model_only

    checked = check_model_linears(model, vllm_config, named)
    wanted = {
        m
        for m in exl3_modules(named)
        if ".experts." not in m
        and not (language_model_only and m.startswith("model.visual."))
    }
    assert checked == wanted, sorted(checked ^ wanted)
    gdn = model.language_model.model.layers[0].linear_attn
    assert [s.name for s in gdn.in_proj_qkvz.quant_method.layout.shards] == [
        f"{VL_TEXT}.layers.0.linear_attn.in_proj_qkv"
    ] * 3 + [f"{VL_TEXT}.layers.0.linear_attn.in_proj_z"]
    stored_ba = torch.cat(
        [named[f"{VL_TEXT}.layers.0.linear_attn.in_proj_{p}.weight"] for p in "ba"]
    )
    assert torch.equal(gdn.in_proj_ba.weight[: 2 * V_HEADS].cpu(), stored_ba)
    if moe:
        blocks = check_moe_blocks(
            tmp_path,
            model,
            vllm_config,
            checkpoint_name=lambda n: n.replace("language_model.model.", f"{VL_TEXT}."),
        )
        assert blocks == 2


# AutoWeightsLoader's error for a checkpoint tensor no module or parameter takes.
UNPLACED = "There is no module or parameter named"


def _stray_exl3(named, gen):
    named.update(
        _module(gen, f"{VL_TEXT}.layers.0.linear_attn.in_proj_w", 256, 4, False)
    )


def _stray_plain(named, gen):
    named[f"{VL_TEXT}.layers.0.linear_attn.gate_w.weight"] = _plain(gen, (4, HIDDEN))


def _stray_in_tower(named, gen):
    named.update(_module(gen, "model.visual.blocks.0.attn.extra", 256, 4, False))


def _without_in_proj_z(named, gen):
    for name in [n for n in named if ".linear_attn.in_proj_z." in n]:
        del named[name]


@pytest.mark.parametrize(
    "edit, message",
    [
        (_stray_exl3, rf"{UNPLACED} 'layers\.0\.linear_attn\.in_proj_w'"),
        (_stray_plain, rf"{UNPLACED} 'layers\.0\.linear_attn\.gate_w'"),
        (_stray_in_tower, rf"{UNPLACED} 'blocks\.0\.attn\.extra'"),
        (
            _without_in_proj_z,
            r"in_proj_qkvz: fused layer mixes EXL3 and non-EXL3 shards .*"
            r"in_proj_z -> not EXL3",
        ),
    ],
    ids=["exl3-module", "plain-tensor", "tower-module", "missing-in_proj_z"],
)
def test_qwen3_5_real_model_names_what_it_cannot_place(
    edit, message, tmp_path, monkeypatch, world1
):
    from safetensors.torch import save_file

    from .moe_checkpoints import link_tokenizer
    from .moe_model_run import load_model

    named = qwen3_5_checkpoint(tmp_path)
    edit(named, torch.Generator().manual_seed(8))
    save_file(named, str(tmp_path / "model.safetensors"))
    link_tokenizer(tmp_path)
    with pytest.raises((ValueError, Exl3LayoutError), match=message):
        load_model(tmp_path, monkeypatch, "float16")


# The Qwen3.5 fixtures ExLlamaV3 1.6.5's converter wrote (tests/fixtures/qwen3_5: the
# vision tower at 6 bits, the MTP layer at 4, head at 6), whole, through vLLM's loader
# into the real classes: every parameter written, the checkpoint's only tensors left
# over the MTP layer's (the draft model loads those), every EXL3 linear against the
# reference decode of its modules, the MoE blocks against the oracle.


def qwen3_5_fixture(root, kind: str) -> dict[str, torch.Tensor]:
    import shutil

    from safetensors.torch import load_file
    from vllm_exl3.testing.fixtures import QWEN3_5

    for src in (QWEN3_5 / f"{kind}-exl3-4.0bpw", QWEN3_5 / "tokenizer"):
        for f in src.iterdir():
            shutil.copy(f, root / f.name)
    return load_file(str(root / "model.safetensors"))


@pytest.mark.parametrize(
    "kind, language_model_only",
    [("dense", False), ("moe", False), ("moe", True)],
    ids=["dense", "moe", "moe-language-model-only"],
)
def test_qwen3_5_fixture_written_by_exllamav3_loads_and_decodes(
    kind, language_model_only, tmp_path, monkeypatch, world1
):
    from .moe_model_run import check_moe_blocks

    named = qwen3_5_fixture(tmp_path, kind)
    model, vllm_config, passed_over = load_qwen3_5(
        tmp_path, monkeypatch, kind == "moe", language_model_only
    )
    mtp = {n for n in named if n.startswith("mtp.")}
    assert mtp and {n for n in passed_over if not n.startswith("mtp.")} == set()
    checked = check_model_linears(model, vllm_config, named)
    wanted = {
        m
        for m in exl3_modules(named)
        if ".experts." not in m
        and not m.startswith("mtp.")
        and not (language_model_only and m.startswith("model.visual."))
    }
    assert checked == wanted, sorted(checked ^ wanted)
    if not language_model_only:
        assert any(m.startswith("model.visual.") for m in checked)
    if kind == "moe":
        blocks = check_moe_blocks(
            tmp_path,
            model,
            vllm_config,
            checkpoint_name=lambda n: n.replace("language_model.model.", f"{VL_TEXT}."),
        )
        assert blocks == 4


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_qwen3_5_fixture_mtp_draft_loads_its_stored_layer(
    kind, tmp_path, monkeypatch, world1
):
    """vLLM's Qwen3.5 MTP draft (speculative method "mtp" -> qwen3_5_mtp) builds from
    the fixture's `mtp.*` layer as ExLlamaV3 stored it (EXL3 at its MTP bits): fc,
    the decoder layer's linears (and, for the MoE model, its experts) EXL3, each EXL3
    linear of the draft equal to the reference decode of its checkpoint module."""
    from .moe_model_run import (
        assert_linear_matches,
        exl3_linear_calls,
        load_target_and_draft,
    )

    named = qwen3_5_fixture(tmp_path, kind)
    _, draft, vllm_config = load_target_and_draft(tmp_path, monkeypatch, "float16")
    assert type(draft).__name__ == ("Qwen3_5MoeMTP" if kind == "moe" else "Qwen3_5MTP")
    checked = set()
    for name, _, x, y in exl3_linear_calls(
        draft, vllm_config, HIDDEN, torch.float16, 6, MODEL_TOKENS
    ):
        if name == "lm_head":
            continue
        module = "mtp." + name.removeprefix("model.")
        parent, _, leaf = module.rpartition(".")
        modules = [f"{parent}.{p}" for p in VLLM_FUSED.get(leaf, (leaf,))]
        w = torch.cat([dense(named, m).double()[: x.shape[1]] for m in modules], dim=1)
        assert_linear_matches(y, x.double() @ w, name)
        checked.update(modules)
    wanted = {
        m for m in exl3_modules(named) if m.startswith("mtp.") and ".experts." not in m
    }
    assert checked == wanted, sorted(checked ^ wanted)
