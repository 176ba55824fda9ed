# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""ParallelLMHead with Exl3LMHeadMethod at world size 1: its own loader (the vocab is
the trellis' dim 1), vLLM's 64-padding of the vocab, and the logits processor on top."""

from __future__ import annotations

import pytest
import torch
from exl3_harness import CKPT_MCG, assert_matches, config_for, dense, tensors
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError
from vllm.model_executor.layers.quantization.exl3.lm_head import Exl3LMHeadMethod
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)

pytestmark = pytest.mark.usefixtures("world1")

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
