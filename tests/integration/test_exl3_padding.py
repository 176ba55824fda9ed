# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A model whose real dims are not multiples of 128 (hidden 320, stored 384,
exl3-format.md §1.7): EXL3 linears and unquantized linears (fp16 `.weight` (n_pad,
k_pad), `.bias` n_pad) of one hand-made in-memory checkpoint, loaded through vLLM 0.26's
real layers and loaders at world size 1, against the dense product with the padding cut
off."""

from __future__ import annotations

import pytest
import torch
from exl3_harness import assert_matches, config_from_tensors, dense, load_module
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.quantization.exl3.format import Exl3FormatError
from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod
from vllm.model_executor.layers.quantization.exl3.padding import (
    Exl3PaddedUnquantizedLinearMethod,
)

pytestmark = pytest.mark.usefixtures("world1")

ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
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
