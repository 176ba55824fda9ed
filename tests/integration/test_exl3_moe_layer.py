# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""One EXL3 MoE layer of each real fixture conversion through vLLM's own FusedMoE
(MoERunner + RoutedExperts + Exl3MoEMethod + the reference MoE kernel), loaded through
`MoERunner.load_weights` as a model's AutoWeightsLoader feeds it, against the
plain-torch oracle built from the same safetensors decoded by reference.reconstruct.
Routing is a pure-torch custom_routing_function on both sides (vLLM's top-k ops are
CUDA-only), so this test is about the experts; the whole-model test covers vLLM's own
routers."""

from __future__ import annotations

import pytest
import torch
from exl3_harness import config_for
from moe_checkpoints import (
    FIXTURE_SUBSETS,
    MOE_FIXTURES,
    assemble,
    decoded_modules,
    sha256,
)
from moe_oracle import moe_reference, softmax_topk
from safetensors.torch import load_file

TOKENS = 24
# fp32 activations: the kernel accumulates in fp32 over k <= 256, the oracle in fp64.
RTOL = 2e-5


def build_moe(
    ckpt,
    prefix: str,
    params_dtype=torch.float32,
    expect_all_loaded=True,
    config=None,
    **kwargs,
):
    """vLLM's FusedMoE for the checkpoint's layer `prefix` (experts module), loaded;
    under expert parallelism a rank loads only its experts (expect_all_loaded=False).
    `config`: an Exl3Config to use instead of the one vLLM builds for the checkpoint."""
    import json

    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoE

    # Layers register by name in the world's config; a test may rebuild the same layer.
    get_current_vllm_config().compilation_config.static_forward_context.pop(
        prefix, None
    )
    cfg = json.loads((ckpt / "config.json").read_text())
    experts = cfg.get("n_routed_experts") or cfg["num_experts"]
    config = config_for(ckpt) if config is None else config
    moe = FusedMoE(
        num_experts=experts,
        top_k=cfg["num_experts_per_tok"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["moe_intermediate_size"],
        params_dtype=params_dtype,
        renormalize=cfg.get("norm_topk_prob", True),
        quant_config=config,
        prefix=prefix,
        custom_routing_function=softmax_topk,
        **kwargs,
    )
    named = load_file(str(ckpt / "model.safetensors"))
    weights = [
        (k[len(prefix) + 1 :], v)
        for k, v in named.items()
        if k.startswith(prefix + ".")
    ]
    loaded = list(moe.load_weights(iter(weights)))
    if expect_all_loaded:
        # One successful load per checkpoint tensor under the experts prefix.
        assert len(loaded) == len(weights), (len(loaded), len(weights))
    moe.routed_experts.quant_method.process_weights_after_loading(moe.routed_experts)
    return moe, named, loaded


def run_moe(moe, x: torch.Tensor, logits: torch.Tensor, vllm_config) -> torch.Tensor:
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, vllm_config), torch.no_grad():
        return moe(x, logits)


@pytest.mark.parametrize("name", list(FIXTURE_SUBSETS))
def test_fixture_subset_digest(name):
    assert (
        sha256(MOE_FIXTURES / name / "layers.safetensors") == FIXTURE_SUBSETS[name][1]
    )


@pytest.mark.parametrize("name", list(FIXTURE_SUBSETS))
def test_moe_layer_matches_oracle(name, tmp_path, world1):
    from vllm.model_executor.layers.quantization.exl3.moe import Exl3MoEMethod
    from vllm.model_executor.layers.quantization.exl3.moe_kernels import (
        ReferenceExl3MoEKernel,
    )

    ckpt = assemble(name, tmp_path / "ckpt")
    layer = 1 if name.startswith("dsv3") else 0
    prefix = f"model.layers.{layer}.mlp.experts"
    moe, named, loaded = build_moe(ckpt, prefix)
    experts = moe.routed_experts
    method = experts.quant_method
    assert isinstance(method, Exl3MoEMethod)
    assert isinstance(method.kernel, ReferenceExl3MoEKernel)
    assert {n for n, _ in experts.named_parameters()} == {
        "w13_trellis",
        "w13_suh",
        "w13_svh",
        "w2_trellis",
        "w2_suh",
        "w2_svh",
    }
    assert {
        "w13_trellis",
        "w13_suh",
        "w13_svh",
        "w2_trellis",
        "w2_suh",
        "w2_svh",
    } <= set(loaded)

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(TOKENS, 256, generator=gen)
    router = named[f"model.layers.{layer}.mlp.gate.weight"].float()
    logits = x @ router.t()
    weights, ids = softmax_topk(x, logits, moe.routed_experts.top_k, True)
    # Every expert is used by some token, so every expert's decode is checked.
    assert len(torch.unique(ids)) == 16, torch.unique(ids)
    y = run_moe(moe, x, logits, world1)
    expected = moe_reference(x, weights, ids, decoded_modules(ckpt), prefix)
    err = (y.double() - expected).abs().max().item()
    assert err <= RTOL * expected.abs().max().item(), f"max |err| {err:.3g}"
