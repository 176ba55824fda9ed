# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The per-rank layout rules (layout.py) at tensor-parallel sizes this machine cannot
run: which checkpoint columns/rows each rank computes and which of them it returns
(every returned column traced back to its checkpoint column, for every rank), and the
row-split errors naming module, rank, numbers."""

from __future__ import annotations

import pytest
from vllm.model_executor.layers.quantization.exl3.format import Codebook, Exl3ModuleSpec
from vllm.model_executor.layers.quantization.exl3.layout import (
    Exl3LayoutError,
    Split,
    plan_linear,
    plan_lm_head,
    round_up,
)


def spec(
    prefix: str, k: int, n: int, bits: float = 4, codebook: Codebook = Codebook.MUL1
) -> Exl3ModuleSpec:
    return Exl3ModuleSpec(
        prefix,
        k,
        n,
        bits,
        codebook,
        False,
        False,
        (f"{prefix}.trellis", f"{prefix}.suh", f"{prefix}.svh"),
    )


def test_column_split_reads_each_ranks_block_of_every_shard():
    specs = [spec("q", 4096, 4096), spec("k", 4096, 1024), spec("v", 4096, 1024)]
    for rank in range(4):
        layout = plan_linear(
            "qkv",
            specs,
            split=Split.COLUMN,
            tp_rank=rank,
            tp_size=4,
            k_width=4096,
            widths=[1024, 256, 256],
        )
        assert [(s.src_col, s.col, s.alloc) for s in layout.shards] == [
            (1024 * rank, 0, 1024),
            (256 * rank, 1024, 256),
            (256 * rank, 1280, 256),
        ]
        assert layout.identity_output and layout.trellis_shape == (256, 96, 64)


def test_replicated_kv_heads_read_the_shared_slice():
    specs = [spec("q", 1024, 1024), spec("k", 1024, 256), spec("v", 1024, 256)]
    srcs = [
        [
            s.src_col
            for s in plan_linear(
                "qkv",
                specs,
                split=Split.COLUMN,
                tp_rank=r,
                tp_size=4,
                k_width=1024,
                widths=[256, 128, 128],
                kv_replicas=[1, 2, 2],
            ).shards
        ]
        for r in range(4)
    ]
    assert srcs == [[0, 0, 0], [256, 0, 0], [512, 128, 128], [768, 128, 128]]


def test_row_split_reads_each_ranks_rows():
    layout = plan_linear(
        "down",
        [spec("down", 12288, 4096)],
        split=Split.ROW,
        tp_rank=3,
        tp_size=4,
        k_width=3072,
        widths=[4096],
    )
    assert (layout.src_row, layout.k_alloc) == (9216, 3072)


def _returned_checkpoint_columns(layout) -> list[tuple[int, int | None]]:
    """What each column a rank returns is: (shard, checkpoint column), None for a column
    the rank allocated past the checkpoint (zero-filled, svh = 0)."""
    computed = []
    for s, shard in enumerate(layout.shards):
        for c in range(shard.src_col, shard.src_col + shard.alloc):
            computed.append((s, c if c < shard.ckpt_cols else None))
    kept = layout.kept_columns()
    return computed if kept is None else [computed[c] for c in kept]


def _vllm_qkv(heads: int, kv_heads: int, head_dim: int, tp: int):
    """vLLM's QKVParallelLinear arithmetic: per-rank widths and KV-head replicas."""
    kv_per_rank = max(1, kv_heads // tp)
    replicas = max(1, tp // kv_heads)
    widths = [heads // tp * head_dim, kv_per_rank * head_dim, kv_per_rank * head_dim]
    return widths, [1, replicas, replicas]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,tp",
    [
        (4, 2, 64, 2),  # the fixture: one 64-wide KV head per rank
        (4, 2, 64, 4),  # ... replicated on two ranks each
        (4, 4, 64, 4),  # 4 KV heads x 64 at TP 4
        (16, 2, 64, 8),  # 4 ranks share each KV head
        (40, 8, 64, 8),  # q: 5 heads x 64 = 320 per rank, windows at odd offsets
        (32, 8, 128, 16),  # 8 KV heads x 128 at TP 16: replicated, whole blocks
        (32, 8, 64, 16),
    ],
)
def test_column_split_keeps_each_ranks_columns_of_a_block_window(
    heads, kv_heads, head_dim, tp
):
    hidden = 512
    specs = [
        spec("q", hidden, round_up(heads * head_dim, 128)),
        spec("k", hidden, round_up(kv_heads * head_dim, 128)),
        spec("v", hidden, round_up(kv_heads * head_dim, 128)),
    ]
    widths, replicas = _vllm_qkv(heads, kv_heads, head_dim, tp)
    whole_blocks = all(w % 128 == 0 for w in widths)
    for rank in range(tp):
        layout = plan_linear(
            "qkv",
            specs,
            split=Split.COLUMN,
            tp_rank=rank,
            tp_size=tp,
            k_width=hidden,
            widths=widths,
            kv_replicas=replicas,
        )
        expected = [
            (s, (rank // replicas[s]) * w + c)
            for s, w in enumerate(widths)
            for c in range(w)
        ]
        assert _returned_checkpoint_columns(layout) == expected, (rank, layout)
        for shard in layout.shards:
            assert shard.src_col % 128 == 0 and shard.alloc % 128 == 0
            assert shard.keep + shard.width <= shard.alloc < shard.width + 2 * 128
        assert layout.identity_output == whole_blocks
        assert len(layout.runs) == 1  # still one kernel call over all shards
        assert layout.trellis_shape == (hidden // 16, layout.n_alloc // 16, 64)


def test_fixture_qkv_at_tp2_computes_the_kv_block_on_both_ranks():
    specs = [spec("q", 256, 256), spec("k", 256, 128), spec("v", 256, 128)]
    windows, kept = [], []
    for rank in range(2):
        layout = plan_linear(
            "qkv",
            specs,
            split=Split.COLUMN,
            tp_rank=rank,
            tp_size=2,
            k_width=256,
            widths=[128, 64, 64],
        )
        windows.append(
            [(s.src_col, s.col, s.alloc, s.keep, s.width) for s in layout.shards]
        )
        kept.append(layout.kept_columns())
    assert windows == [
        [(0, 0, 128, 0, 128), (0, 128, 128, 0, 64), (0, 256, 128, 0, 64)],
        [(128, 0, 128, 0, 128), (0, 128, 128, 64, 64), (0, 256, 128, 64, 64)],
    ]
    assert kept[0] == [*range(128), *range(128, 192), *range(256, 320)]
    assert kept[1] == [*range(128), *range(192, 256), *range(320, 384)]


@pytest.mark.parametrize("n,tp", [(704, 2), (704, 4), (768, 8), (1408, 8)])
def test_merged_column_split_off_the_block(n, tp):
    specs = [spec("gate", 256, round_up(n, 128)), spec("up", 256, round_up(n, 128))]
    for rank in range(tp):
        layout = plan_linear(
            "gate_up",
            specs,
            split=Split.COLUMN,
            tp_rank=rank,
            tp_size=tp,
            k_width=256,
            widths=[n // tp, n // tp],
        )
        assert _returned_checkpoint_columns(layout) == [
            (s, rank * (n // tp) + c) for s in range(2) for c in range(n // tp)
        ]


def test_vllm_padding_past_the_checkpoint_comes_out_of_zero_columns():
    # vLLM one block wider than the checkpoint (768 -> 896), split 448 per rank.
    layout = plan_linear(
        "up",
        [spec("up", 256, 768)],
        split=Split.COLUMN,
        tp_rank=1,
        tp_size=2,
        k_width=256,
        widths=[448],
    )
    shard = layout.shards[0]
    assert (shard.src_col, shard.alloc, shard.keep, shard.copy_cols) == (
        384,
        512,
        64,
        384,
    )
    assert _returned_checkpoint_columns(layout) == (
        [(0, c) for c in range(448, 768)] + [(0, None)] * 128
    )


def test_row_split_off_the_block_is_an_error():
    # Qwen3-MoE-like 768 at TP 8: 96 per rank.
    with pytest.raises(
        Exl3LayoutError,
        match=r"down \(rank 5 of 8\): row-parallel input slice "
        r"of 96 features.*768 input features / TP 8",
    ):
        plan_linear(
            "down",
            [spec("down", 768, 256)],
            split=Split.ROW,
            tp_rank=5,
            tp_size=8,
            k_width=96,
            widths=[256],
        )


def test_mixed_shards_become_runs_in_flat_storage():
    specs = [
        spec("q", 256, 256, 4),
        spec("k", 256, 128, 3, Codebook.MCG),
        spec("v", 256, 128, 3, Codebook.MCG),
    ]
    layout = plan_linear(
        "qkv",
        specs,
        split=Split.NONE,
        tp_rank=0,
        tp_size=1,
        k_width=256,
        widths=[256, 128, 128],
    )
    q_words = 16 * 16 * 64
    assert [
        (r.first, r.stop, r.word_start, r.word_stop, r.shard_widths)
        for r in layout.runs
    ] == [
        (0, 1, 0, q_words, (256,)),
        (1, 3, q_words, q_words + 16 * 16 * 48, (128, 128)),
    ]
    assert layout.trellis_shape == (q_words + 16 * 16 * 48,)


def test_shard_count_mismatch_is_an_error():
    with pytest.raises(
        Exl3LayoutError, match="3 output shards but 2 checkpoint modules"
    ):
        plan_linear(
            "qkv",
            [spec("q", 256, 256), spec("k", 256, 128)],
            split=Split.NONE,
            tp_rank=0,
            tp_size=1,
            k_width=256,
            widths=[256, 128, 128],
        )


def test_fused_shards_with_different_k_is_an_error():
    with pytest.raises(Exl3LayoutError, match="different input sizes"):
        plan_linear(
            "gu",
            [spec("g", 256, 256), spec("u", 384, 256)],
            split=Split.NONE,
            tp_rank=0,
            tp_size=1,
            k_width=256,
            widths=[256, 256],
        )


@pytest.mark.parametrize(
    "vocab,tp",
    [(151936, 2), (151936, 8), (4000, 2), (32001, 4), (1000, 8), (128256, 4)],
)
def test_lm_head_ranks_cover_their_vocab_range(vocab, tp):
    """Simulate every rank: which checkpoint column each returned logit comes from."""
    padded = round_up(vocab, 64)
    per_rank = padded // tp
    ckpt = spec("lm_head", 512, round_up(vocab, 128), 6)
    for rank in range(tp):
        start = rank * per_rank
        layout = plan_lm_head(
            "lm_head",
            ckpt,
            tp_rank=rank,
            hidden=512,
            vocab_start=start,
            vocab_per_rank=per_rank,
            org_vocab=vocab,
        )
        shard = layout.shards[0]
        assert shard.src_col % 128 == 0 and shard.alloc % 128 == 0
        returned = [
            c if c is not None and c < shard.real_cols else None
            for _, c in _returned_checkpoint_columns(layout)
        ]
        expected = [c if c < vocab else None for c in range(start, start + per_rank)]
        assert returned == expected, (vocab, tp, rank)
