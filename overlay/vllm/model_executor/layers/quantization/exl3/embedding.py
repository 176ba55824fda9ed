# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`Exl3EmbeddingMethod`: a quantized token embedding (`--embed_bits`,
docs/design/exl3_format.md §8) as vLLM's VocabParallelEmbedding.

vLLM shards the vocabulary: rank r holds `num_embeddings_per_partition` rows (the
vocabulary padded to 64 and split evenly), of which the checkpoint's rows
[org_vocab_start_index, org_vocab_end_index) are real; its forward maps each token id to
a row of this rank (ids of other ranks to row 0, their output zeroed afterwards) and
all-reduces. So each rank keeps exactly its rows of `trellis` (whole rows: any split
point works) and the whole `signs`; padding rows are zero words, whose scale 0 decodes
to exact zeros, as vLLM zero-fills an unquantized table's padding.

The path of one lookup: `embedding` -> the chosen kernel (embedding_kernels.py: the CUDA
row gather, or the reference decode on CPU) -> rows in the model's dtype. Only looked-up
rows are decoded; the table is never held decoded.
"""

import torch
from torch.nn import Parameter
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

from .embedding_kernels import (
    Exl3EmbeddingKernel,
    Exl3EmbeddingKernelConfig,
    choose_exl3_embedding_kernel,
)
from .format import (
    EMBED_GROUP,
    EMBED_SIGNS_SUFFIX,
    Exl3EmbeddingSpec,
    Exl3FormatError,
    check_embedding_signs,
)
from .layout import Exl3LayoutError
from .weights import LoadLedger

TRELLIS = "trellis"


class Exl3EmbeddingMethod(QuantizeMethodBase):
    """One quantized token embedding on one rank; `spec` is its checkpoint container,
    `ledger` the model's record of loaded tensors (weights.LoadLedger)."""

    def __init__(
        self, prefix: str, spec: Exl3EmbeddingSpec, ledger: LoadLedger | None = None
    ):
        self.prefix = prefix
        self.spec = spec
        self.ledger = ledger if ledger is not None else LoadLedger()
        self.hidden = 0  # the model's hidden size, set by create_weights
        self.rank = 0
        self.kernel: Exl3EmbeddingKernel

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
        spec = self.spec
        if layer.num_added_embeddings:
            raise Exl3LayoutError(
                f"EXL3 {self.prefix}: added (LoRA) vocabulary is not supported with a "
                f"quantized token embedding ({layer.num_added_embeddings} added tokens)"
            )
        if spec.rows != layer.org_vocab_size:
            raise Exl3FormatError(
                f"{spec.prefix}.{TRELLIS}: {spec.rows} rows, but the model builds "
                f"{self.prefix} with a vocabulary of {layer.org_vocab_size} "
                "(quantized token embedding)"
            )
        problem = spec.hidden_problem(input_size_per_partition)
        if problem:
            raise Exl3FormatError(problem)
        self.hidden = input_size_per_partition
        self.rank = get_tensor_model_parallel_rank()
        rows = output_partition_sizes[0]
        trellis = Parameter(
            torch.zeros(rows, spec.row_words, dtype=torch.int16), requires_grad=False
        )
        signs = Parameter(
            torch.empty(spec.groups, EMBED_GROUP, dtype=torch.float16),
            requires_grad=False,
        )
        trellis.weight_loader = self._trellis_loader(layer)
        signs.weight_loader = self._signs_loader(layer)
        layer.register_parameter(TRELLIS, trellis)
        layer.register_parameter(EMBED_SIGNS_SUFFIX, signs)

    def _check_loaded(self, suffix: str, loaded: torch.Tensor, shape, dtype) -> None:
        if loaded.dtype != dtype or tuple(loaded.shape) != shape:
            raise Exl3FormatError(
                f"{self.spec.prefix}.{suffix}: {loaded.dtype} {list(loaded.shape)} "
                f"arrived, expected {dtype} {list(shape)} (quantized token embedding)"
            )

    def _trellis_loader(self, layer: torch.nn.Module):
        """This rank's rows of the table; the rest of the partition stays zero."""

        def load(param: Parameter, loaded: torch.Tensor) -> None:
            self.ledger.record(layer, self.prefix, TRELLIS)
            spec = self.spec
            self._check_loaded(
                TRELLIS, loaded, (spec.rows, spec.row_words), torch.int16
            )
            first = layer.shard_indices.org_vocab_start_index
            count = layer.shard_indices.org_vocab_end_index - first
            param.data[:count].copy_(loaded[first : first + count])
            param.data[count:].zero_()

        return load

    def _signs_loader(self, layer: torch.nn.Module):
        def load(param: Parameter, loaded: torch.Tensor) -> None:
            self.ledger.record(layer, self.prefix, EMBED_SIGNS_SUFFIX)
            self._check_loaded(
                EMBED_SIGNS_SUFFIX, loaded, tuple(param.shape), torch.float16
            )
            check_embedding_signs(f"{self.spec.prefix}.{EMBED_SIGNS_SUFFIX}", loaded)
            param.data.copy_(loaded)

        return load

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        self.ledger.check(
            layer, self.prefix, (TRELLIS, EMBED_SIGNS_SUFFIX), rank=self.rank
        )
        self.kernel = choose_exl3_embedding_kernel(
            Exl3EmbeddingKernelConfig(
                self.prefix, layer.trellis.device, layer.params_dtype
            )
        )

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        return self.kernel.apply(
            input_, layer.trellis, layer.signs, self.hidden, layer.params_dtype
        )

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # vLLM calls this only when the model ties its output layer to this table.
        raise NotImplementedError(
            f"EXL3 {self.prefix}: a quantized token embedding cannot serve as the "
            "output layer (tie_word_embeddings = true); ExLlamaV3 writes a separate "
            "lm_head and sets tie_word_embeddings to false"
        )
