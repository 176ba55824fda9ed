# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`Exl3LMHeadMethod`: an EXL3 `lm_head` as vLLM's ParallelLMHead.

vLLM's vocab loader slices dim 0 and asserts the unpadded vocab; in a trellis the vocab
is dim 1 and padded to 128. So the head has its own loader: each rank keeps the
128-aligned superset of checkpoint blocks covering its vocab range (vLLM pads the vocab
to 64, so ranges need not be 128-aligned), and returns exactly
`num_embeddings_per_partition` columns, those past the real vocab exactly zero
(layout.plan_lm_head).
"""

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from .format import Exl3ModuleSpec
from .kernels import Exl3Kernel, Exl3KernelConfig, choose_exl3_kernel
from .layout import Exl3Layout, Exl3LayoutError, plan_lm_head
from .linear import run_layout, warm_up
from .load_ledger import LoadLedger
from .weights import Exl3LayerWeights, direct_weight_loader


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
