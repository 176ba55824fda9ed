# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""An EXL3 checkpoint linear that the model consumes as a dense weight.

MLA's `kv_b_proj` is never run as a GEMM of its own: after loading, vLLM's MLA attention
reads its weight (`get_and_maybe_dequant_weights`) and absorbs it into W_UK / W_UV.
ExLlamaV3 keeps kv_b_proj unquantized, but a checkpoint that stores it as EXL3 is loaded
as EXL3 (every tensor checked and placed as for any EXL3 linear), reconstructed once
into a dense `weight` of the layer's own rank slice, and from then on is vLLM's
unquantized linear.
"""

import torch
from vllm.model_executor.layers.linear import (
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)

from .format import DATA_SUFFIXES, Exl3ModuleSpec
from .linear import Exl3LinearMethod
from .weights import OUT_INDEX

# Checkpoint linears whose vLLM model reads a dense weight instead of calling the layer.
DENSE_CONSUMED = ("kv_b_proj",)


@register_weight_loader_v2_supported_method
class Exl3DequantizedLinearMethod(UnquantizedLinearMethod):
    """Loads like `Exl3LinearMethod`, then holds W [n_rank, k] in the layer's dtype."""

    def __init__(self, specs: list[Exl3ModuleSpec]):
        super().__init__()
        self.exl3 = Exl3LinearMethod(specs)

    def create_weights(self, layer: torch.nn.Module, *args, **kwargs) -> None:
        """Exl3LinearMethod.create_weights (vLLM's arguments, passed on)."""
        self.exl3.create_weights(layer, *args, **kwargs)

    @torch.no_grad()
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.exl3.process_weights_after_loading(layer)
        # x @ W for x = I is W itself, computed by the layer's own EXL3 path (its
        # tensor-parallel slice, padding and shard windows included).
        k = self.exl3.layout.k_width
        eye = torch.eye(k, dtype=layer.params_dtype, device=layer.trellis.device)
        weight = self.exl3.apply(layer, eye).t().contiguous()
        for name in DATA_SUFFIXES:
            delattr(layer, name)
        if hasattr(layer, OUT_INDEX):
            delattr(layer, OUT_INDEX)
        layer.register_parameter(
            "weight", torch.nn.Parameter(weight, requires_grad=False)
        )
        super().process_weights_after_loading(layer)
