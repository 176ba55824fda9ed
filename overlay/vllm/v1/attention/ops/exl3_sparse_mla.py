# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Sparse MLA decode (`torch.ops._C.exl3_sparse_mla_decode`): the wrapper, its input
checks, the workspace rule, the fake implementation and an fp32 reference.

Every MQA token of a DeepSeek-sparse-attention model (decode and prefill alike) attends
to the top-k KV rows its indexer selected, all heads sharing the rows::

    out[t, h] = softmax(scale * q[t, h] . K[sel_t]^T) . V[sel_t]     (V = K[:, :512])
    lse[t, h] = log(sum(exp(scale * q[t, h] . K[sel_t]^T)))           (natural log)

Schema (stable ABI,
csrc/libtorch_stable/attention/exl3_sparse_mla/exl3_sparse_mla_ops.cpp)::

    exl3_sparse_mla_decode(Tensor q, Tensor kv_cache, Tensor indices, float scale,
                           int kv_format, Tensor(a!) out, Tensor(b!) lse,
                           Tensor workspace) -> ()

q bf16 [T, H, D] (D = 576: 512 latent + 64 rope, or 512), last dim contiguous;
kv_cache vLLM's MLA cache [num_blocks, block_size, row]: kv_format 0 bf16 rows of D,
1 fp8_ds_mla (uint8 rows of 656 bytes, D = 576), any block and row strides (16-byte
multiples); indices int32 [T, topk] of global slots `block * block_size + offset`, -1 =
no token (slots outside the cache count as none); out bf16 [T, H, 512]; lse fp32
[T, H]; a token with no selected row gets zeros and -inf. `workspace` (uint8, at least
`workspace_bytes(T, H, topk)` bytes) holds the split-k partials; the split count is a
function of (T, H, topk, SM count) only, so a captured CUDA graph replays it.
"""

from __future__ import annotations

import functools
import math

import torch

# Mirrors csrc/libtorch_stable/attention/exl3_sparse_mla/exl3_sparse_mla.cuh.
LATENT = 512
ROPE = 64
HEAD_SIZES = (576, 512)
MAX_HEADS = 128
FP8_ROW_BYTES = 656
FP8_SCALE_GROUP = 128
FP8_SCALE_OFFSET = LATENT
FP8_ROPE_OFFSET = FP8_SCALE_OFFSET + 4 * (LATENT // FP8_SCALE_GROUP)
# vLLM's fp8_ds_mla cache writer: scale = max(amax / 448, FLT_MIN) per 128 values.
FP8_E4M3_MAX = 448.0
KV_FORMAT_BF16 = 0
KV_FORMAT_FP8_DS_MLA = 1
HEADS_PER_MMA = 16
TWO_TILE_MIN_HEADS = 64
ROWS_PER_TILE = 32
# Heads of one CTA of Hopper's wgmma path (wgmma's M); from TWO_TILE_MIN_HEADS heads on
# the split rule counts work in these units on every architecture.
WGMMA_HEADS = 64
SPLIT_CTAS_PER_SM_ONE_TILE = 2
SPLIT_CTAS_PER_SM_TWO_TILES = 1
MIN_TILES_PER_SPLIT = 2
MAX_SPLITS = 64
# q rows, cache rows and their strides move in 16-byte cp.async chunks.
CHUNK_BYTES = 16
# The reference's fp32 gather of [tokens, topk, 576] rows, bounded per token chunk: a
# prefill step of thousands of tokens then needs a few of these, not gigabytes
# (DeepSeek's top-k of 2048 gives 56 tokens a chunk).
REFERENCE_CHUNK_BYTES = 256 << 20

OP = "exl3_sparse_mla_decode"


class SparseMLAInputError(ValueError):
    """A sparse-MLA input breaks a rule of the op (the message names the argument)."""


def _fail(msg: str) -> None:
    raise SparseMLAInputError(f"{OP}: {msg}")


def head_tiles(num_heads: int) -> int:
    """16-head MMA tiles per CTA (head_tiles in exl3_sparse_mla.cuh)."""
    return 2 if num_heads >= TWO_TILE_MIN_HEADS else 1


def head_groups(num_heads: int) -> int:
    """CTAs per token and split of the mma.sync path."""
    return -(-num_heads // (HEADS_PER_MMA * head_tiles(num_heads)))


def split_units(num_heads: int) -> int:
    """The split rule's units of work per token (split_units in exl3_sparse_mla.cuh):
    one-tile CTAs, or from TWO_TILE_MIN_HEADS heads on groups of WGMMA_HEADS heads."""
    if head_tiles(num_heads) == 2:
        return -(-num_heads // WGMMA_HEADS)
    return head_groups(num_heads)


def num_splits(num_tokens: int, num_heads: int, topk: int, sm_count: int) -> int:
    """Split-k count: the C++ rule (num_splits in exl3_sparse_mla.cuh), verbatim."""
    tiles = -(-topk // ROWS_PER_TILE)
    base = num_tokens * split_units(num_heads)
    per_sm = (
        SPLIT_CTAS_PER_SM_TWO_TILES
        if head_tiles(num_heads) == 2
        else SPLIT_CTAS_PER_SM_ONE_TILE
    )
    if base <= 0:
        return 1
    s = sm_count * per_sm // base
    s = min(s, tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS)
    if s <= 1:
        return 1
    per = -(-tiles // s)
    return -(-tiles // per)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sm_count(device: torch.device | int | None) -> int:
    dev = torch.device("cuda") if device is None else torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def workspace_bytes(
    num_tokens: int,
    num_heads: int,
    topk: int,
    sm_count: int | None = None,
    device: torch.device | int | None = None,
) -> int:
    """Bytes of workspace the op needs (0 without split-k): fp32 partial outputs and
    log-sum-exps of every split. A host function; `sm_count` defaults to the SM count
    of `device` (the current CUDA device)."""
    if sm_count is None:
        sm_count = _device_sm_count(device)
    s = num_splits(num_tokens, num_heads, topk, sm_count)
    return 0 if s <= 1 else 4 * s * num_tokens * num_heads * (LATENT + 1)


def max_workspace_bytes(
    max_tokens: int,
    num_heads: int,
    topk: int,
    sm_count: int | None = None,
    device: torch.device | int | None = None,
) -> int:
    """The largest `workspace_bytes` over 1..max_tokens tokens: one buffer, sized
    once, serves every batch a backend (and its CUDA graphs) runs. Split-k only runs
    while one pass has at most one CTA per SM, so the walk is short."""
    if sm_count is None:
        sm_count = _device_sm_count(device)
    last = min(max_tokens, -(-sm_count // split_units(num_heads)))
    return max(
        (workspace_bytes(t, num_heads, topk, sm_count) for t in range(1, last + 1)),
        default=0,
    )


def sparse_mla_decode_fake(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    kv_format: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    workspace: torch.Tensor,
) -> None:
    """The op writes out and lse in place and returns nothing."""
    return None


@functools.cache
def load_sparse_mla_op() -> tuple[bool, str | None]:
    """Make the op available once (the EXL3 extension's loader); returns (available,
    why not)."""
    # At the first call, not at import: this module imports only torch, so the
    # benchmark (scripts/bench/bench_sparse_mla.py) loads it from its file without vLLM.
    from vllm.model_executor.layers.quantization.exl3.ops import (
        load_exl3_ops,
        register_missing_fakes,
    )

    if not hasattr(torch.ops._C, OP):
        ok, why = load_exl3_ops()
        if not ok:
            return False, why
    if not hasattr(torch.ops._C, OP):
        return False, (
            f"torch.ops._C.{OP} is not registered: the EXL3 extension is an older "
            "build (rebuild the kernels)"
        )
    register_missing_fakes({OP: sparse_mla_decode_fake})
    return True, None


def _kv_format_of(kv_format: int | str) -> int:
    if isinstance(kv_format, str):
        names = {
            "bfloat16": KV_FORMAT_BF16,
            "auto": KV_FORMAT_BF16,
            "fp8_ds_mla": KV_FORMAT_FP8_DS_MLA,
        }
        if kv_format not in names:
            _fail(f"kv_format {kv_format!r} is not one of {sorted(names)} (or 0 / 1)")
        return names[kv_format]
    if kv_format not in (KV_FORMAT_BF16, KV_FORMAT_FP8_DS_MLA):
        _fail(f"kv_format must be 0 (bf16 rows) or 1 (fp8_ds_mla), got {kv_format}")
    return int(kv_format)


def _aligned(t: torch.Tensor) -> bool:
    try:
        return t.data_ptr() % CHUNK_BYTES == 0
    except RuntimeError:  # a fake tensor while tracing: the C++ op checks it again
        return True


def check_inputs(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    kv_format: int | str,
) -> tuple[torch.Tensor, int]:
    """Validates the inputs (the op's rules, with errors naming the argument); returns
    the cache as the op reads it (an fp8_ds_mla cache of another 1-byte dtype is viewed
    as uint8) and the numeric kv_format."""
    fmt = _kv_format_of(kv_format)
    if not isinstance(q, torch.Tensor) or q.dtype != torch.bfloat16:
        _fail(f"q must be a bfloat16 tensor, got {getattr(q, 'dtype', type(q))}")
    if q.dim() != 3:
        _fail(f"q must be [tokens, heads, head_size], got {list(q.shape)}")
    t, h, d = q.shape
    if d not in HEAD_SIZES:
        _fail(f"q's head size must be 576 (512 latent + 64 rope) or 512, got {d}")
    if not 1 <= h <= MAX_HEADS:
        _fail(f"q has {h} heads; 1..{MAX_HEADS} are supported")
    if q.stride(2) != 1:
        _fail(f"q's last dimension must be contiguous (stride 1), got {q.stride(2)}")
    if q.device.type == "cuda" and (
        not _aligned(q)
        or (q.stride(0) * 2) % CHUNK_BYTES
        or (q.stride(1) * 2) % CHUNK_BYTES
    ):
        _fail("q's data and its token and head strides must be 16-byte aligned")
    if kv_cache.device != q.device:
        _fail(f"kv_cache is on {kv_cache.device} but q is on {q.device}")
    if kv_cache.dim() != 3:
        shape = list(kv_cache.shape)
        _fail(f"kv_cache must be [num_blocks, block_size, row], got {shape}")
    if fmt == KV_FORMAT_FP8_DS_MLA:
        if kv_cache.element_size() != 1:
            _fail(
                "an fp8_ds_mla kv_cache (kv_format 1) must have a 1-byte dtype, got "
                f"{kv_cache.dtype}"
            )
        kv_cache = kv_cache.view(torch.uint8)
        if kv_cache.shape[2] != FP8_ROW_BYTES:
            _fail(
                f"an fp8_ds_mla kv_cache row is {FP8_ROW_BYTES} bytes, got "
                f"{list(kv_cache.shape)}"
            )
        if d != 576:
            _fail(f"the fp8_ds_mla cache holds 576-wide rows but q's head size is {d}")
    else:
        if kv_cache.dtype != torch.bfloat16:
            _fail(
                f"a bf16 kv_cache (kv_format 0) must be bfloat16, got {kv_cache.dtype}"
            )
        if kv_cache.shape[2] != d:
            _fail(
                f"kv_cache {list(kv_cache.shape)} rows do not match q's head size {d}"
            )
    if kv_cache.shape[0] < 1 or kv_cache.shape[1] < 1:
        _fail(f"kv_cache {list(kv_cache.shape)} is empty")
    if kv_cache.stride(2) != 1:
        _fail(f"kv_cache rows must be contiguous (stride 1), got {kv_cache.stride(2)}")
    es = kv_cache.element_size()
    if kv_cache.device.type == "cuda" and (
        not _aligned(kv_cache)
        or (kv_cache.stride(0) * es) % CHUNK_BYTES
        or (kv_cache.stride(1) * es) % CHUNK_BYTES
    ):
        _fail("kv_cache's data, block stride and row stride must be 16-byte aligned")
    if indices.device != q.device:
        _fail(f"indices is on {indices.device} but q is on {q.device}")
    if indices.dtype != torch.int32:
        _fail(f"indices must be int32, got {indices.dtype}")
    if indices.dim() != 2 or indices.shape[0] != t:
        _fail(f"indices must be [tokens = {t}, topk], got {list(indices.shape)}")
    if indices.shape[1] < 1:
        _fail("topk (indices.shape[1]) must be at least 1")
    if indices.shape[1] > 1 and indices.stride(1) != 1:
        _fail(
            "indices' last dimension must be contiguous (stride 1), got "
            f"{indices.stride(1)}"
        )
    if not math.isfinite(float(scale)):
        _fail(f"scale must be finite, got {scale}")
    return kv_cache, fmt


def _outputs(
    q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse as the op writes them: allocated when not given, else checked."""
    t, h, _ = q.shape
    if out is None:
        out = q.new_empty((t, h, LATENT))
    if lse is None:
        lse = q.new_empty((t, h), dtype=torch.float32)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (t, h, LATENT):
        got = f"{out.dtype} {list(out.shape)}"
        _fail(f"out must be bfloat16 [{t}, {h}, {LATENT}], got {got}")
    if not out.is_contiguous():
        _fail("out must be contiguous")
    if lse.dtype != torch.float32 or tuple(lse.shape) != (t, h):
        _fail(f"lse must be float32 [{t}, {h}], got {lse.dtype} {list(lse.shape)}")
    if not lse.is_contiguous():
        _fail("lse must be contiguous")
    if out.device != q.device or lse.device != q.device:
        where = f"out is on {out.device}, lse on {lse.device}"
        _fail(f"{where}; both must be on q's device {q.device}")
    return out, lse


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    kv_format: int | str,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out bf16 [T, H, 512], lse fp32 [T, H]) of the top-k rows (module docstring).
    `out`, `lse` and `workspace` are allocated when not given; pass them (sized once,
    e.g. for the largest batch) to run inside a CUDA graph."""
    kv_cache, fmt = check_inputs(q, kv_cache, indices, scale, kv_format)
    t, h, _ = q.shape
    out, lse = _outputs(q, out, lse)
    # A CPU q reaches the op only through a test's stand-in registration.
    need = workspace_bytes(t, h, indices.shape[1], device=q.device) if q.is_cuda else 0
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=q.device)
    elif workspace.dtype != torch.uint8 or workspace.numel() < need:
        _fail(
            f"workspace must be uint8 with at least {need} bytes (workspace_bytes), "
            f"got {workspace.dtype} with {workspace.numel()} elements"
        )
    # Under torch.compile the op is loaded already (the backend loads it when built).
    if not torch.compiler.is_compiling():
        ok, why = load_sparse_mla_op()
        if not ok:
            raise RuntimeError(f"{OP} is not available: {why}")
        if not q.is_cuda and not torch._C._dispatch_has_kernel_for_dispatch_key(
            f"_C::{OP}", "CPU"
        ):
            _fail(
                f"q is on {q.device}: the kernel runs on CUDA tensors "
                "(sparse_mla_reference is the CPU path)"
            )
    torch.ops._C.exl3_sparse_mla_decode(
        q, kv_cache, indices, float(scale), fmt, out, lse, workspace
    )
    return out, lse


def dequantize_fp8_ds_mla(rows: torch.Tensor) -> torch.Tensor:
    """fp32 [..., 576] of uint8 fp8_ds_mla rows [..., 656]: e4m3 latent times its
    per-128 scale, then the bf16 rope."""
    rows = rows.view(torch.uint8)
    lead = rows.shape[:-1]
    latent = rows[..., :LATENT].contiguous().view(torch.float8_e4m3fn).float()
    scales = (
        rows[..., FP8_SCALE_OFFSET:FP8_ROPE_OFFSET].contiguous().view(torch.float32)
    )
    latent = (
        latent.view(*lead, LATENT // FP8_SCALE_GROUP, FP8_SCALE_GROUP)
        * scales.unsqueeze(-1)
    ).view(*lead, LATENT)
    rope = rows[..., FP8_ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    return torch.cat([latent, rope], dim=-1)


def quantize_fp8_ds_mla(kv: torch.Tensor) -> torch.Tensor:
    """uint8 fp8_ds_mla rows [..., 656] of bf16/fp32 rows [..., 576], as vLLM's cache
    writer makes them (per-128 scale = max(amax / 448, FLT_MIN), e4m3 of value / scale,
    rope kept in bf16)."""
    lead = kv.shape[:-1]
    latent = kv[..., :LATENT].float().view(*lead, LATENT // FP8_SCALE_GROUP, -1)
    scale = (latent.abs().amax(dim=-1) / FP8_E4M3_MAX).clamp_min(
        torch.finfo(torch.float32).tiny
    )
    q8 = (latent / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(*lead, LATENT)
    out = torch.empty((*lead, FP8_ROW_BYTES), dtype=torch.uint8, device=kv.device)
    out[..., :LATENT] = q8.view(torch.uint8)
    out[..., FP8_SCALE_OFFSET:FP8_ROPE_OFFSET] = scale.contiguous().view(torch.uint8)
    out[..., FP8_ROPE_OFFSET:] = (
        kv[..., LATENT:].to(torch.bfloat16).contiguous().view(torch.uint8)
    )
    return out


def sparse_mla_reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    kv_format: int | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (out [T, H, 512], lse [T, H]) by gather, dequantize, softmax and weighted
    sum, on any device: the tests' oracle, the CPU path of the backend tests and
    (chunked by `sparse_mla_reference_into`) the backend's VLLM_EXL3_FORCE_REFERENCE
    path.
    Slots outside the cache count as none, like the kernel."""
    kv_cache, fmt = check_inputs(q, kv_cache, indices, scale, kv_format)
    t, h, d = q.shape
    nb, bs = kv_cache.shape[:2]
    idx = indices.long()
    valid = (idx >= 0) & (idx < nb * bs)
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    rows = kv_cache[safe // bs, safe % bs]  # [T, topk, row]
    k = dequantize_fp8_ds_mla(rows) if fmt == KV_FORMAT_FP8_DS_MLA else rows.float()
    # A "none" slot reads row 0, which may hold anything (NaN in an unwritten fp8
    # row): zeroed, so its zero weight cannot turn it into NaN.
    k = torch.where(valid.unsqueeze(-1), k, 0.0)
    scores = torch.einsum("thd,tkd->thk", q.float(), k) * float(scale)
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = ~valid.any(dim=-1)  # [T]
    p = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    out = torch.einsum("thk,tkd->thd", p, k[..., :LATENT])
    out = out.masked_fill(empty.view(t, 1, 1), 0.0)
    lse = lse.masked_fill(empty.view(t, 1), float("-inf"))
    return out, lse


def reference_chunk_tokens(topk: int, head_size: int) -> int:
    """Tokens per chunk of `sparse_mla_reference_into` (REFERENCE_CHUNK_BYTES of fp32
    gathered rows; at least one)."""
    return max(1, REFERENCE_CHUNK_BYTES // (topk * head_size * 4))


def sparse_mla_reference_into(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    kv_format: int | str,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_mla_reference` in the op's form: written into out (bf16, as the op's) and
    lse, in token chunks of `reference_chunk_tokens`. The chunks are a function of the
    shapes and nothing reads a tensor's values on the host, so a CUDA graph captures
    it: the backend's path under VLLM_EXL3_FORCE_REFERENCE=1."""
    check_inputs(q, kv_cache, indices, scale, kv_format)
    out, lse = _outputs(q, out, lse)
    t, _, d = q.shape
    step = reference_chunk_tokens(indices.shape[1], d)
    for start in range(0, t, step):
        end = min(start + step, t)
        chunk_out, chunk_lse = sparse_mla_reference(
            q[start:end], kv_cache, indices[start:end], scale, kv_format
        )
        out[start:end].copy_(chunk_out)
        lse[start:end].copy_(chunk_lse)
    return out, lse
