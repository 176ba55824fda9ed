# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EXL3 MoE through vLLM's own classes on CPU, against the oracle.

* One MoE layer of each real fixture conversion through vLLM's FusedMoE (MoERunner +
  RoutedExperts + Exl3MoEMethod + the reference MoE kernel), loaded through
  `MoERunner.load_weights` as a model's AutoWeightsLoader feeds it, against the
  plain-torch oracle built from the same safetensors decoded by reference.reconstruct.
  Routing is a pure-torch custom_routing_function on both sides (vLLM's top-k ops are
  CUDA-only), so these tests are about the experts; the model tests cover vLLM's own
  routers.
* Each real fixture MoE conversion (its leading layers, tests/fixtures/moe) through
  vLLM's model loader: Qwen3MoeForCausalLM and DeepseekV3ForCausalLM (MLA with EXL3
  q_a/q_b/kv_a (192 outputs padded to 256)/o, kv_b as stored fp16, a dense first layer,
  sigmoid routing with the correction bias, a shared expert), a forward of a few tokens
  compared with transformers' own model class running the same checkpoint decoded to
  dense by the reference codec (moe_checkpoints.py).
* A synthetic EXL3 checkpoint of each MoE architecture both ExLlamaV3 1.6.5 and vLLM
  0.26 run, written in ExLlamaV3's layout (vllm_exl3.testing.synthetic_checkpoint),
  every MoE block checked against the oracle (moe_model_run.py). Bitrates differ
  between experts and between gate, up and down, so one layer's per-expert rate table
  is exercised on every architecture.
* DeepSeek-Sparse-Attention checkpoints (DeepSeek-V3.2, GLM-5 with a "shared"
  indexer layer) through vLLM's loader: every parameter written, the indexers where
  vLLM's schedule puts them, every EXL3 linear (the indexer's wq_b included) against the
  reference decode, the fp16 indexer tensors as stored, the MoE blocks against the
  oracle.
* MTP draft layers (DeepSeek-V3, GLM-4.5 and DeepSeek-V3.2 layouts: enorm, hnorm, an
  EXL3 eh_proj, a whole decoder layer with EXL3 attention (and a DSA indexer) and MoE,
  shared_head.norm; the MTP head is not stored, vLLM's proposer shares the target's)
  load through vLLM's MTP model classes with the target's own quant config: target and
  draft built from one VllmConfig, their layers distinct, the draft's eh_proj and MoE
  block equal to the checkpoint decoded by the reference.
* Two ranks (two spawned processes, one gloo world): tensor parallel 2 on a synthetic
  Qwen3-MoE checkpoint (expert width 256, so 128 per rank, mixed per-expert rates),
  every MoE block against the full oracle and the logits equal to TP=1's; the real
  fixture layer at TP=2 fails closed (its expert width 128 would put 64 rows of each
  down projection on a rank, half a Hadamard block); expert parallel 2 on the real
  fixture layer with 8 of its 16 experts per rank (vLLM's expert map), each rank
  loading only its own, the combined output against the full oracle.
"""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from vllm_exl3.testing import synthetic_checkpoint as synth

from .exl3_harness import config_for
from .moe_checkpoints import (
    FIXTURE_SUBSETS,
    MOE_FIXTURES,
    TOKENIZER,
    assemble,
    decoded_modules,
    link_tokenizer,
    sha256,
    transformers_model,
)
from .moe_model_run import (
    assert_linear_matches,
    check_moe_blocks,
    checkpoint_tensors,
    exl3_linear_calls,
    load_model,
    load_target_and_draft,
    record_unloaded,
    vllm_logits,
)
from .moe_oracle import moe_reference, softmax_topk

LAYER_TOKENS = 24
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
    cfg = cfg.get("text_config", cfg)  # multimodal checkpoints (Qwen3.5) nest it
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
    x = torch.randn(LAYER_TOKENS, 256, generator=gen)
    router = named[f"model.layers.{layer}.mlp.gate.weight"].float()
    logits = x @ router.t()
    weights, ids = softmax_topk(x, logits, moe.routed_experts.top_k, True)
    # Every expert is used by some token, so every expert's decode is checked.
    assert len(torch.unique(ids)) == 16, torch.unique(ids)
    y = run_moe(moe, x, logits, world1)
    expected = moe_reference(x, weights, ids, decoded_modules(ckpt), prefix)
    err = (y.double() - expected).abs().max().item()
    assert err <= RTOL * expected.abs().max().item(), f"max |err| {err:.3g}"


# Each real fixture MoE conversion (its leading layers, tests/fixtures/moe) through
# vLLM's own model loader on CPU: Qwen3MoeForCausalLM and DeepseekV3ForCausalLM (MLA
# with EXL3 q_a/q_b/kv_a (192 outputs padded to 256)/o, kv_b as stored fp16, a dense
# first layer, sigmoid routing with the correction bias, a shared expert) built with
# Exl3Config, the weights streamed through the models' load_weights, then a forward of a
# few tokens compared with transformers' own model class running the same checkpoint
# decoded to dense by the reference codec (moe_checkpoints.py).

TOKENS = 32
# fp16, the finer of the two activation dtypes EXL3 accepts: in bf16 a near-tie in the
# router logits can pick another expert for one token on one side only (seen: one token
# of 32, +0.4).
MODEL_DTYPE = "float16"
REPO_VAL = TOKENIZER.parent / "val.txt"


def token_ids(count: int = TOKENS) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    return torch.tensor(tok.encode(REPO_VAL.read_text()[:2000]).ids[:count])


def reference_logits(ckpt, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    model = transformers_model(ckpt, dtype)
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


def check_against_transformers(ckpt, got: torch.Tensor, ids: torch.Tensor) -> None:
    """vLLM runs in fp16: its distance to the fp32 truth must be that of an fp16 run."""
    exact = reference_logits(ckpt, ids, torch.float32)
    half = reference_logits(ckpt, ids, getattr(torch, MODEL_DTYPE))
    err = (got - exact).abs().max().item()
    half_err = (half - exact).abs().max().item()
    assert err <= 2 * half_err, (
        f"max |logit err| {err:.4f}, transformers fp16 {half_err:.4f}"
    )
    agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"top-1 agreement with the fp32 truth {agree:.3f}"


@pytest.mark.parametrize("name", list(FIXTURE_SUBSETS))
def test_fixture_model_matches_transformers(name, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod
    from vllm.model_executor.layers.quantization.exl3.moe import Exl3MoEMethod

    ckpt = assemble(name, tmp_path / "ckpt")
    ids = token_ids()
    got, model = vllm_logits(ckpt, ids, monkeypatch, dtype=MODEL_DTYPE)
    moe_methods = [
        m.quant_method for n, m in model.named_modules() if n.endswith("routed_experts")
    ]
    assert moe_methods and all(isinstance(q, Exl3MoEMethod) for q in moe_methods)
    exl3_linears = [
        n
        for n, m in model.named_modules()
        if isinstance(m, LinearBase) and isinstance(m.quant_method, Exl3LinearMethod)
    ]
    if name.startswith("dsv3"):
        # MLA (fused q_a + kv_a, q_b, o), the dense layer's MLP, the shared expert.
        assert any(n.endswith("fused_qkv_a_proj") for n in exl3_linears), exl3_linears
        assert any(n.endswith("shared_experts.down_proj") for n in exl3_linears)
        kv_b = model.model.layers[1].self_attn.kv_b_proj
        assert not isinstance(kv_b.quant_method, Exl3LinearMethod)
    assert got.shape == (TOKENS, 4096)
    assert torch.isfinite(got).all()
    check_against_transformers(ckpt, got, ids)


def test_dsv3_fixture_as_mha_matches_transformers(tmp_path, monkeypatch, world1):
    """dsv3-tiny with VLLM_MLA_DISABLE=1: vLLM's DeepSeek MHA attention (kv_b expanded
    per token, q_a and kv_a as separate EXL3 linears), the form its GPU perplexity run
    takes on Hopper, where vLLM 0.26 has no MLA kernel for the fixture's dims."""
    import vllm.envs as envs
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod

    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    envs.disable_envs_cache()
    ckpt = assemble("dsv3-4.0bpw-mcg", tmp_path / "ckpt")
    ids = token_ids()
    got, model = vllm_logits(ckpt, ids, monkeypatch, dtype=MODEL_DTYPE)
    attn = model.model.layers[1].self_attn
    assert not hasattr(attn, "mla_attn"), type(attn).__name__
    for name in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj"):
        assert isinstance(getattr(attn, name).quant_method, Exl3LinearMethod), name
    assert not isinstance(attn.kv_b_proj.quant_method, Exl3LinearMethod)
    assert got.shape == (TOKENS, 4096)
    assert torch.isfinite(got).all()
    check_against_transformers(ckpt, got, ids)


# A synthetic EXL3 checkpoint of each MoE architecture both ExLlamaV3 1.6.5 and vLLM
# 0.26 run, written in ExLlamaV3's layout (vllm_exl3.testing.synthetic_checkpoint,
# names from its architecture files), loaded through vLLM's own model loader, every
# MoE block checked against the oracle (moe_model_run.py). Bitrates differ between
# experts and between gate, up and down, so one layer's per-expert rate table is
# exercised on every architecture.

# Two decoder layers: one MoE layer at least in every preset (DeepSeek-V3 and GLM-4.5
# start with a dense one).
LAYERS = 2
# (preset, codebook, default bits, per-module overrides: first fnmatch pattern wins)
ARCHITECTURES = {
    "qwen3-moe": (
        "qwen3-moe-tiny",
        "mcg",
        4,
        {"*.experts.1.*": 2, "*.experts.2.down_proj": 5, "*.experts.3.up_proj": 3},
    ),
    "deepseek-v3": (
        "deepseek-v3-tiny",
        "3inst",
        3,
        {"*.experts.0.*": 4, "*.experts.5.gate_proj": 2, "*.experts.*.down_proj": 5},
    ),
    "glm4-moe": (
        "glm4-moe-tiny",
        "mul1",
        4,
        {"*.experts.2.*": 2.5, "*.experts.6.up_proj": 3.5, "*.experts.7.down_proj": 6},
    ),
    "mixtral": ("mixtral-tiny", "mcg", 3, {"*.experts.4.w2": 4, "*.experts.5.*": 2}),
    # Expert width 192: stored padded to 256 (svh = 0 on the padding), vLLM's width
    # rounded up.
    "qwen3-moe-padded": (
        {**synth.PRESETS["qwen3-moe-tiny"], "moe_intermediate_size": 192},
        "3inst",
        3,
        {"*.experts.6.*": 4},
    ),
    "qwen3-next": (
        "qwen3-next-tiny",
        "mul1",
        4,
        {"*.experts.3.*": 1.5, "*.experts.4.gate_proj": 8},
    ),
}


def write(arch: str, out, **kwargs):
    preset, codebook, bits, overrides = ARCHITECTURES[arch]
    synth.write_checkpoint(
        preset,
        out,
        bits=bits,
        codebook=codebook,
        bits_overrides=overrides,
        mtp=False,
        seed=7,
        layers=LAYERS,
        **kwargs,
    )
    link_tokenizer(out)
    return out


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_synthetic_architecture(arch, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.quantization.exl3.moe import Exl3MoEMethod

    ckpt = write(arch, tmp_path / arch)
    model, vllm_config = load_model(ckpt, monkeypatch, MODEL_DTYPE)
    methods = [
        m.quant_method for n, m in model.named_modules() if n.endswith("routed_experts")
    ]
    assert methods and all(isinstance(q, Exl3MoEMethod) for q in methods)
    assert all(q.width % 128 == 0 for q in methods), [q.width for q in methods]
    # The per-expert rate table holds every rate the overrides asked for (k2 = 2 *
    # bits).
    _, _, bits, overrides = ARCHITECTURES[arch]
    k2 = set()
    for name, module in model.named_modules():
        if name.endswith("routed_experts"):
            k2 |= set(module.w13_meta[..., 1].flatten().tolist())
            k2 |= set(module.w2_meta[:, 1].tolist())
    assert k2 == {int(2 * b) for b in (bits, *overrides.values())}, sorted(k2)
    assert check_moe_blocks(ckpt, model, vllm_config) >= 1


def test_mla_kv_b_proj_stored_as_exl3(tmp_path, monkeypatch, world1):
    """A DeepSeek-V3 checkpoint whose kv_b_proj is EXL3 (ExLlamaV3 keeps it fp16,
    another writer may not): loaded as EXL3 and reconstructed once into the dense weight
    MLA absorbs; the model equals the same checkpoint with that weight stored as fp16.
    """
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization.exl3 import reference
    from vllm.model_executor.layers.quantization.exl3.dequantized import (
        Exl3DequantizedLinearMethod,
    )

    from .moe_model_run import run_logits

    exl3_dir, dense_dir = (
        write("deepseek-v3", tmp_path / d) for d in ("exl3", "dense")
    )
    named = load_file(str(exl3_dir / "model.safetensors"))
    dense_named = dict(named)
    storage_path = exl3_dir / "quantization_config.json"
    document = json.loads(storage_path.read_text())
    gen = torch.Generator().manual_seed(11)
    decoded = {}
    for name in [k for k in named if k.endswith("kv_b_proj.weight")]:
        module = name.rpartition(".")[0]
        out, inp = named.pop(name).shape
        slot = synth.LinearSlot(module, inp, out, "column", module)
        tensors = synth._exl3_tensors(
            slot, 4, synth.CODEBOOK_NAMES["3inst"], False, gen
        )
        named.update(tensors)
        w = reference.reconstruct(
            tensors[f"{module}.trellis"],
            tensors[f"{module}.suh"],
            tensors[f"{module}.svh"],
            0,
        )[:inp, :out].t()
        decoded[module] = w
        dense_named[name] = w.half().contiguous()
        document["tensor_storage"][module] = {
            "stored_tensors": synth._storage_entry(tensors),
            "quant_format": "exl3",
            "bits_per_weight": 4,
        }
    assert len(decoded) == 2
    save_file(named, str(exl3_dir / "model.safetensors"), metadata={"format": "pt"})
    storage_path.write_text(json.dumps(document))
    save_file(
        dense_named, str(dense_dir / "model.safetensors"), metadata={"format": "pt"}
    )

    ids = token_ids(12)
    model, vllm_config = load_model(exl3_dir, monkeypatch, MODEL_DTYPE)
    for module, w in decoded.items():
        layer = model.get_submodule(module)
        assert isinstance(layer.quant_method, Exl3DequantizedLinearMethod)
        assert {n for n, _ in layer.named_parameters()} == {"weight"}
        err = (layer.weight.double() - w.double()).abs().max().item()
        assert err <= 2**-10 * w.abs().max().item(), f"{module}: {err}"
    got = run_logits(model, vllm_config, ids)
    model, vllm_config = load_model(dense_dir, monkeypatch, MODEL_DTYPE)
    kv_b = model.get_submodule(next(iter(decoded)))
    assert type(kv_b.quant_method).__name__ == "Exl3PaddedUnquantizedLinearMethod"
    assert isinstance(kv_b.quant_method, UnquantizedLinearMethod)
    want = run_logits(model, vllm_config, ids)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max().item() <= 8 * 2**-10 * want.abs().max().item()


# DeepSeek-Sparse-Attention layouts (DeepSeek-V3.2, GLM-5 `glm_moe_dsa`): the MLA +
# MoE body with a lightning indexer per scoring layer, as ExLlamaV3 stores it (wq_b
# EXL3; wk, weights_proj fp16 at their real dims; k_norm weight + bias), through vLLM's
# loader. Every parameter of the model is written by the checkpoint, the indexers sit
# on the layers vLLM's schedule gives (GLM-5's "shared" layer has none, and stores
# none), every EXL3 linear (the indexer's wq_b included) equals the reference decode,
# the unquantized indexer tensors are the stored ones, and every MoE block matches the
# oracle. A forward through the sparse path needs the indexer's CUDA kernels (the GPU
# end-to-end script runs it: scripts/e2e/run_sparse_mla_e2e.py).

DSA_LAYERS = 3
DSA_ARCHITECTURES = {
    "deepseek-v32": (
        "deepseek-v32-tiny",
        "mcg",
        3,
        {"*.indexer.wq_b": 5, "*.experts.2.*": 4, "*.q_b_proj": 2},
    ),
    "glm5": (
        "glm5-tiny",
        "mul1",
        4,
        {"*.indexer.wq_b": 2.5, "*.experts.3.down_proj": 6},
    ),
}


def check_exl3_linears(model, vllm_config, dense: dict, cfg: dict) -> set[str]:
    """Every EXL3 linear of `model` (and its lm_head through compute_logits): y = x @ W
    of its (fused) checkpoint modules decoded by reference, each cut to its real output
    width. Returns the checkpoint modules checked."""
    checked = set()
    calls = exl3_linear_calls(
        model,
        vllm_config,
        cfg["hidden_size"],
        getattr(torch, MODEL_DTYPE),
        5,
        LAYER_TOKENS,
    )
    for name, layer, x, y in calls:
        if layer is None:
            prefixes, widths = ["lm_head"], [cfg["vocab_size"]]
        else:
            prefixes = [spec.prefix for spec in layer.quant_method.specs]
            widths = layer.output_partition_sizes
        expected = torch.cat(
            [
                x.double() @ dense[p].double()[: x.shape[1], :width]
                for p, width in zip(prefixes, widths)
            ],
            dim=-1,
        )
        assert_linear_matches(y, expected, name)
        checked.update(prefixes)
    return checked


@pytest.mark.parametrize("arch", list(DSA_ARCHITECTURES))
def test_dsa_checkpoint_loads(arch, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.quantization.exl3.checkpoint import (
        vllm_indexer_layers,
    )
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM

    preset, codebook, bits, overrides = DSA_ARCHITECTURES[arch]
    ckpt = tmp_path / arch
    written = synth.write_checkpoint(
        preset,
        ckpt,
        bits=bits,
        codebook=codebook,
        bits_overrides=overrides,
        layers=DSA_LAYERS,
        mtp=False,
        seed=13,
    )
    link_tokenizer(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    owners = vllm_indexer_layers(cfg)
    unloaded = record_unloaded(monkeypatch, DeepseekV2ForCausalLM)
    model, vllm_config = load_model(ckpt, monkeypatch, MODEL_DTYPE)
    assert unloaded == set(), sorted(unloaded)

    named = checkpoint_tensors(ckpt)
    built = [layer.self_attn.indexer is not None for layer in model.model.layers]
    stored = [
        f"model.layers.{i}.self_attn.indexer.wq_b.trellis" in named
        for i in range(DSA_LAYERS)
    ]
    assert built == stored == owners, (built, stored, owners)
    if arch == "glm5":
        assert owners == [t == "full" for t in cfg["indexer_types"]] and not all(owners)
    assert (
        written["model.layers.0.self_attn.indexer.wq_b"][0]
        == overrides["*.indexer.wq_b"]
    )

    dense = decoded_modules(ckpt)
    checked = check_exl3_linears(model, vllm_config, dense, cfg)
    exl3_linears = {p for p in dense if ".experts." not in p}
    assert checked == exl3_linears, sorted(exl3_linears ^ checked)
    assert any(".indexer.wq_b" in p for p in checked)
    dtype = getattr(torch, MODEL_DTYPE)

    # The indexer's unquantized tensors and kv_b_proj, as stored (fp16 into an fp16
    # model: exact).
    for i, layer in enumerate(model.model.layers):
        attn, prefix = layer.self_attn, f"model.layers.{i}.self_attn"
        assert torch.equal(
            attn.kv_b_proj.weight, named[f"{prefix}.kv_b_proj.weight"].to(dtype)
        )
        if attn.indexer is None:
            assert not any(n.startswith(f"{prefix}.indexer.") for n in named)
            continue
        idx = f"{prefix}.indexer"
        wk_weights = torch.cat(
            [named[f"{idx}.wk.weight"], named[f"{idx}.weights_proj.weight"]]
        )
        assert torch.equal(attn.indexer.wk_weights_proj.weight, wk_weights.to(dtype))
        for leaf in ("weight", "bias"):
            assert torch.equal(
                getattr(attn.indexer.k_norm, leaf).float(),
                named[f"{idx}.k_norm.{leaf}"].float(),
            ), f"{idx}.k_norm.{leaf}"
    assert check_moe_blocks(ckpt, model, vllm_config) >= 1


# MTP draft layers of an EXL3 checkpoint (DeepSeek-V3 and GLM-4.5 layouts: enorm, hnorm,
# an EXL3 eh_proj, a whole decoder layer with EXL3 attention and MoE, shared_head.norm;
# the MTP head is not stored, vLLM's proposer shares the target's) load through vLLM's
# MTP model classes with the target's own quant config: target and draft built from one
# VllmConfig, their layers distinct, the draft's eh_proj and MoE block equal to the
# checkpoint decoded by the reference.

MTP_BITS = 5  # the draft layers at their own rate (the converter's mtp_bits)


@pytest.mark.parametrize("arch", ["deepseek-v3", "glm4-moe", "deepseek-v32"])
def test_mtp_draft_loads_exl3_layers(arch, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod
    from vllm.model_executor.layers.quantization.exl3.moe import Exl3MoEMethod

    preset, codebook, bits, _ = {**ARCHITECTURES, **DSA_ARCHITECTURES}[arch]
    cfg = synth.load_config(preset)
    cfg["num_nextn_predict_layers"] = 1
    ckpt = tmp_path / arch
    written = synth.write_checkpoint(
        cfg,
        ckpt,
        bits=bits,
        codebook=codebook,
        mtp_bits=MTP_BITS,
        layers=LAYERS,
        seed=9,
    )
    link_tokenizer(ckpt)
    mtp = f"model.layers.{LAYERS}"
    assert written[f"{mtp}.eh_proj"][0] == MTP_BITS
    assert written[f"{mtp}.mlp.experts.0.down_proj"][0] == MTP_BITS

    target, draft, vllm_config = load_target_and_draft(ckpt, monkeypatch, MODEL_DTYPE)
    layer = draft.model.layers[str(LAYERS)]
    assert isinstance(layer.eh_proj.quant_method, Exl3LinearMethod)
    draft_moe = layer.mtp_block.mlp.experts.routed_experts
    assert isinstance(draft_moe.quant_method, Exl3MoEMethod)
    assert set(draft_moe.w13_meta[..., 1].flatten().tolist()) == {2 * MTP_BITS}
    # One quant config, no collision: the draft's MoE layer is registered next to the
    # target's under its own name.
    names = vllm_config.compilation_config.static_forward_context
    assert f"{mtp}.mlp.experts" in names and "model.layers.1.mlp.experts" in names
    assert draft_moe is not target.model.layers[1].mlp.experts.routed_experts

    x = torch.randn(
        6, 2 * cfg["hidden_size"], generator=torch.Generator().manual_seed(4)
    )
    with torch.no_grad():
        y = layer.eh_proj(x.to(getattr(torch, MODEL_DTYPE)))
    w = decoded_modules(ckpt, (f"{mtp}.eh_proj",))[f"{mtp}.eh_proj"]
    expected = x.double() @ w.double()
    err = (y.double() - expected).abs().max().item()
    assert err <= 4e-3 * expected.abs().max().item(), f"eh_proj: max |err| {err:.3g}"
    assert check_moe_blocks(ckpt, draft, vllm_config) == 1
    if "index_topk" in cfg:
        # A DSA draft layer always owns an indexer (ExLlamaV3 stores it, vLLM builds
        # it), at the draft's own rate.
        wq_b = layer.mtp_block.self_attn.indexer.wq_b
        assert isinstance(wq_b.quant_method, Exl3LinearMethod)
        assert written[f"{mtp}.self_attn.indexer.wq_b"][0] == MTP_BITS


# The `mtp.` MTP layout (Qwen3-Next, Qwen3.5 / 3.6: ExLlamaV3's qwen3_5_mtp) with EXL3
# layers: pre_fc_norm_hidden / pre_fc_norm_embedding, an EXL3 fc (2 * hidden ->
# hidden), a full-attention decoder layer (gated q, q/k norms) with MoE and a gated
# shared expert, mtp.norm. Target (Qwen3NextForCausalLM) and draft (Qwen3NextMTP) come
# from one VllmConfig and share its Exl3Config: vLLM names the draft's modules mtp.*,
# as the checkpoint names the tensors, so they resolve exactly and never to a target
# layer (whose names carry no mtp segment).

# ExLlamaV3's module order for one MTP layer of this layout (qwen3_5_mtp.py: the input
# layer's norms and fc, the decoder layer, the final norm): the tensor_storage order.
NEXT_MTP_MODULES = (
    "mtp.pre_fc_norm_hidden",
    "mtp.pre_fc_norm_embedding",
    "mtp.fc",
    "mtp.layers.0.input_layernorm",
    "mtp.layers.0.self_attn.q_proj",
    "mtp.layers.0.self_attn.k_proj",
    "mtp.layers.0.self_attn.v_proj",
    "mtp.layers.0.self_attn.o_proj",
    "mtp.layers.0.self_attn.q_norm",
    "mtp.layers.0.self_attn.k_norm",
    "mtp.layers.0.post_attention_layernorm",
    "mtp.layers.0.mlp.gate",
)
# One draft expert at another rate: the draft's per-expert rate table is exercised too.
NEXT_MTP_OVERRIDES = {"mtp.layers.0.mlp.experts.2.*": 3}


def write_next_mtp(out, **kwargs) -> dict:
    preset, codebook, bits, overrides = ARCHITECTURES["qwen3-next"]
    cfg = synth.load_config(preset)
    cfg["mtp_num_hidden_layers"] = 1
    written = synth.write_checkpoint(
        cfg,
        out,
        bits=bits,
        codebook=codebook,
        mtp_bits=MTP_BITS,
        bits_overrides={**NEXT_MTP_OVERRIDES, **overrides},
        layers=LAYERS,
        seed=21,
        **kwargs,
    )
    link_tokenizer(out)
    return written


def test_qwen3_next_mtp_draft_loads_exl3_layers(tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod
    from vllm.model_executor.layers.quantization.exl3.moe import Exl3MoEMethod
    from vllm.model_executor.models.qwen3_next_mtp import Qwen3NextMTP

    ckpt = tmp_path / "qwen3-next-mtp"
    written = write_next_mtp(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["mtp_bits"] == MTP_BITS
    storage = json.loads((ckpt / "quantization_config.json").read_text())
    stored = [k for k in storage["tensor_storage"] if k.startswith("mtp.")]
    assert tuple(stored[: len(NEXT_MTP_MODULES)]) == NEXT_MTP_MODULES, stored
    assert stored[-1] == "mtp.norm"
    for module in ("mtp.fc", "mtp.layers.0.self_attn.q_proj"):
        assert written[module][0] == MTP_BITS, module
    assert written["mtp.layers.0.mlp.experts.2.up_proj"][0] == 3
    assert written["mtp.layers.0.mlp.shared_expert.down_proj"][0] == MTP_BITS

    unloaded = record_unloaded(monkeypatch, Qwen3NextMTP)
    target, draft, vllm_config = load_target_and_draft(ckpt, monkeypatch, MODEL_DTYPE)
    # Every draft parameter written (the routed experts' are reported under the
    # runner's name; the EXL3 MoE method checks every expert tensor arrived); a
    # checkpoint mtp.* tensor with no destination would have failed the draft's loader
    # by name.
    unloaded = {n for n in unloaded if ".routed_experts." not in n}
    assert isinstance(draft, Qwen3NextMTP) and unloaded == set(), sorted(unloaded)
    mtp = draft.model
    assert [s.prefix for s in mtp.fc.quant_method.specs] == ["mtp.fc"]
    layer = mtp.layers[0]
    draft_moe = layer.mlp.experts.routed_experts
    assert isinstance(draft_moe.quant_method, Exl3MoEMethod)
    # The draft's per-expert rate table (the body's overrides match its experts too).
    rates = {
        2 * written[f"mtp.layers.0.mlp.experts.{e}.{proj}"][0]
        for e in range(cfg["num_experts"])
        for proj in ("gate_proj", "up_proj")
    }
    assert set(draft_moe.w13_meta[..., 1].flatten().tolist()) == rates
    assert {2 * MTP_BITS, 2 * 3} < rates
    # One quant config, no collision: the draft's attention and MoE layers registered
    # next to the target's under their own names, every layer resolved to its own
    # checkpoint modules.
    names = vllm_config.compilation_config.static_forward_context
    for name in (
        "mtp.layers.0.mlp.experts",
        "mtp.layers.0.self_attn.attn",
        "model.layers.0.mlp.experts",
        "model.layers.1.self_attn.attn",
    ):
        assert name in names, name
    assert draft_moe is not target.model.layers[0].mlp.experts.routed_experts
    for model, inside in ((target, False), (draft, True)):
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if isinstance(method, Exl3LinearMethod):
                for spec in method.specs:
                    assert spec.prefix.startswith("mtp.") == inside, (name, spec)

    # The draft's EXL3 linears (fc, qkv with the output gate, o, the shared expert, the
    # head it loads) against the reference decode, its MoE block against the oracle,
    # its norms as stored.
    dense = decoded_modules(ckpt)
    checked = check_exl3_linears(draft, vllm_config, dense, cfg)
    expected = {p for p in dense if p.startswith("mtp.") and ".experts." not in p}
    assert checked == expected | {"lm_head"}, sorted(checked ^ (expected | {"lm_head"}))
    assert (
        check_moe_blocks(
            ckpt,
            draft,
            vllm_config,
            checkpoint_name=lambda n: "mtp." + n.removeprefix("model."),
        )
        == 1
    )
    named = checkpoint_tensors(ckpt)
    norms = {
        "mtp.pre_fc_norm_hidden": mtp.pre_fc_norm_hidden,
        "mtp.pre_fc_norm_embedding": mtp.pre_fc_norm_embedding,
        "mtp.norm": mtp.norm,
        "mtp.layers.0.input_layernorm": layer.input_layernorm,
        "mtp.layers.0.post_attention_layernorm": layer.post_attention_layernorm,
        "mtp.layers.0.self_attn.q_norm": layer.self_attn.q_norm,
        "mtp.layers.0.self_attn.k_norm": layer.self_attn.k_norm,
    }
    for name, norm in norms.items():
        assert torch.equal(norm.weight.float(), named[f"{name}.weight"].float()), name


def _edit_tensors(ckpt, edit) -> None:
    """Rewrite the (single-file) checkpoint's tensors through `edit(dict)`."""
    from safetensors.torch import save_file

    path = ckpt / "model.safetensors"
    named = load_file(str(path))
    edit(named)
    save_file(named, str(path), metadata={"format": "pt"})


def _drop(*prefixes):
    def edit(named):
        gone = [k for k in named if k.startswith(prefixes)]
        assert gone, prefixes
        for k in gone:
            del named[k]

    return edit


def _wider_fc(named):
    from vllm_exl3.architecture import LinearSlot

    for k in [k for k in named if k.startswith("mtp.fc.")]:
        del named[k]
    slot = LinearSlot("mtp.fc", 512, 256 + 128, "column", "mtp.fc")
    gen = torch.Generator().manual_seed(0)
    named.update(
        synth._exl3_tensors(slot, MTP_BITS, synth.fmt.Codebook.MUL1, False, gen)
    )


def _extra_layer(named):
    named["mtp.layers.1.input_layernorm.weight"] = named[
        "mtp.layers.0.input_layernorm.weight"
    ].clone()


# (edit of the checkpoint, the message the validator's first problem starts with)
BAD_NEXT_MTP = {
    "missing-norm": (
        _drop("mtp.pre_fc_norm_embedding."),
        r"mtp\.pre_fc_norm_embedding\.weight: missing",
    ),
    "missing-linear": (
        _drop("mtp.layers.0.self_attn.k_proj."),
        r"mtp\.layers\.0\.self_attn\.k_proj: missing",
    ),
    "missing-expert": (
        _drop("mtp.layers.0.mlp.experts.5."),
        r"mtp\.layers\.0\.mlp\.experts\.5: missing",
    ),
    "fc-shape": (_wider_fc, r"mtp\.fc\.trellis: stored k x n = 512 x 384"),
    "norm-shape": (
        lambda named: named.update(
            {"mtp.norm.weight": named["mtp.norm.weight"].repeat(2)}
        ),
        r"mtp\.norm\.weight: shape \[512\]",
    ),
    "extra-layer": (_extra_layer, r"mtp\.layers\.1: stored"),
}


@pytest.mark.parametrize("case", list(BAD_NEXT_MTP))
def test_qwen3_next_mtp_damage_is_named(case, tmp_path):
    from vllm.model_executor.layers.quantization.exl3.checkpoint import (
        validate_checkpoint,
    )
    from vllm.model_executor.layers.quantization.exl3.checkpoint_files import (
        Exl3FormatError,
    )

    edit, message = BAD_NEXT_MTP[case]
    ckpt = tmp_path / case
    write_next_mtp(ckpt)
    validate_checkpoint(ckpt)  # as written: valid
    _edit_tensors(ckpt, edit)
    with pytest.raises(Exl3FormatError, match="^" + message):
        validate_checkpoint(ckpt)


def test_qwen3_next_mtp_fails_closed_in_vllm(tmp_path, monkeypatch, world1):
    """Through vLLM's loader: a missing MTP tensor stops ModelConfig; an expert whose
    rate quantization_config.json does not claim, or an mtp.* tensor nothing in the
    draft claims, stops the draft (the target, sharing the config, loads); a conversion
    without MTP layers loads the target and names the first draft layer."""
    from vllm.model_executor.layers.quantization.exl3.checkpoint_files import (
        Exl3FormatError,
    )
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    missing = tmp_path / "missing"
    write_next_mtp(missing)
    _edit_tensors(missing, _drop("mtp.layers.0.mlp.shared_expert_gate."))
    # VllmConfig's validation wraps the checkpoint's Exl3FormatError (a ValueError).
    with pytest.raises(
        ValueError, match=r"mtp\.layers\.0\.mlp\.shared_expert_gate: missing"
    ):
        load_target_and_draft(missing, monkeypatch, MODEL_DTYPE)

    unclaimed = tmp_path / "unclaimed"
    write_next_mtp(unclaimed)
    doc_path = unclaimed / "quantization_config.json"
    doc = json.loads(doc_path.read_text())
    expert = "mtp.layers.0.mlp.experts.1.down_proj"
    doc["tensor_storage"][expert]["bits_per_weight"] = MTP_BITS + 1
    doc_path.write_text(json.dumps(doc))
    with pytest.raises(
        Exl3LayoutError,
        match=rf"EXL3 {re.escape(expert)}\.trellis: {MTP_BITS}(\.0)? bits per weight.*"
        rf"claims {MTP_BITS + 1}",
    ):
        load_target_and_draft(unclaimed, monkeypatch, MODEL_DTYPE)

    extra = tmp_path / "extra"
    write_next_mtp(extra)
    _edit_tensors(
        extra,
        lambda named: named.update(
            {"mtp.layers.0.self_attn.bogus.weight": named["mtp.norm.weight"].clone()}
        ),
    )
    # The draft's loader names it after its own module tree (mtp. -> model.).
    with pytest.raises(
        ValueError, match=r"no module or parameter named 'layers\.0\.self_attn\.bogus'"
    ):
        load_target_and_draft(extra, monkeypatch, MODEL_DTYPE)

    bare = tmp_path / "bare"
    write_next_mtp(bare, mtp=False)
    cfg = json.loads((bare / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        Exl3FormatError, match=r"^mtp\.fc: missing: the checkpoint stores no MTP layers"
    ):
        load_target_and_draft(bare, monkeypatch, MODEL_DTYPE)


# EXL3 MoE across two ranks on CPU (two spawned processes, one gloo world):
#
# * tensor parallel 2: a synthetic Qwen3-MoE checkpoint (expert width 256, so 128 per
#   rank, mixed per-expert rates) through vLLM's loader; every MoE block (each rank's
#   half of every expert, then the runner's all-reduce) against the full oracle, and the
#   model's logits equal to TP=1's;
# * the real fixture layer at TP=2 fails closed: its expert width 128 would put 64 rows
#   of each down projection on a rank, half a Hadamard block;
# * expert parallel 2: the real fixture layer with 8 of its 16 experts per rank (vLLM's
#   expert map), each rank loading only its own, the combined output against the full
#   oracle.

WORLD = 2
TP2_LOGITS = "tp2_logits.pt"
# TP=2 differs from TP=1 in summation order (the MoE and row-parallel all-reduces) and
# the fp16 roundings after it; a misplaced expert column costs far more.
LOGITS_ULPS = 8
FIXTURE = "qwen3moe-e16-3.0bpw-mcg"
EXPERTS = "model.layers.0.mlp.experts"


@contextlib.contextmanager
def ep_world(rank: int, init_file: str):
    """A gloo world of 2 whose MoE layers split experts (EP) instead of expert widths
    (TP)."""
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig

    from .exl3_harness import gloo_world

    vllm_config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        parallel_config=ParallelConfig(
            tensor_parallel_size=WORLD, enable_expert_parallel=True
        ),
    )
    with gloo_world(WORLD, rank, init_file, vllm_config) as config:
        yield config


def _rank_main(rank: int, tmp: str, synthetic: str, fixture: str) -> None:
    from pathlib import Path

    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    from .exl3_harness import gloo_world
    from .moe_checkpoints import decoded_modules
    from .moe_model_run import check_moe_blocks, load_model, run_logits
    from .moe_oracle import moe_reference, softmax_topk

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
    from .moe_checkpoints import assemble
    from .moe_model_run import vllm_logits

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
