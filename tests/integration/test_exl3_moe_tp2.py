# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EXL3 MoE across two ranks on CPU (two spawned processes, one gloo world):

* tensor parallel 2: a synthetic Qwen3-MoE checkpoint (expert width 256, so 128 per
  rank, mixed per-expert rates) through vLLM's loader; every MoE block (each rank's half
  of every expert, then the runner's all-reduce) against the full oracle, and the
  model's logits equal to TP=1's;
* the real fixture layer at TP=2 fails closed: its expert width 128 would put 64 rows of
  each down projection on a rank, half a Hadamard block;
* expert parallel 2: the real fixture layer with 8 of its 16 experts per rank (vLLM's
  expert map), each rank loading only its own, the combined output against the full
  oracle.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.multiprocessing as mp

WORLD = 2
TP2_LOGITS = "tp2_logits.pt"
MODEL_DTYPE = "float16"
# TP=2 differs from TP=1 in summation order (the MoE and row-parallel all-reduces) and
# the fp16 roundings after it; a misplaced expert column costs far more.
LOGITS_ULPS = 8
FIXTURE = "qwen3moe-e16-3.0bpw-mcg"
EXPERTS = "model.layers.0.mlp.experts"


@contextlib.contextmanager
def ep_world(rank: int, init_file: str):
    """A gloo world of 2 whose MoE layers split experts (EP) instead of expert widths
    (TP)."""
    from vllm.config import (
        DeviceConfig,
        ParallelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(
            tensor_parallel_size=WORLD, enable_expert_parallel=True
        ),
    )
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=WORLD,
            rank=rank,
            local_rank=rank,
            distributed_init_method=f"file://{init_file}",
            backend="gloo",
        )
        initialize_model_parallel(WORLD, 1)
        try:
            yield vllm_config
        finally:
            cleanup_dist_env_and_memory()


def _rank_main(rank: int, tmp: str, synthetic: str, fixture: str) -> None:
    from pathlib import Path

    from exl3_harness import gloo_world
    from moe_blocks import check_moe_blocks
    from moe_checkpoints import decoded_modules
    from moe_model_run import load_model, run_logits
    from moe_oracle import moe_reference, softmax_topk
    from test_exl3_moe_layer import build_moe, run_moe
    from test_exl3_moe_model import token_ids
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    with gloo_world(WORLD, rank, f"{tmp}/init_tp"):
        with pytest.MonkeyPatch.context() as monkeypatch:
            model, vllm_config = load_model(synthetic, monkeypatch, MODEL_DTYPE)
            experts = model.model.layers[0].mlp.experts.routed_experts
            assert experts.quant_method.width == 128
            assert check_moe_blocks(Path(synthetic), model, vllm_config) == 2
            logits = run_logits(model, vllm_config, token_ids())
        if rank == 0:
            torch.save(logits, f"{tmp}/{TP2_LOGITS}")
        with pytest.raises(
            Exl3LayoutError,
            match=rf"EXL3 {EXPERTS} \(rank {rank} of 2\): "
            r"row-parallel input slice of 64 features",
        ):
            build_moe(Path(fixture), EXPERTS)

    with ep_world(rank, f"{tmp}/init_ep") as vllm_config:
        moe, named, loaded = build_moe(Path(fixture), EXPERTS, expect_all_loaded=False)
        method = moe.routed_experts.quant_method
        local = set(method._local.values())
        assert len(local) == 8 and len(loaded) * 2 == sum(
            1 for k in named if k.startswith(EXPERTS + ".")
        ), (len(local), len(loaded))
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(5))
        logits = x @ named["model.layers.0.mlp.gate.weight"].float().t()
        weights, ids = softmax_topk(x, logits, 4, True)
        y = run_moe(moe, x, logits, vllm_config)
        expected = moe_reference(
            x, weights, ids, decoded_modules(Path(fixture), (EXPERTS,)), EXPERTS
        )
        err = (y.double() - expected).abs().max().item()
        assert err <= 2e-5 * expected.abs().max().item(), (
            f"rank {rank} EP: max |err| {err}"
        )


def test_moe_tensor_and_expert_parallel_2(tmp_path, monkeypatch, world1):
    from moe_checkpoints import assemble
    from moe_model_run import vllm_logits
    from test_exl3_moe_model import token_ids
    from test_exl3_moe_synthetic import write

    synthetic = write("qwen3-moe", tmp_path / "synthetic")
    fixture = assemble(FIXTURE, tmp_path / "fixture")
    # Spawned children re-import this module and the harness from the parent's sys.path.
    mp.spawn(
        _rank_main,
        args=(str(tmp_path), str(synthetic), str(fixture)),
        nprocs=WORLD,
        join=True,
    )
    tp2 = torch.load(tmp_path / TP2_LOGITS)
    tp1, _ = vllm_logits(synthetic, token_ids(), monkeypatch, dtype=MODEL_DTYPE)
    assert tp2.shape == tp1.shape
    err = (tp2 - tp1).abs().max().item()
    bound = (
        LOGITS_ULPS
        * torch.finfo(getattr(torch, MODEL_DTYPE)).eps
        * tp1.abs().max().item()
    )
    assert err <= bound, f"TP=2 vs TP=1: max |logit diff| {err:.3g} > {bound:.3g}"
