# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The EXL3_MLA_SPARSE attention backend through vLLM 0.26's own classes.

Selection runs `CudaPlatform.get_attn_backend_cls` (and the selector above it) with the
device capability and FlashInfer's SM120 availability monkeypatched, as vLLM's selector
tests do. On this machine `vllm._C_stable_libtorch` cannot load (no libcuda), so the
CUDA platform module is imported with that extension stubbed: selection is pure Python.

`forward_mqa` runs on a paged cache laid out by vLLM's metadata builder. On CPU the
three CUDA-only calls are replaced: `concat_mla_q` by a copy, the Triton index
conversion by its documented formula, the op by the contract's fp32 semantics (gather,
dequantize, softmax, weighted sum). The expected output is computed independently from
each request's logical rows and its logical top-k positions, so a wrong request id,
block table, block size, slot or cache layout shows up (unselected and unused slots hold
NaN). The same test on CUDA (`-m gpu`) runs the real kernels. With
VLLM_EXL3_FORCE_REFERENCE=1 it runs the wrapper's chunked fp32 reference instead (on
CPU and, captured in a CUDA graph, on CUDA), with chunks small enough to cross every
kind of row.
"""

from __future__ import annotations

import importlib
import math
import re
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

BACKEND = "EXL3_MLA_SPARSE"
EXL3 = "vllm.v1.attention.backends.mla.exl3_mla_sparse.Exl3MLASparseBackend"
OPS_MODULE = "vllm.v1.attention.ops.exl3_sparse_mla"
LATENT, ROPE = 512, 64
HEAD = LATENT + ROPE
FP8_ROW = 656
FP8_E4M3_MAX = 448.0


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def cuda_platform(monkeypatch):
    """vLLM's CudaPlatform class with capability / FlashInfer / op availability set by
    the returned function."""
    if "vllm.platforms.cuda" not in sys.modules:
        try:
            importlib.import_module("vllm._C_stable_libtorch")
        except ImportError:
            monkeypatch.setitem(
                sys.modules,
                "vllm._C_stable_libtorch",
                types.ModuleType("vllm._C_stable_libtorch"),
            )
    cuda = importlib.import_module("vllm.platforms.cuda")
    import vllm.utils.flashinfer as fi
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla import exl3_mla_sparse
    from vllm.v1.attention.selector import _cached_get_attn_backend

    def configure(capability, flashinfer_sm120=False, op_missing=None):
        _cached_get_attn_backend.cache_clear()
        monkeypatch.setattr(
            cuda.CudaPlatform,
            "get_device_capability",
            classmethod(lambda cls, device_id=0: DeviceCapability(*capability)),
        )
        monkeypatch.setattr(
            fi, "has_flashinfer_sparse_mla_sm120", lambda: flashinfer_sm120
        )
        monkeypatch.setattr(
            exl3_mla_sparse, "sparse_mla_op_unavailable", lambda: op_missing
        )
        return cuda.CudaPlatform

    yield configure
    _cached_get_attn_backend.cache_clear()


@pytest.fixture
def cpu_vllm_config():
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(config):
        yield config


def select(platform, kv_cache_dtype, selected=None, head_size=HEAD, **kw):
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(
        head_size=head_size,
        dtype=kw.pop("dtype", torch.bfloat16),
        kv_cache_dtype=kv_cache_dtype,
        block_size=kw.pop("block_size", None),
        use_mla=True,
        use_sparse=True,
    )
    return platform.get_attn_backend_cls(selected, config, num_heads=16)


# ------------------------------------------------------------------------- selection


@pytest.mark.parametrize("capability", [(12, 0), (12, 1)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8", "fp8_ds_mla"])
def test_sm12x_auto_without_flashinfer(
    cuda_platform, cpu_vllm_config, capability, kv_cache_dtype
):
    platform = cuda_platform(capability, flashinfer_sm120=False)
    assert select(platform, kv_cache_dtype) == EXL3


@pytest.mark.parametrize("capability", [(12, 0), (12, 1)])
@pytest.mark.parametrize(
    ("kv_cache_dtype", "expected"),
    [
        ("auto", "FlashInferMLASparseSM120Backend"),
        ("fp8", "FlashInferMLASparseSM120Backend"),
        ("fp8_e4m3", "FlashInferMLASparseSM120Backend"),
        ("fp8_ds_mla", "FlashInferMLASparseSM120Backend"),
        # FlashInfer's SM120 kernel takes no bf16 cache: ours is next.
        ("bfloat16", "Exl3MLASparseBackend"),
    ],
)
def test_sm12x_auto_with_flashinfer(
    cuda_platform, cpu_vllm_config, capability, kv_cache_dtype, expected
):
    platform = cuda_platform(capability, flashinfer_sm120=True)
    assert select(platform, kv_cache_dtype).rsplit(".", 1)[1] == expected


def test_sm12x_without_the_op_is_not_picked(cuda_platform, cpu_vllm_config):
    why = "EXL3_MLA_SPARSE needs torch.ops._C.exl3_sparse_mla_decode (test)"
    platform = cuda_platform((12, 0), flashinfer_sm120=False, op_missing=why)
    with pytest.raises(
        ValueError, match=r"EXL3_MLA_SPARSE: \[.*exl3_sparse_mla_decode"
    ):
        select(platform, "auto")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "fp8", "fp8_ds_mla"])
def test_hopper_auto_keeps_flashmla_sparse(
    cuda_platform, cpu_vllm_config, kv_cache_dtype
):
    platform = cuda_platform((9, 0))
    assert select(platform, kv_cache_dtype).endswith("FlashMLASparseBackend")


@pytest.mark.parametrize("capability", [(9, 0), (12, 0), (12, 1)])
@pytest.mark.parametrize(
    "kv_cache_dtype", ["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla"]
)
@pytest.mark.parametrize("block_size", [None, 64, 256])
def test_explicit_selection(
    cuda_platform, cpu_vllm_config, capability, kv_cache_dtype, block_size
):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    platform = cuda_platform(capability, flashinfer_sm120=True)
    chosen = select(
        platform,
        kv_cache_dtype,
        AttentionBackendEnum.EXL3_MLA_SPARSE,
        block_size=block_size,
    )
    assert chosen == EXL3


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"kv_cache_dtype": "fp8_e5m2"},
            "kv_cache_dtype 'fp8_e5m2' is not supported; use one of auto, "
            "bfloat16 (bf16 cache) or fp8, fp8_e4m3, fp8_ds_mla",
        ),
        ({"kv_cache_dtype": "nvfp4"}, "kv_cache_dtype 'nvfp4' is not supported"),
        (
            {"dtype": torch.float16},
            "model dtype torch.float16 is not supported; the op reads bf16 queries",
        ),
        ({"head_size": 512}, "head size 512 is not supported"),
        (
            {"capability": (10, 0)},
            "compute capability 10.0 is not supported; the op is built for "
            "sm_90, sm_120, sm_121",
        ),
        ({"capability": (8, 9)}, "compute capability 8.9 is not supported"),
        ({"block_size": 32}, "block_size not supported"),
    ],
)
def test_explicit_selection_rejects(cuda_platform, cpu_vllm_config, change, message):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    platform = cuda_platform(change.pop("capability", (12, 0)))
    kv = change.pop("kv_cache_dtype", "auto")
    with pytest.raises(ValueError) as err:
        select(platform, kv, AttentionBackendEnum.EXL3_MLA_SPARSE, **change)
    assert "Selected backend AttentionBackendEnum.EXL3_MLA_SPARSE is not valid" in str(
        err.value
    )
    assert message in str(err.value)


def every_rejected_cache_dtype():
    from typing import get_args

    from vllm.config.cache import CacheDType

    accepted = {"auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_ds_mla"}
    return [d for d in get_args(CacheDType) if d not in accepted]


@pytest.mark.parametrize("kv_cache_dtype", every_rejected_cache_dtype())
def test_every_other_cache_dtype_is_rejected_by_name(
    cuda_platform, cpu_vllm_config, kv_cache_dtype
):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    platform = cuda_platform((12, 0))
    with pytest.raises(ValueError) as err:
        select(platform, kv_cache_dtype, AttentionBackendEnum.EXL3_MLA_SPARSE)
    assert f"kv_cache_dtype {kv_cache_dtype!r} is not supported; use one of" in str(
        err.value
    )


def test_attention_config_selects_it(cuda_platform, monkeypatch):
    """--attention-backend EXL3_MLA_SPARSE is parsed into AttentionConfig and honoured
    by the selector the MLA layer calls."""
    from vllm.config import (
        AttentionConfig,
        DeviceConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.v1.attention.backends.mla.exl3_mla_sparse import Exl3MLASparseBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import get_attn_backend

    platform = cuda_platform((9, 0))
    attention = AttentionConfig(backend=BACKEND)
    assert attention.backend is AttentionBackendEnum.EXL3_MLA_SPARSE
    config = VllmConfig(attention_config=attention, device_config=DeviceConfig("cpu"))
    monkeypatch.setattr("vllm.platforms.current_platform", platform(), raising=False)
    with set_current_vllm_config(config):
        backend = get_attn_backend(
            HEAD, torch.bfloat16, "fp8", use_mla=True, use_sparse=True
        )
    assert backend is Exl3MLASparseBackend


# --------------------------------------------------------- cache dtypes and shapes


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("auto", "auto"),
        ("bfloat16", "bfloat16"),
        ("fp8", "fp8_ds_mla"),
        ("fp8_e4m3", "fp8_ds_mla"),
        ("fp8_ds_mla", "fp8_ds_mla"),
    ],
)
def test_layer_canonicalizes_cache_dtype(given, stored):
    """MLAAttention's canonicalization (the patched hook) stores what the backend
    says; FlashMLA-sparse keeps its own rule."""
    from vllm.model_executor.layers.attention.mla_attention import (
        _canonicalize_sparse_mla_kv_cache_dtype as canonicalize,
    )
    from vllm.v1.attention.backends.mla.exl3_mla_sparse import Exl3MLASparseBackend
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend

    assert canonicalize(Exl3MLASparseBackend, given) == stored
    flashmla = "fp8_ds_mla" if given.startswith("fp8") else given
    assert canonicalize(FlashMLASparseBackend, given) == flashmla


def test_layer_canonicalization_rejects_other_dtypes():
    from vllm.model_executor.layers.attention.mla_attention import (
        _canonicalize_sparse_mla_kv_cache_dtype as canonicalize,
    )
    from vllm.v1.attention.backends.mla.exl3_mla_sparse import Exl3MLASparseBackend

    with pytest.raises(ValueError, match="'fp8_e5m2' is not supported"):
        canonicalize(Exl3MLASparseBackend, "fp8_e5m2")


@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize(
    ("cache_dtype", "row", "dtype"),
    [
        ("auto", HEAD, torch.bfloat16),
        ("bfloat16", HEAD, torch.bfloat16),
        ("fp8_ds_mla", FP8_ROW, torch.uint8),
    ],
)
def test_kv_cache_shape_matches_the_page(block_size, cache_dtype, row, dtype):
    """The shape the backend asks for fills exactly the page vLLM's MLA spec
    allocates (a mismatch would misplace every block)."""
    from vllm.v1.attention.backends.mla.exl3_mla_sparse import Exl3MLASparseBackend
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    shape = Exl3MLASparseBackend.get_kv_cache_shape(7, block_size, 1, HEAD, cache_dtype)
    assert shape == (7, block_size, row)
    spec = MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=HEAD,
        dtype=dtype,
        cache_dtype_str=cache_dtype,
    )
    assert spec.page_size_bytes == block_size * row * dtype.itemsize


def test_declared_support():
    import importlib

    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.mla.exl3_mla_sparse import Exl3MLASparseBackend
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    # The index conversion forward_mqa calls must exist in this vLLM.
    sparse_utils = importlib.import_module(
        "vllm.v1.attention.backends.mla.sparse_utils"
    )
    assert callable(sparse_utils.triton_convert_req_index_to_global_index)
    b = Exl3MLASparseBackend
    assert AttentionBackendEnum.EXL3_MLA_SPARSE.get_class() is b
    assert b.get_name() == BACKEND and b.is_mla() and b.is_sparse()
    assert b.get_supported_head_sizes() == [HEAD]
    assert b.get_supported_kernel_block_sizes() == [64, 256]
    assert b.supported_dtypes == [torch.bfloat16]
    assert set(b.supported_kv_cache_dtypes) == {
        "auto",
        "bfloat16",
        "fp8",
        "fp8_e4m3",
        "fp8_ds_mla",
    }
    for cap in [(9, 0), (12, 0), (12, 1)]:
        assert b.supports_compute_capability(DeviceCapability(*cap))
    # The kinds the kernels are built for, and the class's literal lists, agree.
    from vllm.v1.attention.backends.mla import exl3_mla_sparse as module

    assert tuple(b.get_supported_kernel_block_sizes()) == module.KERNEL_BLOCK_SIZES
    assert b.get_supported_head_sizes() == [module.HEAD_SIZE]
    assert tuple(b.supported_kv_cache_dtypes) == (
        module.BF16_CACHE_DTYPES + module.FP8_DS_MLA_CACHE_DTYPES
    )
    for cap in [(8, 0), (8, 9), (10, 0), (10, 3), (11, 0)]:
        assert not b.supports_compute_capability(DeviceCapability(*cap))
    from vllm.v1.attention.backend import AttentionCGSupport

    assert b.get_builder_cls()._cudagraph_support is AttentionCGSupport.UNIFORM_BATCH


# ------------------------------------------------------------------ forward_mqa


def convert_indices_reference(
    req_id, block_table, token_indices, BLOCK_SIZE=64, NUM_TOPK_TOKENS=2048, **extra
):
    """vLLM's documented formula for `triton_convert_req_index_to_global_index`:
    block_table[req, i // BLOCK_SIZE] * BLOCK_SIZE + i % BLOCK_SIZE; -1 (or a block
    past the table) gives -1."""
    assert not extra, f"unexpected arguments {extra}"
    assert token_indices.shape == (req_id.shape[0], NUM_TOPK_TOKENS)
    tok = token_indices.long()
    blk = torch.div(tok, BLOCK_SIZE, rounding_mode="floor")
    valid = (tok >= 0) & (blk < block_table.shape[1])
    base = block_table.long()[
        req_id.long()[:, None], blk.clamp(0, block_table.shape[1] - 1)
    ]
    return torch.where(valid, base * BLOCK_SIZE + tok % BLOCK_SIZE, -1).to(torch.int32)


def unpack_rows(rows: torch.Tensor, kv_format: int) -> torch.Tensor:
    """Cache rows -> fp32 [..., 576] (latent dequantized, rope)."""
    if kv_format == 0:
        return rows.float()
    lead = rows.shape[:-1]
    rows = rows.contiguous()
    latent = rows[..., :LATENT].view(torch.float8_e4m3fn).float()
    scales = rows[..., LATENT : LATENT + 16].view(torch.float32)
    rope = rows[..., LATENT + 16 :].view(torch.bfloat16).float()
    latent = latent.view(*lead, 4, LATENT // 4) * scales.unsqueeze(-1)
    return torch.cat([latent.reshape(*lead, LATENT), rope], dim=-1)


def sparse_mla_reference(q, kv_cache, indices, scale, kv_format):
    """The op's contract in fp32: (out [T, H, 512], lse [T, H]); an all -1 row gives
    zeros and -inf."""
    rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    valid = indices >= 0
    kv = unpack_rows(rows[indices.long().clamp(min=0)], kv_format)  # [T, K, 576]
    kv = torch.where(valid[..., None], kv, 0.0)
    scores = torch.einsum("thd,tkd->thk", q.float(), kv) * scale
    scores = scores.masked_fill(~valid[:, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None].clamp(min=-1e30)).nan_to_num(0.0)
    out = torch.einsum("thk,tkd->thd", probs, kv[..., :LATENT])
    return out, lse


class RecordingOp:
    """Stands in for `sparse_mla_decode` on CPU: checks the contract's argument rules,
    records the call, writes the fp32 reference into out / lse."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, kv_cache, indices, scale, kv_format, out, lse, workspace):
        t, h, d = q.shape
        assert q.dtype == torch.bfloat16 and d == HEAD and q.stride(-1) == 1
        assert indices.dtype == torch.int32 and indices.shape[0] == t
        assert out.dtype == torch.bfloat16 and out.shape == (t, h, LATENT)
        assert lse.dtype == torch.float32 and lse.shape == (t, h)
        assert workspace.dtype == torch.uint8 and workspace.dim() == 1
        if kv_format == 1:
            assert kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == FP8_ROW
        else:
            assert kv_cache.dtype == torch.bfloat16 and kv_cache.shape[-1] == HEAD
        self.calls.append(
            SimpleNamespace(
                tokens=t,
                heads=h,
                topk=indices.shape[1],
                scale=scale,
                kv_format=kv_format,
                workspace_bytes=workspace.numel(),
                indices=indices.clone(),
            )
        )
        ref_out, ref_lse = sparse_mla_reference(q, kv_cache, indices, scale, kv_format)
        out.copy_(ref_out)
        lse.copy_(ref_lse)
        return out, lse


def quantize_fp8_ds_mla(latent: torch.Tensor, rope: torch.Tensor):
    """(656-byte rows, dequantized latent) for fp32 latent [n, 512], rope [n, 64]."""
    groups = latent.view(-1, 4, LATENT // 4)
    scales = groups.abs().amax(-1).clamp(min=1e-8) / FP8_E4M3_MAX
    fp8 = (groups / scales[..., None]).to(torch.float8_e4m3fn)
    dequant = (fp8.float() * scales[..., None]).view(-1, LATENT)
    rows = torch.cat(
        [
            fp8.view(-1, LATENT).view(torch.uint8),
            scales.contiguous().view(torch.uint8),
            rope.to(torch.bfloat16).view(torch.uint8),
        ],
        dim=-1,
    )
    assert rows.shape[-1] == FP8_ROW
    return rows, dequant


def write_model_config(path, topk):
    import json

    config = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "vocab_size": 1024,
        "q_lora_rank": 64,
        "kv_lora_rank": LATENT,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": 32,
        "index_topk": topk,
        "index_head_dim": 64,
        "index_n_heads": 4,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
    }
    (path / "config.json").write_text(json.dumps(config))


def make_impl(kv_cache_dtype, topk_buffer, **overrides):
    """The backend's Impl with the arguments MLAAttention passes for a V3.2 layer."""
    from vllm.v1.attention.backends.mla.exl3_mla_sparse import Exl3MLASparseBackend

    args = dict(
        num_heads=NUM_HEADS,
        head_size=HEAD,
        scale=1.0 / math.sqrt(192),
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype=kv_cache_dtype,
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
        q_lora_rank=64,
        kv_lora_rank=LATENT,
        qk_nope_head_dim=32,
        qk_rope_head_dim=ROPE,
        qk_head_dim=32 + ROPE,
        v_head_dim=32,
        kv_b_proj=None,
        topk_indices_buffer=topk_buffer,
    )
    args.update(overrides)
    return Exl3MLASparseBackend.get_impl_cls()(**args)


# The workspace rule is the wrapper's host function of the SM count: an H200's here.
STAND_IN_SM_COUNT = 132


@pytest.fixture
def ops_stand_in(monkeypatch):
    """The op's wrapper module with `sparse_mla_decode` replaced by the recording
    reference and its workspace rule evaluated for a fixed SM count (no device here).
    Where the tree has no wrapper module yet, a stand-in with the contract's names."""
    try:
        module = importlib.import_module(OPS_MODULE)
    except ImportError:
        module = None
    if module is not None:
        rule, max_rule = module.workspace_bytes, module.max_workspace_bytes

        def workspace_bytes(tokens, heads, topk, device=None):
            return rule(tokens, heads, topk, sm_count=STAND_IN_SM_COUNT)

        def max_workspace_bytes(max_tokens, heads, topk, device=None):
            return max_rule(max_tokens, heads, topk, sm_count=STAND_IN_SM_COUNT)
    else:
        module = types.ModuleType(OPS_MODULE)
        monkeypatch.setitem(sys.modules, OPS_MODULE, module)

        def workspace_bytes(tokens, heads, topk, device=None):
            return 256

        def max_workspace_bytes(max_tokens, heads, topk, device=None):
            return 256

        module.load_sparse_mla_op = lambda: (True, None)
    monkeypatch.setattr(module, "workspace_bytes", workspace_bytes, raising=False)
    monkeypatch.setattr(
        module, "max_workspace_bytes", max_workspace_bytes, raising=False
    )
    recorder = RecordingOp()
    monkeypatch.setattr(module, "sparse_mla_decode", recorder, raising=False)
    return recorder


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_heads": 129}, "129 query heads per rank; the op takes 1..128"),
        ({"kv_lora_rank": 448}, "kv_lora_rank 448 + rope 64 (head 576)"),
        ({"head_size": 512}, "(head 512) is not supported; the op needs 512 + 64"),
        ({"topk": 100}, "index_topk 100 is not a multiple of 128"),
        ({"topk_indices_buffer": None}, "needs the indexer's top-k buffer"),
        ({"kv_cache_dtype": "fp8"}, "'fp8' reached the layer un-canonicalized"),
        ({"kv_cache_dtype": "fp8_e5m2"}, "'fp8_e5m2' is not supported"),
        ({"sliding_window": 128}, "does not support alibi_slopes, sliding_window"),
        ({"attn_type": "encoder"}, "supports decoder self-attention only"),
    ],
)
def test_impl_rejects(monkeypatch, ops_stand_in, change, message):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.worker import workspace

    topk = change.pop("topk", 128)
    buffer = change.pop("topk_indices_buffer", torch.full((64, topk), -1).int())
    kv_cache_dtype = change.pop("kv_cache_dtype", "auto")
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        config = VllmConfig(device_config=DeviceConfig("cpu"))
        rejected = pytest.raises(
            (ValueError, NotImplementedError), match=re.escape(message)
        )
        with set_current_vllm_config(config), rejected:
            make_impl(kv_cache_dtype, buffer, **change)
    finally:
        workspace.reset_workspace_manager()


def test_workspace_reserved_for_every_step_size(monkeypatch, ops_stand_in):
    """The op's workspace may peak at a middle token count (its split count falls as
    tokens grow): the Impl reserves the largest, so no step grows the locked
    workspace."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.worker import workspace

    config = VllmConfig(device_config=DeviceConfig("cpu"))
    max_tokens = config.scheduler_config.max_num_batched_tokens = 64
    # Larger than the q buffer of the largest step: only reserving the peak fits it.
    peak_bytes = 2 * max_tokens * NUM_HEADS * HEAD * 2
    peak_tokens = 3

    def workspace_bytes(tokens, heads, topk, device=None):
        return peak_bytes if tokens == peak_tokens else 256

    def max_workspace_bytes(max_tokens, heads, topk, device=None):
        return max(workspace_bytes(t, heads, topk) for t in range(1, max_tokens + 1))

    ops_module = sys.modules[OPS_MODULE]
    monkeypatch.setattr(ops_module, "workspace_bytes", workspace_bytes)
    monkeypatch.setattr(ops_module, "max_workspace_bytes", max_workspace_bytes)
    workspace.init_workspace_manager(torch.device("cpu"))
    try:
        with set_current_vllm_config(config):
            impl = make_impl("auto", torch.full((64, 128), -1).int())
        workspace.lock_workspace()
        for tokens in (1, peak_tokens, max_tokens // 2, max_tokens):
            q_buffer, op_workspace = impl._workspace(tokens)
            assert q_buffer.shape == (tokens, NUM_HEADS, HEAD)
            assert op_workspace.numel() == (
                peak_bytes if tokens == peak_tokens else 256
            )
    finally:
        workspace.reset_workspace_manager()


# (query_len, seq_len) per request, decodes first as vLLM's batch reorder leaves them:
# two decodes, a short extend (a decode by the builder's threshold), and a prefill
# chunk longer than the threshold whose context exceeds the top-k (the MQA path).
REQUESTS = [(1, 300), (1, 77), (6, 190), (150, 420)]
TOPK = 128
NUM_HEADS = 16
# The forced reference's chunk in these tests: 158 tokens give 22 full chunks and a
# partial one.
REFERENCE_CHUNK_TOKENS = 7
# bf16's relative spacing (8 significant bits): one rounding of the same fp32 value.
BF16_ULP = 2.0**-7


@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_ds_mla"])
@pytest.mark.parametrize(
    "mode",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.gpu),
        # Captured after the eager call (which compiles the Triton kernel), with the
        # workspace locked as vLLM locks it: replay writes what eager did.
        pytest.param("cuda_graph", marks=pytest.mark.gpu),
        "cpu_reference",
        pytest.param("cuda_graph_reference", marks=pytest.mark.gpu),
    ],
)
def test_forward_mqa(tmp_path, monkeypatch, request, mode, cache_dtype, block_size):
    device = "cpu" if mode.startswith("cpu") else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reference = mode.endswith("_reference")
    if reference:
        ops_module = importlib.import_module(OPS_MODULE)
        monkeypatch.setenv("VLLM_EXL3_FORCE_REFERENCE", "1")
        # Chunks of REFERENCE_CHUNK_TOKENS: the last one partial, the empty token's
        # inside one.
        chunk_bytes = REFERENCE_CHUNK_TOKENS * TOPK * HEAD * 4
        monkeypatch.setattr(ops_module, "REFERENCE_CHUNK_BYTES", chunk_bytes)
    else:
        monkeypatch.setenv("VLLM_EXL3_FORCE_REFERENCE", "0")
    import vllm.envs as envs

    envs.disable_envs_cache()  # an engine built earlier in this process froze them
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mla import exl3_mla_sparse
    from vllm.v1.attention.backends.mla.exl3_mla_sparse import (
        Exl3MLASparseBackend,
        Exl3MLASparseMetadataBuilder,
    )
    from vllm.v1.kv_cache_interface import MLAAttentionSpec
    from vllm.v1.worker import workspace

    write_model_config(tmp_path, TOPK)
    dev = torch.device(device)
    model_config = ModelConfig(
        model=str(tmp_path),
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=1024,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device),
        cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype),
    )
    # The builder clones the layer's dense-MHA prefill backend; None is what a layer
    # without one has (all tokens then take the MQA path).
    vllm_config.compilation_config.static_forward_context["layer.attn"] = (
        SimpleNamespace(prefill_backend=None)
    )

    recorder = None
    if device == "cpu":
        from vllm import _custom_ops
        from vllm.utils import torch_utils

        # Pinned host memory needs a CUDA driver.
        monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)

        monkeypatch.setattr(
            _custom_ops,
            "concat_mla_q",
            lambda ql_nope, q_pe, q_out: q_out.copy_(torch.cat([ql_nope, q_pe], -1)),
        )
        monkeypatch.setattr(
            exl3_mla_sparse,
            "triton_convert_req_index_to_global_index",
            convert_indices_reference,
        )
        recorder = request.getfixturevalue("ops_stand_in")

    gen = torch.Generator().manual_seed(1234)
    num_reqs = len(REQUESTS)
    query_lens = [q for q, _ in REQUESTS]
    seq_lens = [s for _, s in REQUESTS]
    num_tokens = sum(query_lens)
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + 3  # spare blocks stay poisoned
    physical = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    cursor = 0
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = physical[cursor : cursor + n].to(torch.int32)
        cursor += n

    # Logical rows per request; the expected output reads these, never the cache.
    fp8 = cache_dtype == "fp8_ds_mla"
    row = FP8_ROW if fp8 else HEAD
    if fp8:
        cache = torch.full((num_blocks, block_size, row), 0xFF, dtype=torch.uint8)
    else:
        cache = torch.full((num_blocks, block_size, row), math.nan).to(torch.bfloat16)
    logical = []
    for r, s in enumerate(seq_lens):
        latent = torch.randn(s, LATENT, generator=gen)
        rope = torch.randn(s, ROPE, generator=gen)
        if fp8:
            rows, latent_q = quantize_fp8_ds_mla(latent, rope)
            rope_q = rope.to(torch.bfloat16).float()
        else:
            rows = torch.cat([latent, rope], -1).to(torch.bfloat16)
            latent_q, rope_q = rows[:, :LATENT].float(), rows[:, LATENT:].float()
        logical.append(torch.cat([latent_q, rope_q], -1))
        for pos in range(s):
            blk = block_table[r, pos // block_size]
            cache[blk, pos % block_size] = rows[pos]

    # The indexer's output: per token, up to TOPK request-relative positions among
    # those it may see (causal), -1 padded and shuffled in; one token sees nothing.
    topk_buffer = torch.full(
        (vllm_config.scheduler_config.max_num_batched_tokens, TOPK),
        -1,
        dtype=torch.int32,
    )
    req_of_token, pos_of_token = [], []
    t = 0
    for r, (ql, s) in enumerate(REQUESTS):
        for i in range(ql):
            pos = s - ql + i
            visible = pos + 1
            k = min(TOPK - 5, visible)
            chosen = torch.randperm(visible, generator=gen)[:k]
            slots = torch.cat([chosen, torch.full((TOPK - k,), -1)])
            topk_buffer[t] = slots[torch.randperm(TOPK, generator=gen)].to(torch.int32)
            req_of_token.append(r)
            pos_of_token.append(pos)
            t += 1
    empty_token = num_tokens - 7
    topk_buffer[empty_token] = -1

    scale = 1.0 / math.sqrt(192)
    ql_nope = torch.randn(NUM_HEADS, num_tokens, LATENT, generator=gen).to(
        torch.bfloat16
    )
    q_pe = torch.randn(num_tokens, NUM_HEADS, ROPE, generator=gen).to(torch.bfloat16)

    # Expected, from logical rows and logical positions.
    q_full = torch.cat([ql_nope.transpose(0, 1).float(), q_pe.float()], -1)
    expected = torch.zeros(num_tokens, NUM_HEADS, LATENT)
    expected_lse = torch.full((num_tokens, NUM_HEADS), -math.inf)
    for t in range(num_tokens):
        sel = topk_buffer[t][topk_buffer[t] >= 0].long()
        if sel.numel() == 0:
            continue
        kv = logical[req_of_token[t]][sel]
        scores = q_full[t] @ kv.T * scale
        expected_lse[t] = torch.logsumexp(scores, -1)
        expected[t] = torch.softmax(scores, -1) @ kv[:, :LATENT]

    query_start = torch.tensor(
        np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32
    )
    slot_mapping = torch.tensor(
        [
            int(block_table[r, p // block_size]) * block_size + p % block_size
            for r, p in zip(req_of_token, pos_of_token)
        ],
        dtype=torch.int64,
    )
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start.to(dev),
        query_start_loc_cpu=query_start,
        seq_lens=seq_lens_t.to(dev),
        num_reqs=num_reqs,
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=block_table.to(dev),
        slot_mapping=slot_mapping.to(dev),
        seq_lens_cpu_upper_bound=seq_lens_t,
    )

    spec = MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=HEAD,
        dtype=torch.uint8 if fp8 else torch.bfloat16,
        cache_dtype_str=cache_dtype,
    )
    assert tuple(cache.shape) == Exl3MLASparseBackend.get_kv_cache_shape(
        num_blocks, block_size, 1, HEAD, cache_dtype
    )
    workspace.init_workspace_manager(dev)
    try:
        with set_current_vllm_config(vllm_config):
            builder = Exl3MLASparseMetadataBuilder(
                spec, ["layer.attn"], vllm_config, dev
            )
            metadata = builder.build(0, common)
            impl = make_impl(cache_dtype, topk_buffer.to(dev), scale=scale)
            q_in = (ql_nope.to(dev).transpose(0, 1), q_pe.to(dev))
            cache = cache.to(dev)
            assert impl.use_reference == reference
            out, lse = impl.forward_mqa(q_in, cache, metadata, None)
            if mode.startswith("cuda_graph"):
                workspace.lock_workspace()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    graph_out, graph_lse = impl.forward_mqa(q_in, cache, metadata, None)
                graph_out.fill_(math.nan)
                graph_lse.fill_(math.nan)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(graph_out, out) and torch.equal(graph_lse, lse)
    finally:
        workspace.reset_workspace_manager()

    # The builder's split: the three short requests are decodes, the long chunk not.
    assert (metadata.num_decodes, metadata.num_prefills) == (3, 1)
    assert metadata.num_decode_tokens == 8
    assert metadata.block_size == block_size and metadata.topk_tokens == TOPK
    assert out.shape == (num_tokens, NUM_HEADS, LATENT) and out.dtype == torch.bfloat16
    out, lse = out.float().cpu(), lse.float().cpu()
    assert not out.isnan().any()
    assert (out[empty_token] == 0).all() and (lse[empty_token] == -math.inf).all()
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    finite = expected_lse.isfinite()
    # The kernel multiplies fp8 rows as bf16: scores move by a few 1e-3.
    torch.testing.assert_close(lse[finite], expected_lse[finite], atol=1e-2, rtol=1e-3)
    if reference:
        # What the wrapper's reference gives on the whole batch at once, to a bf16
        # rounding of out.
        ops_module = importlib.import_module(OPS_MODULE)
        slots = convert_indices_reference(
            metadata.req_id_per_token[:num_tokens].cpu(),
            block_table,
            topk_buffer[:num_tokens],
            BLOCK_SIZE=block_size,
            NUM_TOPK_TOKENS=TOPK,
        )
        ref_out, ref_lse = ops_module.sparse_mla_reference(
            torch.cat([ql_nope.transpose(0, 1), q_pe], -1),
            cache.cpu(),
            slots,
            scale,
            1 if fp8 else 0,
        )
        torch.testing.assert_close(
            out, ref_out.to(torch.bfloat16).float(), rtol=BF16_ULP, atol=1e-6
        )
        torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    if recorder is not None:
        if reference:
            assert recorder.calls == [], "the op ran although the reference was forced"
            return
        (call,) = recorder.calls
        assert (call.tokens, call.heads, call.topk) == (num_tokens, NUM_HEADS, TOPK)
        assert call.kv_format == (1 if fp8 else 0) and call.scale == scale
