# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Bad EXL3 MoE checkpoints fail closed, naming the checkpoint tensor and the rule: a
missing expert, an expert of another shape, a bitrate quantization_config.json does not
claim, mixed codebooks in one layer, a tensor never loaded, a tensor loaded twice. Each
starts from the real qwen3moe-e16 3.0 bpw subset and changes one thing."""

from __future__ import annotations

import json

import pytest
import torch
from moe_checkpoints import assemble
from safetensors.torch import load_file, save_file
from test_exl3_moe_layer import build_moe, run_moe

NAME = "qwen3moe-e16-3.0bpw-mcg"
EXPERTS = "model.layers.0.mlp.experts"


def edited(tmp_path, edit_tensors=None, edit_storage=None):
    """The assembled fixture with its safetensors and/or tensor_storage edited in
    place.
    """
    ckpt = assemble(NAME, tmp_path / "ckpt")
    if edit_tensors is not None:
        named = load_file(str(ckpt / "model.safetensors"))
        edit_tensors(named)
        save_file(named, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    if edit_storage is not None:
        path = ckpt / "quantization_config.json"
        document = json.loads(path.read_text())
        edit_storage(document["tensor_storage"])
        path.write_text(json.dumps(document))
    return ckpt


def drop(prefix):
    def edit(named):
        for k in [k for k in named if k.startswith(prefix + ".")]:
            del named[k]

    return edit


def test_missing_expert(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    ckpt = edited(
        tmp_path, drop(f"{EXPERTS}.5.up_proj"), lambda s: s.pop(f"{EXPERTS}.5.up_proj")
    )
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}\.5\.up_proj\.trellis: missing "
        r"tensor \(expert 5's up projection",
    ):
        build_moe(ckpt, EXPERTS)


def test_expert_of_another_shape(tmp_path, world1):
    from exl3_harness import config_from_tensors
    from vllm.model_executor.layers.quantization.exl3.checkpoint_files import (
        Exl3FormatError,
    )
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    def widen(named):
        p = f"{EXPERTS}.3.gate_proj"
        named[f"{p}.trellis"] = torch.cat([named[f"{p}.trellis"]] * 2, dim=1)
        named[f"{p}.svh"] = torch.cat([named[f"{p}.svh"]] * 2)

    ckpt = edited(tmp_path, widen)
    # A local checkpoint: the whole-checkpoint validation rejects it against
    # config.json.
    with pytest.raises(
        Exl3FormatError,
        match=rf"{EXPERTS}\.3\.gate_proj\.trellis: stored "
        r"k x n = 256 x 256, but config.json .* implies 256 x 128",
    ):
        build_moe(ckpt, EXPERTS)
    # Described from its headers alone (as a hub checkpoint is): the MoE layer rejects
    # it.
    config = config_from_tensors(load_file(str(ckpt / "model.safetensors")))
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}\.3\.gate_proj\.trellis: expert of "
        r"shape k=256, n=256; the model's gate projection is k=256, n=128",
    ):
        build_moe(ckpt, EXPERTS, config=config)


def test_bitrate_the_config_does_not_claim(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    def four_bits(named):
        p = f"{EXPERTS}.7.down_proj"
        t = named[f"{p}.trellis"]
        named[f"{p}.trellis"] = torch.cat(
            [t, t[..., :16]], dim=-1
        )  # 48 -> 64 words: 4 bits

    ckpt = edited(tmp_path, four_bits)
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}\.7\.down_proj\.trellis: 4 bits per "
        r"weight \(trellis width 64\), but quantization_config.json claims 3",
    ):
        build_moe(ckpt, EXPERTS)


def test_mixed_codebooks(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    def three_inst(named):
        del named[f"{EXPERTS}.2.up_proj.mcg"]

    def storage(s):
        s[f"{EXPERTS}.2.up_proj"].pop("mcg_multiplier")
        s[f"{EXPERTS}.2.up_proj"]["stored_tensors"].pop(f"{EXPERTS}.2.up_proj.mcg")

    ckpt = edited(tmp_path, three_inst, storage)
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}: the experts of one layer mix "
        r"codebooks \(.*THREE_INST",
    ):
        build_moe(ckpt, EXPERTS)


def _load_all_but(ckpt, skip: str | None, twice: str | None = None):
    """FusedMoE for the fixture layer, fed every expert tensor except `skip` (one
    `twice`)."""
    from exl3_harness import config_for
    from moe_oracle import softmax_topk
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoE

    get_current_vllm_config().compilation_config.static_forward_context.pop(
        EXPERTS, None
    )
    moe = FusedMoE(
        num_experts=16,
        top_k=4,
        hidden_size=256,
        intermediate_size=128,
        params_dtype=torch.float32,
        quant_config=config_for(ckpt),
        prefix=EXPERTS,
        custom_routing_function=softmax_topk,
    )
    named = load_file(str(ckpt / "model.safetensors"))
    weights = [
        (k[len(EXPERTS) + 1 :], v)
        for k, v in named.items()
        if k.startswith(EXPERTS + ".") and k != skip
    ]
    if twice is not None:
        weights.append((twice[len(EXPERTS) + 1 :], named[twice]))
    for _ in moe.load_weights(iter(weights)):
        pass
    moe.routed_experts.quant_method.process_weights_after_loading(moe.routed_experts)
    return moe


def test_tensor_never_loaded(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    ckpt = assemble(NAME, tmp_path / "ckpt")
    with pytest.raises(
        Exl3LayoutError,
        match=rf"checkpoint tensors never loaded: "
        rf"{EXPERTS}\.9\.down_proj\.svh$",
    ):
        _load_all_but(ckpt, f"{EXPERTS}.9.down_proj.svh")


def test_tensor_loaded_twice(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    ckpt = assemble(NAME, tmp_path / "ckpt")
    name = f"{EXPERTS}.4.gate_proj.trellis"
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{name} -> {EXPERTS} \(rank 0\): region "
        rf"already written by {name}",
    ):
        _load_all_but(ckpt, None, twice=name)


def test_wrong_marker_value(tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    def corrupt(named):
        named[f"{EXPERTS}.11.down_proj.mcg"] = torch.tensor(12345, dtype=torch.int32)

    ckpt = edited(tmp_path, corrupt)
    with pytest.raises(
        Exl3LayoutError,
        match=rf"{EXPERTS}\.11\.down_proj\.mcg \(rank 0\): "
        r"marker value 12345",
    ):
        _load_all_but(ckpt, None)


def test_complete_load_runs(tmp_path, world1):
    """The control: the unedited subset loads by the same path and computes finite
    output."""
    ckpt = assemble(NAME, tmp_path / "ckpt")
    moe = _load_all_but(ckpt, None)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    y = run_moe(
        moe, x, torch.randn(5, 16, generator=torch.Generator().manual_seed(2)), world1
    )
    assert y.shape == (5, 256) and torch.isfinite(y).all() and y.abs().max() > 0
