# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`Exl3LinearMethod`: EXL3 for vLLM's Replicated, Column, MergedColumn, QKV and Row
linears, and `Exl3LMHeadMethod` for its ParallelLMHead (below).

The path of one forward: `apply` -> `run_layout` (pad x to the allocated k, one kernel
call per run of equal-bitrate shards over the shards' 128-aligned windows, then, only if
some shard keeps part of its window, one gather of the kept columns) ->
`Exl3Kernel.apply` (the CUDA op, or the reference codec on CPU).
"""

import torch
import torch.nn.functional as F
import vllm.envs as envs
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from .format import TILE, Exl3ModuleSpec
from .kernels import Exl3Kernel, Exl3KernelConfig, Exl3Run, choose_exl3_kernel
from .layout import (
    Exl3Layout,
    Exl3LayoutError,
    Split,
    plan_linear,
    plan_lm_head,
    trellis_words,
)
from .padding import check_loaded, real_rows, shard_ids, unpad_bias_loads
from .plans import layer_key, resolve_runs, tune_run, warm_up_layer
from .weights import OUT_INDEX, Exl3LayerWeights, LoadLedger, direct_weight_loader


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


def run_layout(
    kernel: Exl3Kernel,
    layout: Exl3Layout,
    layer: torch.nn.Module,
    x: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """y = x @ W (+ bias) for the layer's shards on this rank, in x.dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if layout.k_alloc != layout.k_width:
        x2 = F.pad(x2, (0, layout.k_alloc - layout.k_width))
    x2 = x2.contiguous()
    fuse_bias = bias is not None and len(layout.runs) == 1 and layout.identity_output
    storage = layer.trellis.view(-1)
    ys = []
    for i, run in enumerate(layout.runs):
        trellis = storage[run.word_start : run.word_stop].view(
            layout.k_alloc // TILE, run.cols // TILE, trellis_words(run.bits)
        )
        ys.append(
            kernel.apply(
                x2,
                trellis,
                layer.suh[run.first : run.stop],
                layer.svh[run.col : run.col + run.cols],
                bias if fuse_bias else None,
                list(run.shard_widths),
                int(run.codebook),
                i,
            )
        )
    if not ys:
        y = x2.new_zeros((x2.shape[0], 0))
    else:
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    if not layout.identity_output:
        # One gather of m x out_width elements, a copy of the output: small next to the
        # GEMM that produced it, and a single shape-static op for torch.compile and
        # CUDA graphs.
        y = y.index_select(1, getattr(layer, OUT_INDEX))
    if bias is not None and not fuse_bias:
        y = y + bias
    return y.reshape(*lead, layout.out_width)


def layer_runs(layout: Exl3Layout, layer: torch.nn.Module) -> list[Exl3Run]:
    storage = layer.trellis.view(-1)
    runs = []
    for run in layout.runs:
        trellis = storage[run.word_start : run.word_stop].view(
            layout.k_alloc // TILE, run.cols // TILE, trellis_words(run.bits)
        )
        key = layer_key(
            layout.k_alloc,
            run.cols,
            run.bits,
            int(run.codebook),
            len(run.shard_widths),
            layer.params_dtype,
        )
        runs.append(
            Exl3Run(
                key,
                trellis,
                layer.suh[run.first : run.stop],
                layer.svh[run.col : run.col + run.cols],
                list(run.shard_widths),
                int(run.codebook),
            )
        )
    return runs


def warm_up(kernel: Exl3Kernel, layout: Exl3Layout, layer: torch.nn.Module) -> None:
    """Prepare the kernel's plans and workspace, then warm the layer up (plans.py)."""
    if not kernel.uses_plans:
        return
    runs = layer_runs(layout, layer)
    if envs.VLLM_EXL3_TUNE:
        for run in runs:
            tune_run(run, layer.params_dtype)
    kernel.prepare(runs)
    resolve_runs(runs, getattr(kernel, "run_plans", []), layer.params_dtype)
    key = (
        str(layer.trellis.device),
        layer.params_dtype,
        layout.k_alloc,
        tuple((r.bits, int(r.codebook), r.shard_widths) for r in layout.runs),
    )
    warm_up_layer(
        key,
        layout.k_width,
        layout.out_width,
        layer.params_dtype,
        layer.trellis.device,
        lambda x: run_layout(kernel, layout, layer, x, None),
    )


def _single_shard_loader(loader):
    def load(param, loaded_weight, loaded_shard_id=None):
        loader(param, loaded_weight, 0 if loaded_shard_id is None else loaded_shard_id)

    return load


@register_weight_loader_v2_supported_method
class Exl3LinearMethod(LinearMethodBase):
    """One EXL3 linear layer; `specs` are its checkpoint modules in shard order,
    `ledger` the model's record of loaded tensors (LoadLedger, weights.py)."""

    def __init__(self, specs: list[Exl3ModuleSpec], ledger: LoadLedger | None = None):
        self.specs = specs
        self.ledger = ledger if ledger is not None else LoadLedger()
        self.layout: Exl3Layout
        self.weights: Exl3LayerWeights
        self.kernel: Exl3Kernel

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
        if (
            isinstance(layer, MergedColumnParallelLinear)
            and len(output_partition_sizes) == 1
        ):
            # A one-shard merged layer (Qwen3-Next's in_proj_qkvz): models load its
            # single checkpoint module without a shard id, which vLLM would split by
            # its own offsets.
            loader = _single_shard_loader(loader)
        ids = shard_ids(layer)
        real = (
            [(layer.input_size, real_rows(layer, i)) for i in ids]
            if len(ids) == len(self.specs)
            else None
        )
        self.weights = Exl3LayerWeights(self.layout, self.specs, self.ledger, real)
        self.weights.create(layer, loader)
        # The checkpoint's bias is n_pad long; vLLM's bias loader wants the real n.
        unpad_bias_loads(layer, self.ledger)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        check_loaded(self.ledger, layer, ("bias",))
        self.weights.finish(layer)
        self.kernel = choose_exl3_kernel(
            Exl3KernelConfig(
                self.layout.prefix, layer.trellis.device, layer.params_dtype
            )
        )
        warm_up(self.kernel, self.layout, layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return run_layout(self.kernel, self.layout, layer, x, bias)


# `Exl3LMHeadMethod`: an EXL3 `lm_head` as vLLM's ParallelLMHead.
#
# vLLM's vocab loader slices dim 0 and asserts the unpadded vocab; in a trellis the
# vocab is dim 1 and padded to 128. So the head has its own loader: each rank keeps the
# 128-aligned superset of checkpoint blocks covering its vocab range (vLLM pads the
# vocab to 64, so ranges need not be 128-aligned), and returns exactly
# `num_embeddings_per_partition` columns, those past the real vocab exactly zero
# (layout.plan_lm_head).


class Exl3LMHeadMethod(QuantizeMethodBase):
    def __init__(
        self, prefix: str, spec: Exl3ModuleSpec, ledger: LoadLedger | None = None
    ):
        self.prefix = prefix
        self.spec = spec
        self.ledger = ledger if ledger is not None else LoadLedger()
        self.layout: Exl3Layout
        self.weights: Exl3LayerWeights
        self.kernel: Exl3Kernel

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

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.weights.finish(layer)
        self.kernel = choose_exl3_kernel(
            Exl3KernelConfig(self.prefix, layer.trellis.device, layer.params_dtype)
        )
        warm_up(self.kernel, self.layout, layer)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return run_layout(self.kernel, self.layout, layer, x, bias)

    def tie_weights(self, layer: torch.nn.Module, embed_tokens: torch.nn.Module):
        raise Exl3LayoutError(
            f"EXL3 {self.prefix}: an EXL3 lm_head cannot be tied to the token "
            "embedding (the "
            "converter always writes a separate head and sets "
            "tie_word_embeddings=false)"
        )
