# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Tensor parallel 2 on the Qwen3.5 fixtures ExLlamaV3 1.6.5 wrote
(tests/fixtures/qwen3_5), on CPU: two spawned processes in one gloo world load the whole
checkpoint through vLLM's model loader into vLLM 0.26's real
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration, each rank taking
its slice.

Dense fixture, TP=2 against TP=1 (this process, the ordinary TP=1 model):
* with the default encoder mode the load fails closed, naming the vision tower's
  attention output projection (128 input features, 64 per rank: half a Hadamard
  block); `--mm-encoder-tp-mode data` is what the user guide says to add;
* `--language-model-only` loads in either encoder mode: vLLM builds the skipped tower
  on the meta device only to drop it, and its linears take the unquantized method
  (config.building_a_dropped_tower), so no EXL3 layout is planned for them;
* with `mm_encoder_tp_mode="data"` (whole model, and language-model-only), and
  language-model-only in the default mode: every parameter of each rank written, no
  checkpoint tensor passed over but the MTP layer's (the draft model loads those); the
  language model split (in_proj_qkvz, qkv_proj, gate_up_proj at half width), the
  tower's EXL3 linears whole on each rank;
* the language model run on 128 tokens of the fixture text: final hidden states and
  logits equal TP=1's within 8 fp16 ulps, perplexity within 1e-3, on both ranks; the
  language-model-only model's logits equal the whole model's on the same rank;
* the tower run on three images of different sizes, sharded by image across the two
  ranks (vLLM's run_dp_sharded_mrope_vision_model) and gathered: each image's
  embeddings equal TP=1's.

MoE fixture: TP=2 is refused. Its experts and its shared expert are 128 wide, so each
rank would hold 64 rows of each down projection (half a Hadamard block, as for the
qwen3moe fixture in test_exl3_moe.py). The whole-model load fails closed, naming the
first block's shared_expert.down_proj (built before the routed experts), with and
without `enable_expert_parallel`: vLLM 0.26 splits Qwen3.5's shared expert over the TP
group unless MoE runs sequence parallel, which needs data parallelism (DP > 1, not run
here). The routed experts alone: at TP=2 refused by name; at expert parallel 2 (vLLM's
expert map, 4 of the 8 experts per rank, each at full width 128) each rank loads only
its own and the combined output equals the oracle.

What does not exist on a GPU-less machine is replaced by the same math in plain torch:
the attention op (causal SDPA), the top-k routing ops (moe_model_run.cpu_stand_ins),
the Gated DeltaNet core (its causal conv, gating and delta-rule recurrence; below), the
vision rotary op's CUDA path (its native path) and pinned host memory. Everything else
(embedding, norms, RoPE, the gated RMS norm, every EXL3 linear, the tower, lm_head) is
vLLM's.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

WORLD = 2
TOKENS = 128
MODEL_DTYPE = "float16"  # the finer of the two activation dtypes EXL3 accepts
# TP=2 differs from TP=1 only in summation order (the row-parallel all-reduces of
# out_proj, o_proj and down_proj) and the fp16 roundings after it: measured 1.2 ulps of
# the largest hidden value and 0.7 of the largest logit; the tower, sharded by image,
# matched exactly. Rank 1 computing rank 0's columns instead costs ~1000 ulps.
ULPS = 8
# The GPU acceptance bound for TP=2 vs TP=1 perplexity.
PPL_RTOL = 1e-3
# Images of 16, 4 and 8 patches (temporal patch 2, patch 16): the tower's data-parallel
# sharding puts the first on one rank and the other two on the other.
IMAGE_GRIDS = [[1, 4, 4], [1, 2, 2], [1, 2, 4]]
# The tower's first block: its attention output projection is 128 inputs wide.
TOWER_PROJ = r"visual\.blocks\.0\.attn\.proj"
SHARED_DOWN = r"language_model\.model\.layers\.0\.mlp\.shared_expert\.down_proj"
EXPERTS = "model.language_model.layers.0.mlp.experts"
# fp32 activations: the kernel accumulates in fp32 over k <= 256, the oracle in fp64.
EXPERTS_RTOL = 2e-5


def _refused_at_64(module: str, rank: int) -> str:
    return (
        rf"EXL3 {module} \(rank {rank} of 2\): row-parallel input slice of 64 "
        r"features is not a multiple of 128"
    )


def token_ids() -> torch.Tensor:
    """The first TOKENS tokens of the qwen3-tiny validation text (the Qwen3.5 fixtures'
    tokenizer keeps qwen3-tiny's 4,096 ids)."""
    from tokenizers import Tokenizer
    from vllm_exl3.testing.fixtures import QWEN3_5, QWEN3_TINY

    tok = Tokenizer.from_file(str(QWEN3_5 / "tokenizer" / "tokenizer.json"))
    text = (QWEN3_TINY / "val.txt").read_text()[:4000]
    return torch.tensor(tok.encode(text, add_special_tokens=False).ids[:TOKENS])


def images() -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel patches of IMAGE_GRIDS (the tower is uncalibrated: random pixels do)."""
    grid = torch.tensor(IMAGE_GRIDS)
    patches = int(grid.prod(-1).sum())
    gen = torch.Generator().manual_seed(0)
    return torch.randn(patches, 3 * 2 * 16 * 16, generator=gen), grid


# The Gated DeltaNet core in plain torch (vLLM's CPU op needs vLLM's _C and a KV cache,
# its GPU ops Triton), on this rank's heads: causal depthwise conv + SiLU over q, k, v;
# q and k L2-normed, each key head shared by num_v_heads / num_k_heads consecutive value
# heads; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); the state S [k, v] of
# each head decays by exp(g), takes beta (v - S^T k) along k, and o = S^T q / sqrt(d_k).
# Checked once over the fixtures' whole perplexity method (360 windows of 512 tokens of
# val.txt, ~14 CPU minutes, TP=1): 45.6467 against ExLlamaV3's 45.6478 for the dense
# fixture, 49.7584 against 49.7618 for the MoE fixture (ppl_exllamav3.json).


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_core(layer, mixed_qkv, b, a) -> torch.Tensor:
    """[T, local v heads, head_v_dim] fp32 of one sequence from the layer's own conv
    weight, A_log and dt_bias (this rank's shards)."""
    t = mixed_qkv.shape[0]
    w = layer.conv1d.weight.reshape(layer.conv1d.weight.shape[0], -1).float()
    x = F.conv1d(
        mixed_qkv.float().t()[None],
        w[:, None],
        padding=w.shape[1] - 1,
        groups=w.shape[0],
    )[0, :, :t].t()
    x = F.silu(x)
    k_dim = layer.key_dim // layer.tp_size
    q, k, v = x.split([k_dim, k_dim, layer.value_dim // layer.tp_size], dim=-1)
    dk, dv = layer.head_k_dim, layer.head_v_dim
    q, k, v = q.view(t, -1, dk), k.view(t, -1, dk), v.view(t, -1, dv)
    per_key = v.shape[1] // q.shape[1]
    q = _l2norm(q).repeat_interleave(per_key, 1) * dk**-0.5
    k = _l2norm(k).repeat_interleave(per_key, 1)
    beta = b.float().sigmoid()
    g = -layer.A_log.float().exp() * F.softplus(a.float() + layer.dt_bias.float())
    state = torch.zeros(v.shape[1], dk, dv)
    out = torch.empty(t, v.shape[1], dv)
    for i in range(t):
        state = state * g[i].exp()[:, None, None]
        delta = (v[i] - torch.einsum("hkv,hk->hv", state, k[i])) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        out[i] = torch.einsum("hkv,hk->hv", state, q[i])
    return out


def gdn_forward(layer, hidden: torch.Tensor) -> torch.Tensor:
    """QwenGatedDeltaNetAttention.forward_cpu with the core op replaced: vLLM's
    in_proj_qkvz / in_proj_ba, split as Qwen3.5 stores them, then its gated norm and
    out_proj (_output_projection)."""
    mixed_qkvz, _ = layer.in_proj_qkvz(hidden)
    ba, _ = layer.in_proj_ba(hidden)
    qkv_size = (layer.key_dim * 2 + layer.value_dim) // layer.tp_size
    mixed_qkv, z = mixed_qkvz.split(
        [qkv_size, layer.value_dim // layer.tp_size], dim=-1
    )
    z = z.reshape(z.shape[0], -1, layer.head_v_dim)
    b, a = ba.chunk(2, dim=-1)
    core = gated_delta_core(layer, mixed_qkv, b, a).to(hidden.dtype)
    return layer._output_projection(core, z)


def patch_tower(monkeypatch) -> None:
    """The vision tower on CPU: its rotary op is enabled by force, and its CUDA path
    imports vLLM's flash-attention build; host memory cannot be pinned without CUDA."""
    import vllm.utils.torch_utils as torch_utils
    from vllm.model_executor.layers.rotary_embedding import common

    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)
    monkeypatch.setattr(
        common.ApplyRotaryEmb, "forward_cuda", common.ApplyRotaryEmb.forward_native
    )


def load(root, monkeypatch, parallel_config=None, **model_config):
    """(model, vllm_config, unloaded, passed_over): vLLM's loader at the TP size of the
    current world. unloaded: parameters load_weights left unwritten (the routed
    experts' are reported under the runner's name; the EXL3 MoE method checks every
    expert tensor arrived); passed_over: checkpoint tensors AutoWeightsLoader
    skipped."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.models.qwen3_5 import (
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeForConditionalGeneration,
    )

    from .moe_model_run import cpu_stand_ins, record_unloaded, restored_default_dtype
    from .test_exl3_spanning_shards import record_passed_over

    cpu_stand_ins(monkeypatch)
    patch_tower(monkeypatch)
    moe = (
        "Moe"
        in json.loads((Path(root) / "config.json").read_text())["architectures"][0]
    )
    cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    unloaded = record_unloaded(monkeypatch, cls)
    passed_over = record_passed_over(monkeypatch)
    model_config = ModelConfig(model=str(root), dtype=MODEL_DTYPE, **model_config)
    assert model_config.quantization == "exl3"
    extra = {} if parallel_config is None else {"parallel_config": parallel_config}
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu"), **extra
    )
    with restored_default_dtype():
        model = get_model_loader(vllm_config.load_config).load_model(
            vllm_config=vllm_config, model_config=model_config
        )
    assert type(model) is cls
    unloaded = {n for n in unloaded if ".routed_experts." not in n}
    return model, vllm_config, unloaded, passed_over


def run_language_model(model, vllm_config, ids: torch.Tensor):
    """(final hidden states, logits fp32) of the language model for one sequence, the
    attention op and the Gated DeltaNet core replaced by the stand-ins."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    from .exl3_harness import CausalSdpa

    lm = model.language_model
    with (
        set_current_vllm_config(vllm_config),
        set_forward_context(None, vllm_config),
        torch.no_grad(),
        torch.compiler.set_stance("force_eager"),
    ):
        for layer in lm.model.layers:
            if layer.layer_type == "linear_attention":
                gdn = layer.linear_attn
                gdn._forward_method = functools.partial(gdn_forward, gdn)
            else:
                attn = layer.self_attn
                attn.attn = CausalSdpa(
                    attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling
                )
        # Text alone: the three mRoPE rows are the token positions.
        positions = torch.arange(len(ids)).expand(3, -1)
        hidden, residual = lm.model.embed_input_ids(ids), None
        for layer in lm.model.layers:
            hidden, residual = layer(hidden, residual, positions=positions)
        hidden, _ = lm.model.norm(hidden, residual)
        return hidden, lm.compute_logits(hidden).float()


def tower_embeddings(model, vllm_config) -> list[torch.Tensor]:
    """The tower's embeddings of images(), one tensor per image, through the model's
    own multimodal entry (sharded by image over the TP group in the data mode)."""
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context

    pixels, grid = images()
    with (
        set_current_vllm_config(vllm_config),
        set_forward_context(None, vllm_config),
        torch.no_grad(),
        torch.compiler.set_stance("force_eager"),
    ):
        return list(model.embed_multimodal(pixel_values=pixels, image_grid_thw=grid))


def _exl3_linears(model, under: str) -> dict:
    from vllm.model_executor.layers.quantization.exl3.linear import Exl3LinearMethod

    return {
        name: layer
        for name, layer in model.named_modules()
        if name.startswith(under)
        and isinstance(getattr(layer, "quant_method", None), Exl3LinearMethod)
    }


def _check_ledger(model, unloaded, passed_over, tower: bool) -> None:
    assert unloaded == set(), sorted(unloaded)
    assert {n for n in passed_over if not n.startswith("mtp.")} == set(), sorted(
        passed_over
    )
    has_tower = any(n.startswith("visual.") for n, _ in model.named_parameters())
    assert has_tower == tower


def _dense_rank_main(rank: int, tmp: str) -> None:
    # Runs in a spawned process: imports vLLM there.
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    from .exl3_harness import gloo_world

    root = Path(tmp) / "ckpt"
    ids = token_ids()
    out = {}
    with gloo_world(WORLD, rank, f"{tmp}/init"):
        # The default encoder mode splits the tower over the TP group: refused by
        # name.
        with (
            pytest.MonkeyPatch.context() as monkeypatch,
            pytest.raises(Exl3LayoutError, match=_refused_at_64(TOWER_PROJ, rank)),
        ):
            load(root, monkeypatch)

        with pytest.MonkeyPatch.context() as monkeypatch:
            model, vllm_config, unloaded, passed_over = load(
                root, monkeypatch, mm_encoder_tp_mode="data"
            )
            _check_ledger(model, unloaded, passed_over, tower=True)
            gdn = model.language_model.model.layers[0].linear_attn
            # q, k, v, z: 128, 128, 256, 256 split in half.
            assert gdn.in_proj_qkvz.output_partition_sizes == [64, 64, 128, 128]
            attn = model.language_model.model.layers[3].self_attn
            # q with its gate: 4 heads of 2 x 64 -> 2 per rank; one 64-wide KV head.
            assert attn.qkv_proj.output_partition_sizes == [256, 64, 64]
            mlp = model.language_model.model.layers[0].mlp
            assert mlp.gate_up_proj.output_partition_sizes == [384, 384]
            tower = _exl3_linears(model, "visual.")
            assert tower and all(
                layer.tp_size == 1
                and layer.output_size_per_partition == layer.output_size
                for layer in tower.values()
            ), sorted(n for n, layer in tower.items() if layer.tp_size != 1)
            out["hidden"], out["logits"] = run_language_model(model, vllm_config, ids)
            out["tower"] = tower_embeddings(model, vllm_config)

        # Without the tower, the encoder mode does not matter: the skipped tower is
        # never planned as EXL3.
        for mode in ("data", None):
            extra = {"mm_encoder_tp_mode": mode} if mode else {}
            with pytest.MonkeyPatch.context() as monkeypatch:
                model, vllm_config, unloaded, passed_over = load(
                    root, monkeypatch, language_model_only=True, **extra
                )
                _check_ledger(model, unloaded, passed_over, tower=False)
                _, logits = run_language_model(model, vllm_config, ids)
                # The same weights on the same rank, the same operations.
                assert torch.equal(logits, out["logits"])
    torch.save(out, f"{tmp}/rank{rank}.pt")


def _fixture(tmp_path: Path, kind: str) -> Path:
    from .test_exl3_spanning_shards import qwen3_5_fixture

    root = tmp_path / "ckpt"
    root.mkdir()
    qwen3_5_fixture(root, kind)
    return root


def _within_ulps(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got.float() - want.float()).abs().max().item()
    bound = ULPS * torch.finfo(torch.float16).eps * want.float().abs().max().item()
    assert err <= bound, f"{what}: TP=2 vs TP=1 max |diff| {err:.3g} > {bound:.3g}"


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return F.cross_entropy(logits[:-1], ids[1:]).item()


def test_qwen3_5_dense_fixture_at_tp2(tmp_path, monkeypatch, world1):
    root = _fixture(tmp_path, "dense")
    # Spawned children re-import this module and its helpers from the parent's sys.path.
    mp.spawn(_dense_rank_main, args=(str(tmp_path),), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    # TP=1: the model as a single GPU serves it (the tower whole in either mode).
    model, vllm_config, unloaded, passed_over = load(root, monkeypatch)
    _check_ledger(model, unloaded, passed_over, tower=True)
    ids = token_ids()
    hidden, logits = run_language_model(model, vllm_config, ids)
    tower = tower_embeddings(model, vllm_config)
    assert logits.shape == (TOKENS, 4224)
    for r, tp2 in enumerate(ranks):
        _within_ulps(tp2["hidden"], hidden, f"rank {r} hidden states")
        _within_ulps(tp2["logits"], logits, f"rank {r} logits")
        nll1, nll2 = _nll(logits, ids), _nll(tp2["logits"], ids)
        assert abs(math.exp(nll2 - nll1) - 1) <= PPL_RTOL, (
            f"perplexity {math.exp(nll1):.4f} at TP=1, {math.exp(nll2):.4f} at TP=2"
        )
        assert len(tp2["tower"]) == len(tower) == len(IMAGE_GRIDS)
        for i, (got, want) in enumerate(zip(tp2["tower"], tower)):
            _within_ulps(got, want, f"rank {r} image {i} embeddings")


def build_experts(root: Path, expect_all_loaded: bool = True):
    """vLLM's FusedMoE for the fixture's first MoE layer (8 experts of 128, top-2,
    renormalised), fp32, loaded from its checkpoint tensors; under expert parallelism a
    rank loads only its experts. Routing by softmax top-k (vLLM's ops are CUDA-only)."""
    from .test_exl3_moe import build_moe

    return build_moe(root, EXPERTS, expect_all_loaded=expect_all_loaded)


def _moe_rank_main(rank: int, tmp: str) -> None:
    # Runs in a spawned process: imports vLLM there.
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError

    from .exl3_harness import gloo_world
    from .moe_checkpoints import decoded_modules
    from .moe_oracle import moe_reference, softmax_topk

    root = Path(tmp) / "ckpt"

    def ep() -> ParallelConfig:
        return ParallelConfig(tensor_parallel_size=WORLD, enable_expert_parallel=True)

    with gloo_world(WORLD, rank, f"{tmp}/init_tp"):
        with (
            pytest.MonkeyPatch.context() as monkeypatch,
            pytest.raises(Exl3LayoutError, match=_refused_at_64(SHARED_DOWN, rank)),
        ):
            load(root, monkeypatch, language_model_only=True, mm_encoder_tp_mode="data")
        with pytest.raises(
            Exl3LayoutError, match=_refused_at_64(EXPERTS.replace(".", r"\."), rank)
        ):
            build_experts(root)

    world = VllmConfig(device_config=DeviceConfig("cpu"), parallel_config=ep())
    with gloo_world(WORLD, rank, f"{tmp}/init_ep", world) as vllm_config:
        # Expert parallelism does not reach the shared expert: still split over TP.
        with (
            pytest.MonkeyPatch.context() as monkeypatch,
            pytest.raises(Exl3LayoutError, match=_refused_at_64(SHARED_DOWN, rank)),
        ):
            load(
                root,
                monkeypatch,
                parallel_config=ep(),
                language_model_only=True,
                mm_encoder_tp_mode="data",
            )

        moe, named, loaded = build_experts(root, expect_all_loaded=False)
        method = moe.routed_experts.quant_method
        local = set(method._local.values())
        stored = [k for k in named if k.startswith(EXPERTS + ".")]
        assert len(local) == 4 and 2 * len(loaded) == len(stored), (
            len(local),
            len(loaded),
        )
        x = torch.randn(16, 256, generator=torch.Generator().manual_seed(5))
        logits = x @ named["model.language_model.layers.0.mlp.gate.weight"].float().t()
        weights, ids = softmax_topk(x, logits, 2, True)
        with set_forward_context(None, vllm_config), torch.no_grad():
            y = moe(x, logits)
        expected = moe_reference(
            x, weights, ids, decoded_modules(root, (EXPERTS,)), EXPERTS
        )
        err = (y.double() - expected).abs().max().item()
        assert err <= EXPERTS_RTOL * expected.abs().max().item(), (
            f"rank {rank} EP: max |err| {err:.3g}"
        )


def test_qwen3_5_moe_fixture_at_tp2_refused_expert_parallel_runs(tmp_path, world1):
    _fixture(tmp_path, "moe")
    # Spawned children re-import this module and its helpers from the parent's sys.path.
    mp.spawn(_moe_rank_main, args=(str(tmp_path),), nprocs=WORLD, join=True)
