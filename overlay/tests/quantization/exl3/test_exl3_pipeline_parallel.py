# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""vLLM's pipeline parallelism (2 stages) loading an EXL3 checkpoint, on CPU with gloo.

Two spawned processes form one world of pipeline size 2 (tensor parallel 1). Each builds
the fixture's Qwen3ForCausalLM through vLLM's own loader: its stage's decoder layers
real, the others vLLM's PPMissingLayer, the embedding on the first stage and the
lm_head on the last. Every parameter the stage holds is written exactly once per shard
(each parameter's weight_loader counted), no parameter of the other stage is touched,
and the EXL3 method's own ledger (every checkpoint tensor of a built EXL3 module arrives
once) passes. Then the stages run one after the other (the hidden state and residual
handed over through a file, as vLLM's send/recv would), and the last stage's logits
equal the one-process model's bit for bit: the same weights, the same operations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from .test_exl3_model import MODEL_DTYPE, token_ids, vllm_logits

WORLD = 2
STAGE_OUT = "stage{rank}.pt"


def _stage_main(rank: int, init_file: str, ckpt_dir: str, out_dir: str) -> None:
    # Runs in a spawned process: imports vLLM there.
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.distributed import get_pp_group
    from vllm.model_executor.model_loader import base_loader, get_model_loader
    from vllm.model_executor.models.utils import PPMissingLayer
    from vllm.platforms import current_platform

    from .exl3_harness import CPU_ATTENTION_BACKEND, CausalSdpa, gloo_world

    out = Path(out_dir)
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(
            current_platform,
            "get_attn_backend_cls",
            lambda *args, **kwargs: CPU_ATTENTION_BACKEND,
        )
        model_config = ModelConfig(model=ckpt_dir, dtype=MODEL_DTYPE)
        vllm_config = VllmConfig(
            model_config=model_config,
            device_config=DeviceConfig("cpu"),
            parallel_config=ParallelConfig(pipeline_parallel_size=WORLD),
        )
        with gloo_world(WORLD, rank, init_file, vllm_config):
            pp = get_pp_group()
            assert (pp.rank_in_group, pp.world_size) == (rank, WORLD)
            # vLLM's own load path; every parameter's loader counted as soon as
            # the model is built, before any weight arrives.
            loads: dict[str, int] = {}
            built: set[str] = set()
            build = base_loader.initialize_model

            def counting_build(*args, **kwargs):
                model = build(*args, **kwargs)
                for name, param in model.named_parameters():
                    loader = getattr(param, "weight_loader", None)
                    if loader is None:
                        continue
                    built.add(name)

                    def counted(*a, _name=name, _loader=loader, **k):
                        loads[_name] = loads.get(_name, 0) + 1
                        return _loader(*a, **k)

                    param.weight_loader = counted
                return model

            monkeypatch.setattr(base_loader, "initialize_model", counting_build)
            model = get_model_loader(vllm_config.load_config).load_model(
                vllm_config=vllm_config, model_config=model_config
            )
            _check_stage(rank, model, loads, built, PPMissingLayer)
            _run_stage(rank, model, vllm_config, out, CausalSdpa)


def _check_stage(
    rank: int, model, loads: dict[str, int], built: set[str], missing_cls
) -> None:
    layers = model.model.layers
    start, end = model.model.start_layer, model.model.end_layer
    half = len(layers) // WORLD
    assert (start, end) == (rank * half, (rank + 1) * half)
    for i, layer in enumerate(layers):
        assert isinstance(layer, missing_cls) == (not start <= i < end), (rank, i)
    assert isinstance(model.model.embed_tokens, missing_cls) == (rank != 0)
    assert isinstance(model.lm_head, missing_cls) == (rank != WORLD - 1)
    # Written at least once; a fused layer's parameter takes one load per shard (q, k
    # and v into qkv_proj; gate and up into gate_up_proj), never two of one shard.
    shards = {"qkv_proj": 3, "gate_up_proj": 2}
    for name, count in loads.items():
        fused = next((n for f, n in shards.items() if f".{f}." in name), 1)
        assert count == fused, (rank, name, count)
    never = sorted(built - set(loads))
    assert never == [], (rank, never)
    layer_names = {n.split(".")[2] for n in loads if n.startswith("model.layers.")}
    assert layer_names == {str(i) for i in range(start, end)}, (rank, layer_names)


def _run_stage(rank: int, model, vllm_config, out: Path, sdpa_cls) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_pp_group

    ids = token_ids()
    positions = torch.arange(len(ids))
    with (
        set_current_vllm_config(vllm_config),
        torch.no_grad(),
        torch.compiler.set_stance("force_eager"),
    ):
        layers = model.model.layers[model.model.start_layer : model.model.end_layer]
        for layer in layers:
            attn = layer.self_attn
            attn.attn = sdpa_cls(
                attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling
            )
        if rank == 0:
            hidden, residual = model.model.embed_input_ids(ids), None
        else:
            get_pp_group().barrier()  # stage 0 has written its output
            hidden, residual = torch.load(out / STAGE_OUT.format(rank=rank - 1))
        for layer in layers:
            hidden, residual = layer(positions, hidden, residual)
        if rank < WORLD - 1:
            torch.save((hidden, residual), out / STAGE_OUT.format(rank=rank))
            get_pp_group().barrier()
            return
        hidden, _ = model.model.norm(hidden, residual)
        torch.save(model.compute_logits(hidden).float(), out / "logits.pt")


def test_pipeline_parallel_2_loads_each_stage_once_and_matches_one_stage(
    tmp_path, monkeypatch, world1
):
    from .exl3_harness import CKPT_3INST, checkpoint_copy

    ckpt = checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", tokenizer=True)
    mp.spawn(
        _stage_main,
        args=(str(tmp_path / "init"), str(ckpt), str(tmp_path)),
        nprocs=WORLD,
        join=True,
    )
    staged = torch.load(tmp_path / "logits.pt")
    whole, _ = vllm_logits(ckpt, token_ids(), monkeypatch, dtype=MODEL_DTYPE)
    assert staged.shape == whole.shape
    assert torch.equal(staged, whole), (staged - whole).abs().max().item()
