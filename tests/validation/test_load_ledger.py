# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""After vLLM's loader runs, every parameter of every EXL3-owned and padding-owned layer
was written exactly once, at TP=1 and TP=2 (two spawned ranks in one gloo world on the
CPU).

The checkpoint validation names all of these cases before loading; here it is bypassed
(the directory is described from its headers alone, as for a hub model), so what is
under test is the last line of defence: the load ledger (load_ledger.py) inside the real
loader.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from damage import BASE, copy_of, edit_json, save, sharded, tensors_of

WORLD = 2
CONFIG_MODULE = "vllm.model_executor.layers.quantization.exl3.config"
O3 = "model.layers.3.self_attn.o_proj"


def _layer_not_in_checkpoint(dst: Path) -> None:
    """config.json claims a fifth layer: its linears (padding-owned) get nothing."""
    copy_of(BASE, dst)
    edit_json(
        dst / "config.json",
        lambda c: c.update(num_hidden_layers=5, layer_types=["full_attention"] * 5),
    )


def _exl3_module_outside_the_index(dst: Path) -> None:
    """o_proj of layer 3 only in a shard the index does not list: its headers describe
    it as EXL3, vLLM's loader reads only indexed shards."""
    named = tensors_of()
    stray = {n: named.pop(n) for n in list(named) if n.startswith(f"{O3}.")}
    sharded(dst, named)
    save(dst, stray, "model-00003-of-00003.safetensors")


def _exl3_tensor_twice(dst: Path) -> None:
    """Two files and no index (vLLM loads every .safetensors): up_proj of layer 0 in
    both."""
    copy_of(BASE, dst)
    named = tensors_of()
    save(
        dst,
        {n: t for n, t in named.items() if n.startswith("model.layers.0.mlp.up_proj.")},
        "extra.safetensors",
    )


def _plain_weight_twice(dst: Path) -> None:
    """o_proj of layer 3 stored unquantized (a padding-owned layer), and its weight
    twice."""
    copy_of(BASE, dst)
    named = tensors_of()
    for n in [n for n in named if n.startswith(f"{O3}.")]:
        del named[n]
    weight = (
        0.02 * torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    ).half()
    named[f"{O3}.weight"] = weight
    save(dst, named)
    save(dst, {f"{O3}.weight": weight}, "extra.safetensors")


# (builder, phrases the error names at every rank; {rank} is filled in)
CASES = {
    "layer-not-in-checkpoint": (
        _layer_not_in_checkpoint,
        (
            "EXL3 model.layers.4.self_attn.qkv_proj (rank {rank}): checkpoint tensors "
            "never loaded: weight[q], weight[k], weight[v]",
        ),
    ),
    "exl3-module-outside-index": (
        _exl3_module_outside_the_index,
        (
            f"EXL3 {O3} (rank {{rank}}): checkpoint tensors never loaded: {O3}.suh, "
            f"{O3}.svh, {O3}.trellis",
        ),
    ),
    "exl3-tensor-twice": (
        _exl3_tensor_twice,
        (
            "EXL3 model.layers.0.mlp.gate_up_proj: model.layers.0.mlp.up_proj.",
            "written twice",
        ),
    ),
    "plain-weight-twice": (_plain_weight_twice, (f"EXL3 {O3}: weight written twice",)),
}


def _headers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.setattr(
        importlib.import_module(CONFIG_MODULE),
        "_holds_weights",
        lambda model_name: False,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_tp1_every_owned_parameter_written_once(
    case, tmp_path, monkeypatch, vllm_world
):
    from three_paths import run_vllm

    build, phrases = CASES[case]
    build(tmp_path / case)
    _headers_only(monkeypatch)
    outcome = run_vllm(tmp_path / case)
    assert outcome.failed and not outcome.crashed, outcome.message
    for phrase in phrases:
        assert phrase.format(rank=0) in outcome.message, outcome.message


def _rank_main(rank: int, init_file: str, root: str) -> None:
    # A spawned process: vLLM is imported here; validation bypassed as at TP=1.
    from exl3_harness import gloo_world
    from three_paths import run_vllm

    with (
        pytest.MonkeyPatch.context() as monkeypatch,
        gloo_world(WORLD, rank, init_file),
    ):
        _headers_only(monkeypatch)
        for case in sorted(CASES):
            outcome = run_vllm(Path(root) / case)
            kind = (
                "crash"
                if outcome.crashed
                else ("failed" if outcome.failed else "loaded")
            )
            Path(root, f"{case}.rank{rank}").write_text(f"{kind}\n{outcome.message}")


def test_tp2_every_owned_parameter_written_once(tmp_path, vllm_world):
    for case, (build, _) in CASES.items():
        build(tmp_path / case)
    mp.spawn(
        _rank_main,
        args=(str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=True,
    )
    for case, (_, phrases) in sorted(CASES.items()):
        for rank in range(WORLD):
            kind, message = (tmp_path / f"{case}.rank{rank}").read_text().split("\n", 1)
            assert kind == "failed", f"{case} rank {rank}: {kind}: {message}"
            for phrase in phrases:
                assert phrase.format(rank=rank) in message, (
                    f"{case} rank {rank}: {message}"
                )
