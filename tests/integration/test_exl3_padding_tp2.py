# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor parallel 2 on CPU for unquantized linears stored 128-padded (hidden 320 stored
384): each rank's loader trims the padding, then vLLM's own narrowing takes the rank's
slice — column (gate_up, 160 of each shard per rank) and row (down, 160 input features
per rank, all-reduced, bias on one rank) — checked against the dense product with the
padding cut off."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

WORLD = 2


def _rank_main(rank: int, init_file: str) -> None:
    # Runs in a spawned process: imports vLLM there.
    from exl3_harness import assert_matches, config_from_tensors, gloo_world
    from test_exl3_padding import (
        MLP,
        REAL,
        _dense_plain,
        _finish,
        _load,
        _x,
        checkpoint,
    )
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        RowParallelLinear,
    )

    named = checkpoint()
    half = REAL // WORLD
    with gloo_world(WORLD, rank, init_file):
        config = config_from_tensors(named)
        gate_up = MergedColumnParallelLinear(
            REAL,
            [REAL, REAL],
            bias=False,
            quant_config=config,
            prefix=f"{MLP}.gate_up_proj",
            params_dtype=torch.float32,
        )
        _load(gate_up, named, f"{MLP}.gate_proj", 0)
        _load(gate_up, named, f"{MLP}.up_proj", 1)
        down = RowParallelLinear(
            REAL,
            REAL,
            bias=True,
            quant_config=config,
            prefix=f"{MLP}.down_proj",
            params_dtype=torch.float32,
        )
        _load(down, named, f"{MLP}.down_proj")
        assert gate_up.weight.shape == (2 * half, REAL) and down.weight.shape == (
            REAL,
            half,
        )
        _finish(gate_up), _finish(down)

        x = _x()
        cols = slice(half * rank, half * (rank + 1))
        w = torch.cat(
            [
                _dense_plain(named, f"{MLP}.gate_proj", REAL)[:, cols],
                _dense_plain(named, f"{MLP}.up_proj", REAL)[:, cols],
            ],
            dim=1,
        )
        assert_matches(gate_up(x)[0], x @ w, f"rank {rank} gate_up from padded shards")
        # Row-parallel: this rank's input slice; the layer all-reduces and adds the bias
        # once.
        expected = (
            x @ _dense_plain(named, f"{MLP}.down_proj", REAL)
            + named[f"{MLP}.down_proj.bias"][:REAL].float()
        )
        assert_matches(down(x[:, cols])[0], expected, f"rank {rank} down, all-reduced")


def test_padded_unquantized_linears_at_tp2(tmp_path, world1):
    # Spawned children re-import this module and its helpers from the parent's sys.path.
    mp.spawn(_rank_main, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True)
