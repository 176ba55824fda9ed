# SPDX-License-Identifier: Apache-2.0
"""Tensor parallel 2 on CPU: two spawned processes in one gloo world build vLLM's real layers
with the EXL3 methods, load the full checkpoint tensors through vLLM's loaders (each rank takes
its slice), and check each rank's output, the row-parallel all-reduce and the gathered logits
against the dense product; plus the per-rank 128-block errors."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
HIDDEN, INTER, CKPT_VOCAB = 256, 768, 4096
ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"


def _rank_main(rank: int, init_file: str) -> None:
    # Runs in a spawned process: imports vLLM there.
    from exl3_harness import (CKPT_MCG, assert_matches, config_for, dense, gloo_world,
                              load_module, tensors)
    from vllm.distributed import tensor_model_parallel_all_gather
    from vllm.model_executor.layers.linear import (MergedColumnParallelLinear,
                                                   QKVParallelLinear, RowParallelLinear)
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    named = tensors(CKPT_MCG)
    f32 = torch.float32
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(11))

    def finish(layer):
        layer.quant_method.process_weights_after_loading(layer)

    with gloo_world(WORLD, rank, init_file):
        config = config_for(CKPT_MCG)

        # QKV, the fixture's heads read as head_dim 128: q = 2 heads (one per rank), k/v = one
        # head replicated on both ranks (num_kv_head_replicas = 2).
        qkv = QKVParallelLinear(HIDDEN, 128, 2, 1, bias=False, quant_config=config,
                                prefix=f"{ATTN}.qkv_proj", params_dtype=f32)
        assert qkv.num_kv_head_replicas == 2
        for shard, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            load_module(qkv, named, f"{ATTN}.{proj}", shard)
        finish(qkv)
        wq = dense(named, f"{ATTN}.q_proj")[:, 128 * rank:128 * (rank + 1)]
        w = torch.cat([wq, dense(named, f"{ATTN}.k_proj"), dense(named, f"{ATTN}.v_proj")], 1)
        assert_matches(qkv(x)[0], x @ w, f"rank {rank} qkv")

        # gate_up column-parallel (384 per rank), then down row-parallel with the all-reduce.
        gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False,
                                             quant_config=config, prefix=f"{MLP}.gate_up_proj",
                                             params_dtype=f32)
        down = RowParallelLinear(INTER, HIDDEN, bias=False, quant_config=config,
                                 prefix=f"{MLP}.down_proj", params_dtype=f32)
        load_module(gate_up, named, f"{MLP}.gate_proj", 0)
        load_module(gate_up, named, f"{MLP}.up_proj", 1)
        load_module(down, named, f"{MLP}.down_proj")
        finish(gate_up)
        finish(down)
        cols = slice(384 * rank, 384 * (rank + 1))
        w_gu = torch.cat([dense(named, f"{MLP}.gate_proj")[:, cols],
                          dense(named, f"{MLP}.up_proj")[:, cols]], 1)
        h = gate_up(x)[0]
        assert_matches(h, x @ w_gu, f"rank {rank} gate_up")
        h_full = tensor_model_parallel_all_gather(h[:, 384:].contiguous())  # the up halves
        assert_matches(down(h[:, 384:])[0], h_full @ dense(named, f"{MLP}.down_proj"),
                       f"rank {rank} down + all-reduce")

        # lm_head, vocab 4000: vLLM gives each rank 2016 columns (not 128-aligned).
        vocab = 4000
        head = ParallelLMHead(vocab, HIDDEN, quant_config=config, prefix="lm_head",
                              params_dtype=f32)
        for name, tensor in named.items():
            if name.startswith("lm_head."):
                param = getattr(head, name.rpartition(".")[2])
                param.weight_loader(param, tensor)
        finish(head)
        full = torch.zeros(6, 4032)
        full[:, :vocab] = x @ dense(named, "lm_head")[:, :vocab]
        part = head.quant_method.apply(head, x)
        assert part.shape == (6, 2016)
        assert_matches(part, full[:, 2016 * rank:2016 * (rank + 1)], f"rank {rank} lm_head")
        if rank == 1:
            assert torch.all(part[:, vocab - 2016:] == 0)
        logits = LogitsProcessor(vocab)(head, x)  # gathered on rank 0
        if rank == 0:
            assert_matches(logits, full[:, :vocab], "gathered logits")

        # The fixture's real heads (head_dim 64, one KV head per rank): 64-column slices.
        try:
            QKVParallelLinear(HIDDEN, 64, 4, 2, bias=False, quant_config=config,
                              prefix=f"{ATTN}.qkv_proj")
        except Exl3LayoutError as e:
            assert f"(rank {rank} of 2): column-parallel slice of shard 1" in str(e), e
            assert "is 64 features" in str(e), e
        else:
            raise AssertionError("64-wide column slices were accepted")
        # A k split off the block: 640 inputs / 2 = 320 per rank.
        try:
            RowParallelLinear(640, HIDDEN, bias=False, quant_config=config,
                              prefix=f"{MLP}.down_proj")
        except Exl3LayoutError as e:
            assert f"(rank {rank} of 2): row-parallel input slice of 320 features" in str(e), e
        else:
            raise AssertionError("a 320-row k split was accepted")


def test_tensor_parallel_2(tmp_path):
    # Spawned children re-import this module and exl3_harness from the parent's sys.path.
    mp.spawn(_rank_main, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True)


if __name__ == "__main__":
    pytest.main([__file__])
