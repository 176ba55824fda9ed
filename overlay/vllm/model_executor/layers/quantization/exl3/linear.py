# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`Exl3LinearMethod`: EXL3 for vLLM's Replicated, Column, MergedColumn, QKV and Row
linears; `Exl3LMHeadMethod` for its ParallelLMHead, and
`Exl3PaddedUnquantizedLinearMethod` for the linears the format keeps unquantized but
stores padded (both below).

The method describes the layer (its `Exl3Layout`) and loads it; after loading it picks
the layer's kernel (kernels.py: the CUDA op, or the reference codec on CPU), and `apply`
is that kernel's `apply_weights`.
"""

from collections.abc import Callable

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from .format import HADAMARD_SIZE, Exl3FormatError, Exl3ModuleSpec, round_up
from .kernels import Exl3Kernel, init_exl3_linear_kernel
from .layout import (
    Exl3Layout,
    Exl3LayoutError,
    Split,
    plan_linear,
    plan_lm_head,
)
from .weights import Exl3LayerWeights, LoadLedger, direct_weight_loader


def linear_split(layer: LinearBase) -> Split:
    if isinstance(layer, RowParallelLinear):
        return Split.ROW
    if isinstance(layer, ColumnParallelLinear):
        return Split.COLUMN
    if isinstance(layer, ReplicatedLinear):
        return Split.NONE
    raise Exl3LayoutError(
        f"EXL3 {layer.prefix}: unsupported linear class {type(layer).__name__}"
    )


def _fused_loader(loader, num_shards: int, one_module: bool):
    """vLLM's merged-column / QKV loader, except where it would split a checkpoint
    tensor by its own offsets: a module covering several shards arrives with the tuple
    of their ids (Qwen3.5's in_proj_qkv -> in_proj_qkvz (0, 1, 2)), or without a shard
    id when it covers the whole layer (Qwen3-Next's one-shard in_proj_qkvz, the
    Qwen3-VL vision tower's fused attn.qkv); the layout places those instead."""

    def load(param, loaded_weight, loaded_shard_id=None):
        if loaded_shard_id is None and one_module:
            loaded_shard_id = tuple(range(num_shards))
        if isinstance(loaded_shard_id, tuple):
            direct_weight_loader(param, loaded_weight, loaded_shard_id)
        else:
            loader(param, loaded_weight, loaded_shard_id)

    return load


class Exl3KernelMethod:
    """What the EXL3 linear and lm_head methods share: the model's record of loaded
    tensors (`ledger`, LoadLedger, weights.py; a private one when None), the layout and
    weights their create_weights plans, and, after loading, the kernel `apply` runs."""

    def __init__(self, ledger: LoadLedger | None):
        self.ledger = ledger if ledger is not None else LoadLedger()
        self.layout: Exl3Layout
        self.weights: Exl3LayerWeights
        self.kernel: Exl3Kernel

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.weights.finish(layer)
        self.kernel = init_exl3_linear_kernel(self.layout, layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.kernel.apply_weights(layer, x, bias)


@register_weight_loader_v2_supported_method
class Exl3LinearMethod(Exl3KernelMethod, LinearMethodBase):
    """One EXL3 linear layer; `specs` are its checkpoint modules in shard order."""

    def __init__(self, specs: list[Exl3ModuleSpec], ledger: LoadLedger | None = None):
        super().__init__(ledger)
        self.specs = specs

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
        split = linear_split(layer)
        for spec in self.specs:
            if spec.has_bias != bool(layer.has_bias):
                raise Exl3LayoutError(
                    f"EXL3 {spec.prefix}: the checkpoint "
                    f"{'has' if spec.has_bias else 'lacks'} "
                    f"a bias but the model builds {layer.prefix} "
                    f"{'with' if layer.has_bias else 'without'} one"
                )
        kv_replicas = None
        if isinstance(layer, QKVParallelLinear) and len(output_partition_sizes) == 3:
            r = layer.num_kv_head_replicas
            kv_replicas = [1, r, r]
        self.layout = plan_linear(
            layer.prefix,
            self.specs,
            split=split,
            tp_rank=layer.tp_rank,
            tp_size=layer.tp_size,
            k_width=input_size_per_partition,
            widths=output_partition_sizes,
            kv_replicas=kv_replicas,
        )
        # ReplicatedLinear's own loader only copies same-shaped tensors; everything
        # else goes through the layer's v2 loader, which calls Exl3Parameter.load_*.
        loader = (
            direct_weight_loader
            if split is Split.NONE
            else extra_weight_attrs["weight_loader"]
        )
        if isinstance(layer, (MergedColumnParallelLinear, QKVParallelLinear)):
            loader = _fused_loader(
                loader, len(output_partition_sizes), len(self.specs) == 1
            )
        ids = shard_ids(layer)
        real = None
        if len(ids) == len(self.layout.shards):
            real = []
            for m in range(len(self.specs)):
                group = tuple(ids[i] for i in self.layout.module_shards(m))
                if len(group) == len(ids):
                    rows = real_rows(layer, None)  # the module is the whole layer
                else:
                    rows = real_rows(layer, group[0] if len(group) == 1 else group)
                real.append((layer.input_size, rows))
        self.weights = Exl3LayerWeights(self.layout, self.specs, self.ledger, real)
        self.weights.create(layer, loader)
        # The checkpoint's bias is n_pad long; vLLM's bias loader wants the real n.
        unpad_bias_loads(layer, self.ledger)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        check_loaded(self.ledger, layer, ("bias",))
        super().process_weights_after_loading(layer)


# `Exl3LMHeadMethod`: an EXL3 `lm_head` as vLLM's ParallelLMHead.
#
# vLLM's vocab loader slices dim 0 and asserts the unpadded vocab; in a trellis the
# vocab is dim 1 and padded to 128. So the head has its own loader: each rank keeps the
# 128-aligned superset of checkpoint blocks covering its vocab range (vLLM pads the
# vocab to 64, so ranges need not be 128-aligned), and returns exactly
# `num_embeddings_per_partition` columns, those past the real vocab exactly zero
# (layout.plan_lm_head).


class Exl3LMHeadMethod(Exl3KernelMethod, QuantizeMethodBase):
    def __init__(
        self, prefix: str, spec: Exl3ModuleSpec, ledger: LoadLedger | None = None
    ):
        super().__init__(ledger)
        self.prefix = prefix
        self.spec = spec

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
        if layer.num_added_embeddings:
            raise Exl3LayoutError(
                f"EXL3 {self.prefix}: added (LoRA) vocabulary is not supported with an "
                "EXL3 "
                f"lm_head ({layer.num_added_embeddings} added tokens)"
            )
        self.layout = plan_lm_head(
            self.prefix,
            self.spec,
            tp_rank=get_tensor_model_parallel_rank(),
            hidden=input_size_per_partition,
            vocab_start=layer.shard_indices.padded_org_vocab_start_index,
            vocab_per_rank=output_partition_sizes[0],
            org_vocab=layer.org_vocab_size,
        )
        self.weights = Exl3LayerWeights(
            self.layout,
            [self.spec],
            self.ledger,
            [(input_size_per_partition, layer.org_vocab_size)],
        )
        self.weights.create(layer, direct_weight_loader)

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module):
        raise Exl3LayoutError(
            f"EXL3 {self.prefix}: an EXL3 lm_head cannot be tied to the token "
            "embedding (the "
            "converter always writes a separate head and sets "
            "tie_word_embeddings=false)"
        )


# Checkpoint tensors that vLLM's own loaders place, stored 128-padded by the format.
#
# ExLlamaV3 pads every linear's k and n to multiples of 128 (docs/design/exl3_format.md
# §1.7), including the linears it keeps unquantized (`.weight` of shape (n_pad, k_pad))
# and every `.bias` (n_pad). vLLM allocates the model's real dims and asserts equal
# shapes, so such a tensor is trimmed back to the real dims of its shard *before* vLLM's
# loader runs; the loader's tensor-parallel narrowing then works on the real tensor as
# usual. A stored shape that is neither the real dims nor the real dims rounded up to
# 128 is an error. Every load is recorded in the model's ledger (weights.LoadLedger), so
# a weight or bias the checkpoint never provides is an error after loading, not
# uninitialised memory.

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
        self, layer: torch.nn.Module, *args, **extra_weight_attrs
    ) -> None:
        """vLLM's (its arguments passed on), with the weight's and the bias's loads
        trimmed of the stored padding and recorded in the ledger."""
        extra_weight_attrs["weight_loader"] = unpadding_loader(
            layer, extra_weight_attrs["weight_loader"], self.ledger
        )
        super().create_weights(layer, *args, **extra_weight_attrs)
        unpad_bias_loads(layer, self.ledger)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        check_loaded(self.ledger, layer, ("weight", "bias"))
        super().process_weights_after_loading(layer)
