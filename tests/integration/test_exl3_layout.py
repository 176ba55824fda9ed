# SPDX-License-Identifier: Apache-2.0
"""The per-rank layout rules (layout.py) at tensor-parallel sizes this machine cannot run: which
checkpoint columns/rows each rank reads, and the 128-block errors naming module, rank, numbers."""

from __future__ import annotations

import pytest

from vllm.model_executor.layers.quantization.exl3.format import Codebook, Exl3ModuleSpec
from vllm.model_executor.layers.quantization.exl3.layout import (Exl3LayoutError, Split,
                                                                 plan_linear, plan_lm_head,
                                                                 round_up)


def spec(prefix: str, k: int, n: int, bits: float = 4,
         codebook: Codebook = Codebook.MUL1) -> Exl3ModuleSpec:
    return Exl3ModuleSpec(prefix, k, n, bits, codebook, False, False,
                          (f"{prefix}.trellis", f"{prefix}.suh", f"{prefix}.svh"))


def test_column_split_reads_each_ranks_block_of_every_shard():
    specs = [spec("q", 4096, 4096), spec("k", 4096, 1024), spec("v", 4096, 1024)]
    for rank in range(4):
        layout = plan_linear("qkv", specs, split=Split.COLUMN, tp_rank=rank, tp_size=4,
                             k_width=4096, widths=[1024, 256, 256])
        assert [(s.src_col, s.col, s.alloc) for s in layout.shards] == [
            (1024 * rank, 0, 1024), (256 * rank, 1024, 256), (256 * rank, 1280, 256)]
        assert layout.identity_output and layout.trellis_shape == (256, 96, 64)


def test_replicated_kv_heads_read_the_shared_slice():
    specs = [spec("q", 1024, 1024), spec("k", 1024, 256), spec("v", 1024, 256)]
    srcs = [[s.src_col for s in plan_linear(
        "qkv", specs, split=Split.COLUMN, tp_rank=r, tp_size=4, k_width=1024,
        widths=[256, 128, 128], kv_replicas=[1, 2, 2]).shards] for r in range(4)]
    assert srcs == [[0, 0, 0], [256, 0, 0], [512, 128, 128], [768, 128, 128]]


def test_row_split_reads_each_ranks_rows():
    layout = plan_linear("down", [spec("down", 12288, 4096)], split=Split.ROW, tp_rank=3,
                         tp_size=4, k_width=3072, widths=[4096])
    assert (layout.src_row, layout.k_alloc) == (9216, 3072)


def test_column_split_off_the_block_is_an_error():
    # head_dim 64 with one KV head per rank: 64 columns.
    specs = [spec("q", 256, 256), spec("k", 256, 128), spec("v", 256, 128)]
    with pytest.raises(Exl3LayoutError, match=r"qkv \(rank 1 of 2\): column-parallel slice of "
                                              r"shard 1 \(k\) is 64 features, not a multiple"):
        plan_linear("qkv", specs, split=Split.COLUMN, tp_rank=1, tp_size=2, k_width=256,
                    widths=[128, 64, 64])


def test_row_split_off_the_block_is_an_error():
    # Qwen3-MoE-like 768 at TP 8: 96 per rank.
    with pytest.raises(Exl3LayoutError, match=r"down \(rank 5 of 8\): row-parallel input slice "
                                              r"of 96 features.*768 input features / TP 8"):
        plan_linear("down", [spec("down", 768, 256)], split=Split.ROW, tp_rank=5, tp_size=8,
                    k_width=96, widths=[256])


def test_mixed_shards_become_runs_in_flat_storage():
    specs = [spec("q", 256, 256, 4), spec("k", 256, 128, 3, Codebook.MCG),
             spec("v", 256, 128, 3, Codebook.MCG)]
    layout = plan_linear("qkv", specs, split=Split.NONE, tp_rank=0, tp_size=1, k_width=256,
                         widths=[256, 128, 128])
    q_words = 16 * 16 * 64
    assert [(r.first, r.stop, r.word_start, r.word_stop, r.shard_widths) for r in layout.runs] \
        == [(0, 1, 0, q_words, (256,)), (1, 3, q_words, q_words + 16 * 16 * 48, (128, 128))]
    assert layout.trellis_shape == (q_words + 16 * 16 * 48,)


def test_shard_count_mismatch_is_an_error():
    with pytest.raises(Exl3LayoutError, match="3 output shards but 2 checkpoint modules"):
        plan_linear("qkv", [spec("q", 256, 256), spec("k", 256, 128)], split=Split.NONE,
                    tp_rank=0, tp_size=1, k_width=256, widths=[256, 128, 128])


def test_fused_shards_with_different_k_is_an_error():
    with pytest.raises(Exl3LayoutError, match="different input sizes"):
        plan_linear("gu", [spec("g", 256, 256), spec("u", 384, 256)], split=Split.NONE,
                    tp_rank=0, tp_size=1, k_width=256, widths=[256, 256])


@pytest.mark.parametrize("vocab,tp", [(151936, 2), (151936, 8), (4000, 2), (32001, 4),
                                      (1000, 8), (128256, 4)])
def test_lm_head_ranks_cover_their_vocab_range(vocab, tp):
    """Simulate every rank: which checkpoint column each returned logit comes from."""
    padded = round_up(vocab, 64)
    per_rank = padded // tp
    ckpt = spec("lm_head", 512, round_up(vocab, 128), 6)
    for rank in range(tp):
        start = rank * per_rank
        layout = plan_lm_head("lm_head", ckpt, tp_rank=rank, hidden=512, vocab_start=start,
                              vocab_per_rank=per_rank, org_vocab=vocab)
        shard = layout.shards[0]
        assert shard.src_col % 128 == 0 and shard.alloc % 128 == 0
        kept = [shard.src_col + c if shard.src_col + c < vocab else None
                for c in range(shard.copy_cols)] + [None] * (shard.alloc - shard.copy_cols)
        returned = [None] * per_rank
        for src, width, dst in layout.pieces:
            returned[dst:dst + width] = kept[src:src + width]
        expected = [c if c < vocab else None for c in range(start, start + per_rank)]
        assert returned == expected, (vocab, tp, rank)
