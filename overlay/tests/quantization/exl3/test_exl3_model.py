# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The whole fixture checkpoint through vLLM's own model loader on CPU, and tensor
parallel 2.

ModelConfig resolves "exl3" from config.json, DefaultModelLoader builds
Qwen3ForCausalLM with Exl3Config and streams the safetensors through the model's
load_weights, process_weights_after_loading picks the reference kernel. The loaded
model's logits are compared with transformers' Qwen3 running the same weights decoded to
dense by the reference. vLLM's attention kernels do not exist on a GPU-less machine, so
the attention op itself is replaced by causal SDPA (the backend class is only needed to
construct the layers); everything else (embedding, norms, RoPE, every EXL3 linear,
lm_head, logits processor) is vLLM's.

Tensor parallel 2: two spawned processes in one gloo world build vLLM's real layers
with the EXL3 methods, load the full checkpoint tensors through vLLM's loaders (each
rank takes its slice), and check each rank's output, the row-parallel all-reduce and
the gathered logits against the dense product; the fixture's own qkv, whose 64-wide KV
heads put half a Hadamard block on each rank; the whole fixture model at TP=2 against
TP=1; the per-rank 128-block errors; and unquantized linears stored 128-padded (hidden
320 stored 384): each rank's loader trims the padding, then vLLM's own narrowing takes
the rank's slice, checked against the dense product with the padding cut off.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from .exl3_harness import (
    CKPT_3INST,
    CKPT_MCG,
    CPU_ATTENTION_BACKEND,
    FIXTURES,
    CausalSdpa,
    checkpoint_copy,
    dense,
    tensors,
)

TOKENS = 96


def token_ids() -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(FIXTURES / "tokenizer" / "tokenizer.json"))
    text = (FIXTURES / "val.txt").read_text()[:4000]
    return torch.tensor(tok.encode(text).ids[:TOKENS])


def vllm_logits(
    ckpt_dir, ids: torch.Tensor, monkeypatch, dtype: str = "bfloat16"
) -> tuple[torch.Tensor, nn.Module]:
    """Logits of vLLM's model for one sequence, at the TP size of the current vLLM
    world."""
    from vllm.config import (
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        current_platform,
        "get_attn_backend_cls",
        lambda *args, **kwargs: CPU_ATTENTION_BACKEND,
    )
    model_config = ModelConfig(model=str(ckpt_dir), dtype=dtype)
    assert model_config.quantization == "exl3"
    vllm_config = VllmConfig(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    model = get_model_loader(vllm_config.load_config).load_model(
        vllm_config=vllm_config, model_config=model_config
    )
    # On CPU vLLM compiles the native SiluAndMul with inductor (~10 s per process);
    # eager runs the same math.
    with (
        set_current_vllm_config(vllm_config),
        torch.no_grad(),
        torch.compiler.set_stance("force_eager"),
    ):
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.attn = CausalSdpa(
                attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scaling
            )
        positions = torch.arange(len(ids))
        hidden, residual = model.model.embed_input_ids(ids), None
        for layer in model.model.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = model.model.norm(hidden, residual)
        return model.compute_logits(hidden).float(), model


def transformers_logits(ckpt, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' Qwen3 with every EXL3 linear replaced by its reference-decoded
    weight."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("quantization_config")
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval()
    named = tensors(ckpt)
    state = {}
    for name in model.state_dict():
        module = name.rpartition(".")[0]
        if f"{module}.trellis" in named:
            state[name] = dense(named, module).t()
        else:
            state[name] = named[name].float()
    model.load_state_dict(state)
    model.to(dtype)
    with torch.no_grad():
        return model(ids[None]).logits[0].float()


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", [CKPT_3INST, CKPT_MCG], ids=["3inst-4bpw", "mcg-3bpw"])
def test_whole_model_logits_match_transformers(ckpt, tmp_path, monkeypatch, world1):
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.exl3.linear import (
        Exl3LinearMethod,
        Exl3LMHeadMethod,
    )

    ids = token_ids()
    got, model = vllm_logits(
        checkpoint_copy(ckpt, tmp_path / "ckpt", tokenizer=True), ids, monkeypatch
    )
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert len(linears) == 4 * 4  # qkv, o, gate_up, down per layer
    assert all(isinstance(m.quant_method, Exl3LinearMethod) for m in linears)
    assert isinstance(model.lm_head.quant_method, Exl3LMHeadMethod)
    assert got.shape == (TOKENS, 4096)

    exact = transformers_logits(ckpt, ids, torch.float32)
    bf16 = transformers_logits(ckpt, ids, torch.bfloat16)
    err = (got - exact).abs().max().item()
    bf16_err = (bf16 - exact).abs().max().item()
    # vLLM runs in bf16: its distance to the fp32 truth must be that of a bf16 run.
    assert err <= 2 * bf16_err, (
        f"max |logit err| {err:.4f}, transformers bf16 {bf16_err:.4f}"
    )
    agree = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
    bf16_agree = (bf16.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= bf16_agree - 0.03, (
        f"top-1 agreement {agree:.3f} vs bf16 {bf16_agree:.3f}"
    )


# Tensor parallel 2 on CPU: two spawned processes in one gloo world build vLLM's real
# layers with the EXL3 methods, load the full checkpoint tensors through vLLM's loaders
# (each rank takes its slice), and check each rank's output, the row-parallel all-reduce
# and the gathered logits against the dense product; the fixture's own qkv, whose
# 64-wide KV heads put half a Hadamard block on each rank; the whole fixture model at
# TP=2 against TP=1; plus the per-rank 128-block errors.

WORLD = 2
HIDDEN, INTER, CKPT_VOCAB = 256, 768, 4096
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64  # the fixture's attention
ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"
TP2_LOGITS = "tp2_logits.pt"
MODEL_DTYPE = "float16"  # the finer of the two activation dtypes EXL3 accepts
# TP=2 differs from TP=1 only in summation order (all-reduces, GEMM blocking) and the
# fp16 roundings after it: measured 1.5 ulps of the largest logit; a misplaced column
# costs far more.
LOGITS_ULPS = 8
# The GPU acceptance bound for TP=2 vs TP=1 perplexity, checked here on the
# fixture text.
PPL_RTOL = 1e-3


def _whole_model(rank: int, ckpt_dir: str, out_dir: str) -> None:
    """The fixture model through vLLM's loader at this rank's TP; rank 0 saves the
    logits."""
    from vllm.model_executor.layers.quantization.exl3.weights import OUT_INDEX

    with pytest.MonkeyPatch.context() as monkeypatch:
        logits, model = vllm_logits(
            ckpt_dir, token_ids(), monkeypatch, dtype=MODEL_DTYPE
        )
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.output_partition_sizes == [HEADS // WORLD * HEAD_DIM, HEAD_DIM, HEAD_DIM]
    assert hasattr(qkv, OUT_INDEX)  # k/v run with partial-block ownership
    if rank == 0:
        torch.save(logits, f"{out_dir}/{TP2_LOGITS}")


def _rank_main(rank: int, init_file: str, ckpt_dir: str, out_dir: str) -> None:
    # Runs in a spawned process: imports vLLM there.
    from vllm.distributed import tensor_model_parallel_all_gather
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.quantization.exl3.layout import Exl3LayoutError
    from vllm.model_executor.layers.quantization.exl3.weights import OUT_INDEX
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from .exl3_harness import (
        CKPT_MCG,
        assert_matches,
        config_for,
        config_from_tensors,
        dense,
        gloo_world,
        load_module,
        tensors,
    )

    named = tensors(CKPT_MCG)
    f32 = torch.float32
    x = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(11))

    def finish(layer):
        layer.quant_method.process_weights_after_loading(layer)

    with gloo_world(WORLD, rank, init_file):
        config = config_for(CKPT_MCG)

        # QKV, the fixture's heads read as head_dim 128: q = 2 heads (one per rank), k/v
        # = one head replicated on both ranks (num_kv_head_replicas = 2).
        qkv = QKVParallelLinear(
            HIDDEN,
            128,
            2,
            1,
            bias=False,
            quant_config=config,
            prefix=f"{ATTN}.qkv_proj",
            params_dtype=f32,
        )
        assert qkv.num_kv_head_replicas == 2
        for shard, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            load_module(qkv, named, f"{ATTN}.{proj}", shard)
        finish(qkv)
        wq = dense(named, f"{ATTN}.q_proj")[:, 128 * rank : 128 * (rank + 1)]
        w = torch.cat(
            [wq, dense(named, f"{ATTN}.k_proj"), dense(named, f"{ATTN}.v_proj")], 1
        )
        assert_matches(qkv(x)[0], x @ w, f"rank {rank} qkv")

        # gate_up column-parallel (384 per rank), then down row-parallel with the
        # all-reduce.
        gate_up = MergedColumnParallelLinear(
            HIDDEN,
            [INTER, INTER],
            bias=False,
            quant_config=config,
            prefix=f"{MLP}.gate_up_proj",
            params_dtype=f32,
        )
        down = RowParallelLinear(
            INTER,
            HIDDEN,
            bias=False,
            quant_config=config,
            prefix=f"{MLP}.down_proj",
            params_dtype=f32,
        )
        load_module(gate_up, named, f"{MLP}.gate_proj", 0)
        load_module(gate_up, named, f"{MLP}.up_proj", 1)
        load_module(down, named, f"{MLP}.down_proj")
        finish(gate_up)
        finish(down)
        cols = slice(384 * rank, 384 * (rank + 1))
        w_gu = torch.cat(
            [
                dense(named, f"{MLP}.gate_proj")[:, cols],
                dense(named, f"{MLP}.up_proj")[:, cols],
            ],
            1,
        )
        h = gate_up(x)[0]
        assert_matches(h, x @ w_gu, f"rank {rank} gate_up")
        h_full = tensor_model_parallel_all_gather(
            h[:, 384:].contiguous()
        )  # the up halves
        assert_matches(
            down(h[:, 384:])[0],
            h_full @ dense(named, f"{MLP}.down_proj"),
            f"rank {rank} down + all-reduce",
        )

        # lm_head, vocab 4000: vLLM gives each rank 2016 columns (not 128-aligned).
        vocab = 4000
        head = ParallelLMHead(
            vocab, HIDDEN, quant_config=config, prefix="lm_head", params_dtype=f32
        )
        for name, tensor in named.items():
            if name.startswith("lm_head."):
                param = getattr(head, name.rpartition(".")[2])
                param.weight_loader(param, tensor)
        finish(head)
        full = torch.zeros(6, 4032)
        full[:, :vocab] = x @ dense(named, "lm_head")[:, :vocab]
        part = head.quant_method.apply(head, x)
        assert part.shape == (6, 2016)
        assert_matches(
            part, full[:, 2016 * rank : 2016 * (rank + 1)], f"rank {rank} lm_head"
        )
        if rank == 1:
            assert torch.all(part[:, vocab - 2016 :] == 0)
        logits = LogitsProcessor(vocab)(head, x)  # gathered on rank 0
        if rank == 0:
            assert_matches(logits, full[:, :vocab], "gathered logits")

        # The fixture's real heads (head_dim 64, one KV head per rank): each rank
        # computes the whole 128-column k and v blocks and keeps its 64 columns of each.
        qkv = QKVParallelLinear(
            HIDDEN,
            HEAD_DIM,
            HEADS,
            KV_HEADS,
            bias=False,
            quant_config=config,
            prefix=f"{ATTN}.qkv_proj",
            params_dtype=f32,
        )
        assert qkv.output_partition_sizes == [128, 64, 64]
        assert tuple(qkv.trellis.shape) == (HIDDEN // 16, 3 * 128 // 16, 48)
        for shard, proj in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")):
            load_module(qkv, named, f"{ATTN}.{proj}", shard)
        finish(qkv)
        kv_cols = slice(64 * rank, 64 * (rank + 1))
        w = torch.cat(
            [
                dense(named, f"{ATTN}.q_proj")[:, 128 * rank : 128 * (rank + 1)],
                dense(named, f"{ATTN}.k_proj")[:, kv_cols],
                dense(named, f"{ATTN}.v_proj")[:, kv_cols],
            ],
            1,
        )
        y = qkv(x)[0]
        assert y.shape == (6, 256)
        assert_matches(y, x @ w, f"rank {rank} qkv, 64-column k/v")
        # GPU memory: the data plus one int64 per returned column.
        assert getattr(qkv, OUT_INDEX).dtype == torch.int64
        assert getattr(qkv, OUT_INDEX).shape == (256,)
        assert {n for n, _ in qkv.named_parameters()} == {"trellis", "suh", "svh"}

        # A partial column-parallel layer with a bias: vLLM's bias is per rank (kept
        # columns).
        prefix = f"{ATTN}.k_proj"
        biased = {k: v for k, v in named.items() if k.rpartition(".")[0] == prefix}
        biased[f"{prefix}.bias"] = torch.randn(
            128, generator=torch.Generator().manual_seed(5)
        ).to(torch.float16)
        k_proj = ColumnParallelLinear(
            HIDDEN,
            128,
            bias=True,
            quant_config=config_from_tensors(biased),
            prefix=prefix,
            params_dtype=f32,
        )
        load_module(k_proj, biased, prefix)
        k_proj.bias.weight_loader(k_proj.bias, biased[f"{prefix}.bias"])
        finish(k_proj)
        assert_matches(
            k_proj(x)[0],
            x @ dense(named, prefix)[:, kv_cols]
            + biased[f"{prefix}.bias"][kv_cols].float(),
            f"rank {rank} k_proj + bias",
        )
        # A k split off the block: 640 inputs / 2 = 320 per rank.
        try:
            RowParallelLinear(
                640, HIDDEN, bias=False, quant_config=config, prefix=f"{MLP}.down_proj"
            )
        except Exl3LayoutError as e:
            assert (
                f"(rank {rank} of 2): row-parallel input slice of 320 features"
                in str(e)
            ), e
        else:
            raise AssertionError("a 320-row k split was accepted")

        _whole_model(rank, ckpt_dir, out_dir)


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> float:
    """Mean negative log-likelihood of the next token (log perplexity)."""
    return torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).item()


def test_tensor_parallel_2(tmp_path, monkeypatch, world1):
    from .exl3_harness import CKPT_3INST, checkpoint_copy

    ckpt = checkpoint_copy(CKPT_3INST, tmp_path / "ckpt", tokenizer=True)
    # Spawned children re-import this module and exl3_harness from the parent's
    # sys.path.
    mp.spawn(
        _rank_main,
        args=(str(tmp_path / "init"), str(ckpt), str(tmp_path)),
        nprocs=WORLD,
        join=True,
    )
    tp2 = torch.load(tmp_path / TP2_LOGITS)
    ids = token_ids()
    tp1, _ = vllm_logits(
        ckpt, ids, monkeypatch, dtype=MODEL_DTYPE
    )  # this process: TP=1
    assert tp2.shape == tp1.shape == (len(ids), CKPT_VOCAB)
    err = (tp2 - tp1).abs().max().item()
    scale = tp1.abs().max().item()
    bound = LOGITS_ULPS * torch.finfo(getattr(torch, MODEL_DTYPE)).eps * scale
    assert err <= bound, f"TP=2 vs TP=1: max |logit diff| {err:.3g} > {bound:.3g}"
    nll1, nll2 = _nll(tp1, ids), _nll(tp2, ids)
    assert abs(math.exp(nll2 - nll1) - 1) <= PPL_RTOL, (
        f"perplexity {math.exp(nll1):.4f} at TP=1, {math.exp(nll2):.4f} at TP=2"
    )


# Tensor parallel 2 on CPU for unquantized linears stored 128-padded (hidden 320 stored
# 384): each rank's loader trims the padding, then vLLM's own narrowing takes the rank's
# slice — column (gate_up, 160 of each shard per rank) and row (down, 160 input features
# per rank, all-reduced, bias on one rank) — checked against the dense product with the
# padding cut off.


def _padding_rank_main(rank: int, init_file: str) -> None:
    # Runs in a spawned process: imports vLLM there.
    from vllm.model_executor.layers.linear import (
        MergedColumnParallelLinear,
        RowParallelLinear,
    )

    from .exl3_harness import assert_matches, config_from_tensors, gloo_world
    from .test_exl3_linear import (
        MLP,
        REAL,
        _dense_plain,
        _finish,
        _load,
        _x,
        checkpoint,
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
    mp.spawn(
        _padding_rank_main, args=(str(tmp_path / "init"),), nprocs=WORLD, join=True
    )
