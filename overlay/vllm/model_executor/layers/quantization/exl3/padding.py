# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checkpoint tensors that vLLM's own loaders place, stored 128-padded by the format.

ExLlamaV3 pads every linear's k and n to multiples of 128 (docs/design/exl3_format.md
§1.7), including the linears it keeps unquantized (`.weight` of shape (n_pad, k_pad))
and every `.bias` (n_pad). vLLM allocates the model's real dims and asserts equal
shapes, so such a tensor is trimmed back to the real dims of its shard *before* vLLM's
loader runs; the loader's tensor-parallel narrowing then works on the real tensor as
usual. A stored shape that is neither the real dims nor the real dims rounded up to 128
is an error. Every load is recorded in the model's ledger (weights.LoadLedger), so a
weight or bias the checkpoint never provides is an error after loading, not
uninitialised memory.
"""

from collections.abc import Callable

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)

from .format import HADAMARD_SIZE, Exl3FormatError
from .tp_rules import round_up
from .weights import LoadLedger

ShardId = int | str | tuple[int, ...] | None


def shard_ids(layer: LinearBase) -> list[int | str | None]:
    """The shard ids vLLM's loaders pass for the layer's checkpoint tensors in order."""
    if isinstance(layer, QKVParallelLinear) and len(layer.output_sizes) == 3:
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


def _ledger_names(param: str, shard_id: ShardId) -> list[str]:
    if shard_id is None:
        return [param]
    ids = shard_id if isinstance(shard_id, tuple) else (shard_id,)
    return [f"{param}[{i}]" for i in ids]


def check_loaded(
    ledger: LoadLedger, layer: LinearBase, params: tuple[str, ...]
) -> None:
    """After loading: each of `params` the layer has was written whole or shard by
    shard."""
    expected = []
    for param in params:
        if getattr(layer, param, None) is None:
            continue
        ids = shard_ids(layer)
        if ids == [None] or ledger.written(layer, param):
            expected.append(param)
        else:
            expected += [name for i in ids for name in _ledger_names(param, i)]
    ledger.check(layer, layer.prefix, expected, rank=layer.tp_rank)


def real_rows(layer: LinearBase, shard_id: int | str | tuple[int, ...] | None) -> int:
    """Output features of the checkpoint tensor for this shard (all ranks, unpadded)."""
    if isinstance(layer, QKVParallelLinear):
        # From the head counts, not output_sizes: those count KV heads replicated
        # across ranks.
        sizes = {
            "q": layer.total_num_heads * layer.head_size,
            "k": layer.total_num_kv_heads * layer.head_size,
            "v": layer.total_num_kv_heads * layer.v_head_size,
        }
        return sum(sizes.values()) if shard_id is None else sizes[shard_id]
    if isinstance(layer, MergedColumnParallelLinear) and shard_id is not None:
        ids = shard_id if isinstance(shard_id, tuple) else (shard_id,)
        return sum(layer.output_sizes[i] for i in ids)
    return layer.output_size


def unpad(where: str, loaded: torch.Tensor, real: tuple[int, ...]) -> torch.Tensor:
    """`loaded` cut to `real` if it is exactly `real` rounded up to 128 in every dim."""
    stored = tuple(loaded.shape)
    if stored == real:
        return loaded
    padded = tuple(round_up(d, HADAMARD_SIZE) for d in real)
    if stored != padded:
        raise Exl3FormatError(
            f"EXL3 {where}: stored shape {list(stored)}, expected the layer's "
            f"{list(real)} or "
            f"that padded to multiples of {HADAMARD_SIZE}, {list(padded)}"
        )
    # Only cut, never check the cut region: padded output rows (and bias entries) are
    # zero by construction, and padded input columns may hold anything because the
    # format zero-extends x there, so neither ever reaches a real output.
    for dim, size in enumerate(real):
        loaded = loaded.narrow(dim, 0, size)
    return loaded


def unpadding_loader(
    layer: LinearBase, loader: Callable, ledger: LoadLedger | None = None
) -> Callable:
    """`loader` (any of vLLM's linear weight loaders) fed the tensor trimmed to the real
    dims of the shard it belongs to: (n, k) for the weight, (n,) for the bias; each load
    recorded in `ledger`."""

    def load(param: torch.nn.Parameter, loaded: torch.Tensor, *args, **kwargs) -> None:
        shard_id = args[0] if args else kwargs.get("loaded_shard_id")
        is_bias = param is getattr(layer, "bias", None)
        if ledger is not None:
            for name in _ledger_names("bias" if is_bias else "weight", shard_id):
                ledger.record(layer, layer.prefix, name)
        real = (
            (real_rows(layer, shard_id),)
            if is_bias
            else (real_rows(layer, shard_id), layer.input_size)
        )
        where = f"{layer.prefix}.{'bias' if is_bias else 'weight'}"
        if shard_id is not None:
            where += f" (shard {shard_id})"
        loader(param, unpad(where, loaded, real), *args, **kwargs)

    return load


def unpad_bias_loads(layer: LinearBase, ledger: LoadLedger | None = None) -> None:
    """Route the layer's `.bias` (created by vLLM after `create_weights`, with the
    layer's `weight_loader`) through `unpadding_loader`. Called from `create_weights`.
    """
    # An instance attribute shadows the method, and vLLM reads `self.weight_loader`
    # when it creates the bias, right after create_weights returns.
    layer.weight_loader = unpadding_loader(layer, layer.weight_loader, ledger)


@register_weight_loader_v2_supported_method
class Exl3PaddedUnquantizedLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized linear for an EXL3 checkpoint: weight and bias may be stored
    128-padded, and must be written exactly once."""

    def __init__(self, ledger: LoadLedger | None = None):
        super().__init__()
        self.ledger = ledger if ledger is not None else LoadLedger()

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        extra_weight_attrs["weight_loader"] = unpadding_loader(
            layer, extra_weight_attrs["weight_loader"], self.ledger
        )
        super().create_weights(
            layer,
            input_size_per_partition,
            output_partition_sizes,
            input_size,
            output_size,
            params_dtype,
            **extra_weight_attrs,
        )
        unpad_bias_loads(layer, self.ledger)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        check_loaded(self.ledger, layer, ("weight", "bias"))
        super().process_weights_after_loading(layer)
