# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""EXL3_MLA_SPARSE: sparse MLA (DeepSeek-V3.2, GLM-5 DSA) on the EXL3 sparse-MLA op.

Every token that vLLM's sparse MLA layer routes to `forward_mqa` (decodes, and prefill
tokens whose context is longer than the indexer's top-k) runs through one op,
`torch.ops._C.exl3_sparse_mla_decode`: the absorbed 576-wide query against the rows the
indexer selected, read straight from the paged cache in either layout (bf16 rows, or
the 656-byte fp8_ds_mla rows, dequantized in registers: no upconverted copy of the
cache). Prefills no longer than the top-k keep vLLM's dense-MHA prefill path
(`MLACommonBaseImpl.forward_mha`), which is exact there because the top-k then covers
the whole context.

KV-cache dtypes (`--kv-cache-dtype`):

| given | cache | row |
|---|---|---|
| auto, bfloat16 | bf16 | 576 bf16: 512 latent, 64 rope |
| fp8, fp8_e4m3, fp8_ds_mla | fp8_ds_mla | 656 B: 512 e4m3, 4 fp32 scales, 64 bf16 |
| anything else | rejected at selection, naming the dtype and the accepted ones |

`VLLM_EXL3_FORCE_REFERENCE=1` (read through `vllm.envs` when a layer is built) routes
`forward_mqa` through the op wrapper's fp32 reference instead of the op, chunked over
tokens and free of host syncs so CUDA graphs still capture it: a truth anchor for the
kernel, slow, for debugging. The op is still required at selection.

Head size 576 only: DeepSeek V4 (head 512) builds its own attention layers and backends
(`vllm/models/deepseek_v4`) and never asks the generic selector for a sparse MLA
backend, so no vLLM 0.26 model can reach this backend with another head size.
"""

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import vllm.envs as envs
from vllm import _custom_ops as ops
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.config.cache import CacheDType
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import MLACommonPrefillMetadata
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
    SparseMLACommonMetadataBuilder,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionLayer,
    AttentionMetadata,
    AttentionType,
    MultipleOf,
)
from vllm.v1.attention.backends.mla.sparse_utils import (
    triton_convert_req_index_to_global_index,
)
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.worker.workspace import current_workspace_manager

if TYPE_CHECKING:
    from types import ModuleType

    from vllm.model_executor.models.deepseek_v2 import Indexer

logger = init_logger(__name__)

BACKEND_NAME = "EXL3_MLA_SPARSE"

# The op's row: the 512-wide latent (also the output width) and 64 rope values.
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
HEAD_SIZE = KV_LORA_RANK + QK_ROPE_HEAD_DIM
# fp8_ds_mla row: 512 e4m3 latent values, one fp32 scale per 128 of them, bf16 rope.
FP8_DS_MLA_SCALE_GROUP = 128
FP8_DS_MLA_ROW_BYTES = (
    KV_LORA_RANK + (KV_LORA_RANK // FP8_DS_MLA_SCALE_GROUP) * 4 + QK_ROPE_HEAD_DIM * 2
)

# The op's `kv_format` argument (the contract in the op's wrapper module).
KV_FORMAT_BF16 = 0
KV_FORMAT_FP8_DS_MLA = 1

BF16_CACHE_DTYPES: tuple[str, ...] = ("auto", "bfloat16")
# fp8 and fp8_e4m3 name the same e4m3 cache; this backend stores it as fp8_ds_mla
# (per-128 scales keep the latent accurate where one per-tensor scale does not).
FP8_DS_MLA_CACHE_DTYPES: tuple[str, ...] = ("fp8", "fp8_e4m3", "fp8_ds_mla")

# The architectures the op is compiled for: sm_90 (Hopper), sm_120 / sm_121 (RTX
# Blackwell, GB10). The backend class spells these lists out literally: vLLM's
# attention-backend docs generator reads them from the source.
BUILT_ARCHS = "sm_90, sm_120, sm_121"
KERNEL_BLOCK_SIZES: tuple[int, ...] = (64, 256)
# The op's head range (the contract); DeepSeek's 128 heads at TP 1 is the largest.
MAX_NUM_HEADS = 128
# Requests extending by at most this many tokens are batched with the decodes: the
# op costs the same per token for both, and FlashMLA-sparse's builder uses the same
# floor on Hopper.
DECODE_QUERY_LEN_THRESHOLD = 128

# triton_convert_req_index_to_global_index's column tile: the top-k width must fill
# whole tiles (DeepSeek-V3.2 and GLM-5 use 2048).
TOPK_TILE = 128

SPARSE_MLA_OP = "exl3_sparse_mla_decode"
OPS_MODULE = "vllm.v1.attention.ops.exl3_sparse_mla"


def canonical_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The cache dtype this backend stores for `kv_cache_dtype` (fp8 aliases become
    fp8_ds_mla); raises ValueError for a dtype it cannot store."""
    if kv_cache_dtype in BF16_CACHE_DTYPES or kv_cache_dtype == "fp8_ds_mla":
        return kv_cache_dtype
    if kv_cache_dtype in FP8_DS_MLA_CACHE_DTYPES:
        return "fp8_ds_mla"
    raise ValueError(unsupported_kv_cache_dtype_reason(kv_cache_dtype))


def unsupported_kv_cache_dtype_reason(kv_cache_dtype: str) -> str:
    return (
        f"{BACKEND_NAME}: kv_cache_dtype {kv_cache_dtype!r} is not supported; "
        f"use one of {', '.join(BF16_CACHE_DTYPES)} (bf16 cache) or "
        f"{', '.join(FP8_DS_MLA_CACHE_DTYPES)} (the {FP8_DS_MLA_ROW_BYTES}-byte "
        "fp8_ds_mla cache)"
    )


def kv_format_for(kv_cache_dtype: str) -> int:
    """The op's kv_format for a (canonical or alias) cache dtype."""
    if canonical_kv_cache_dtype(kv_cache_dtype) == "fp8_ds_mla":
        return KV_FORMAT_FP8_DS_MLA
    return KV_FORMAT_BF16


def sparse_mla_op_unavailable() -> str | None:
    """Why the EXL3 sparse-MLA op cannot run in this process, or None."""
    try:
        loaded, why = _import_ops().load_sparse_mla_op()
    except ImportError as e:
        return str(e)
    if not loaded:
        return f"{BACKEND_NAME} needs torch.ops._C.{SPARSE_MLA_OP}: {why}"
    return None


def reference_forced() -> bool:
    """VLLM_EXL3_FORCE_REFERENCE: the op's fp32 reference instead of the op."""
    return envs.VLLM_EXL3_FORCE_REFERENCE


def _import_ops() -> "ModuleType":
    import importlib

    try:
        return importlib.import_module(OPS_MODULE)
    except ImportError as e:
        raise ImportError(f"{BACKEND_NAME} cannot import {OPS_MODULE}: {e}") from e


class Exl3MLASparseBackend(AttentionBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[CacheDType]] = [
        "auto",
        "bfloat16",
        "fp8",  # stored as fp8_ds_mla
        "fp8_e4m3",  # stored as fp8_ds_mla
        "fp8_ds_mla",
    ]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type["Exl3MLASparseMetadataBuilder"]:
        return Exl3MLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type["Exl3MLASparseImpl"]:
        return Exl3MLASparseImpl

    @staticmethod
    def get_supported_kernel_block_sizes() -> list[int | MultipleOf]:
        return [64, 256]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major in [9, 12]

    @classmethod
    def canonicalize_kv_cache_dtype(cls, kv_cache_dtype: CacheDType) -> CacheDType:
        """Called by `MLAAttention` once this backend is chosen: the dtype the cache
        is allocated with."""
        return canonical_kv_cache_dtype(kv_cache_dtype)  # type: ignore[return-value]

    @classmethod
    def supports_combination(
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: CacheDType | None,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        device_capability: DeviceCapability,
    ) -> str | None:
        # vLLM's generic checks name only the field; these say what to use instead.
        reasons = []
        if dtype != torch.bfloat16:
            reasons.append(
                f"{BACKEND_NAME}: model dtype {dtype} is not supported; the op "
                "reads bf16 queries (run with --dtype bfloat16)"
            )
        if kv_cache_dtype is not None and (
            kv_cache_dtype not in BF16_CACHE_DTYPES + FP8_DS_MLA_CACHE_DTYPES
        ):
            reasons.append(unsupported_kv_cache_dtype_reason(kv_cache_dtype))
        if head_size != HEAD_SIZE:
            reasons.append(
                f"{BACKEND_NAME}: head size {head_size} is not supported; the op "
                f"reads {HEAD_SIZE}-wide rows (kv_lora_rank {KV_LORA_RANK} + rope "
                f"{QK_ROPE_HEAD_DIM})"
            )
        if not cls.supports_compute_capability(device_capability):
            reasons.append(
                f"{BACKEND_NAME}: compute capability "
                f"{device_capability.major}.{device_capability.minor} is not "
                f"supported; the op is built for {BUILT_ARCHS}"
            )
        if not reasons:
            missing = sparse_mla_op_unavailable()
            if missing is not None:
                reasons.append(missing)
        return "; ".join(reasons) if reasons else None

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,  # 1 for MLA
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        if kv_format_for(cache_dtype_str) == KV_FORMAT_FP8_DS_MLA:
            return (num_blocks, block_size, FP8_DS_MLA_ROW_BYTES)
        return (num_blocks, block_size, head_size)


@dataclass
class Exl3MLASparseMetadata(AttentionMetadata):
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    num_actual_tokens: int  # excluding CUDA-graph padding
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    req_id_per_token: torch.Tensor
    seq_lens: torch.Tensor
    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    prefill_max_seq_len: int = 0
    prefill: MLACommonPrefillMetadata | None = None
    block_size: int = 64
    topk_tokens: int = 2048
    cp_kv_cache_interleave_size: int = 1


class Exl3MLASparseMetadataBuilder(
    SparseMLACommonMetadataBuilder[Exl3MLASparseMetadata]
):
    """The common sparse builder: per-token request ids, the decode/prefill split and
    the dense-prefill metadata. The op needs nothing per step beyond the block table,
    so a decode batch replays as one CUDA graph."""

    metadata_cls = Exl3MLASparseMetadata
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(
            DECODE_QUERY_LEN_THRESHOLD, supports_spec_as_decode=True
        )


class Exl3MLASparseImpl(SparseMLACommonImpl[Exl3MLASparseMetadata]):
    # The op's lse is natural-log; it is returned, but decode context parallelism
    # (which would merge it across ranks) also needs the DCP index filter: not built.
    lse_base_on_e: bool = True
    supports_dcp: bool = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None,
        attn_type: str,
        kv_sharing_target_layer_name: str | None,
        topk_indices_buffer: torch.Tensor | None = None,
        indexer: "Indexer | None" = None,
        **mla_args,
    ) -> None:
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise NotImplementedError(
                f"{BACKEND_NAME} does not support alibi_slopes, sliding_window or "
                "logits_soft_cap"
            )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"{BACKEND_NAME} supports decoder self-attention only, not {attn_type}"
            )
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            indexer=indexer,
            topk_indices_buffer=topk_indices_buffer,
            **mla_args,
        )
        self.kv_format = kv_format_for(kv_cache_dtype)
        if kv_cache_dtype != canonical_kv_cache_dtype(kv_cache_dtype):
            raise ValueError(
                f"{BACKEND_NAME}: kv_cache_dtype {kv_cache_dtype!r} reached the "
                f"layer un-canonicalized; the cache is allocated as "
                f"{canonical_kv_cache_dtype(kv_cache_dtype)!r}"
            )
        if (self.kv_lora_rank, self.qk_rope_head_dim) != (
            KV_LORA_RANK,
            QK_ROPE_HEAD_DIM,
        ) or head_size != HEAD_SIZE:
            raise ValueError(
                f"{BACKEND_NAME}: kv_lora_rank {self.kv_lora_rank} + rope "
                f"{self.qk_rope_head_dim} (head {head_size}) is not supported; the "
                f"op needs {KV_LORA_RANK} + {QK_ROPE_HEAD_DIM}"
            )
        if not 1 <= num_heads <= MAX_NUM_HEADS:
            raise ValueError(
                f"{BACKEND_NAME}: {num_heads} query heads per rank; the op takes "
                f"1..{MAX_NUM_HEADS}"
            )
        if self.topk_indices_buffer is None:
            raise ValueError(
                f"{BACKEND_NAME} needs the indexer's top-k buffer (an indexer or "
                "topk_indices_buffer); this layer has neither"
            )
        vllm_config = get_current_vllm_config()
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            raise NotImplementedError(
                f"{BACKEND_NAME} does not support decode context parallelism"
            )
        self.softmax_scale = float(scale)
        # The query stays bf16 with an fp8 cache: the op dequantizes the rows.
        self.supports_quant_query_input = False
        self.topk = self.topk_indices_buffer.shape[1]
        if self.topk % TOPK_TILE != 0:
            raise ValueError(
                f"{BACKEND_NAME}: index_topk {self.topk} is not a multiple of "
                f"{TOPK_TILE} (vLLM's top-k index conversion works in tiles of "
                f"{TOPK_TILE})"
            )
        self._ops = _import_ops()
        self.use_reference = reference_forced()
        if self.use_reference:
            logger.info_once(
                "%s: VLLM_EXL3_FORCE_REFERENCE=1, sparse MLA through the fp32 "
                "reference (slow)",
                BACKEND_NAME,
            )
        # Reserve the largest step's buffers now: the workspace is locked after the
        # warm-up, and a later step (or a CUDA graph capture) must not grow it. The
        # op's split count, so its workspace, falls as tokens grow: its largest
        # over every step size, not the largest step's.
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        max_op_bytes = self._ops.max_workspace_bytes(
            max_tokens, self.num_heads, self.topk
        )
        current_workspace_manager().get_simultaneous(
            ((max_tokens, self.num_heads, self.head_size), torch.bfloat16),
            ((max_op_bytes,), torch.uint8),
        )

    def _workspace(
        self, num_tokens: int, device: torch.device | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (q concat buffer, op workspace) into vLLM's shared workspace."""
        op_bytes = self._ops.workspace_bytes(
            num_tokens, self.num_heads, self.topk, device=device
        )
        q_buffer, op_workspace = current_workspace_manager().get_simultaneous(
            ((num_tokens, self.num_heads, self.head_size), torch.bfloat16),
            ((op_bytes,), torch.uint8),
        )
        return q_buffer, op_workspace

    def forward_mqa(
        self,
        q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        kv_c_and_k_pe_cache: torch.Tensor,
        attn_metadata: Exl3MLASparseMetadata,
        layer: AttentionLayer,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        first = q[0] if isinstance(q, tuple) else q
        q_buffer, op_workspace = self._workspace(first.shape[0], first.device)
        num_tokens = first.shape[0]
        if isinstance(q, tuple):
            ql_nope, q_pe = q
            ops.concat_mla_q(ql_nope, q_pe, q_buffer)
            q = q_buffer

        assert self.topk_indices_buffer is not None
        topk_indices = self.topk_indices_buffer[:num_tokens]
        # Request-relative token positions -> physical cache slots (-1 stays -1).
        # req_id_per_token covers the whole batch; the MQA tokens are its head.
        slots = triton_convert_req_index_to_global_index(
            attn_metadata.req_id_per_token[:num_tokens],
            attn_metadata.block_table,
            topk_indices,
            BLOCK_SIZE=attn_metadata.block_size,
            NUM_TOPK_TOKENS=topk_indices.shape[1],
        )
        out = q.new_empty((num_tokens, self.num_heads, self.kv_lora_rank))
        lse = q.new_empty((num_tokens, self.num_heads), dtype=torch.float32)
        run = (
            self._ops.sparse_mla_reference_into
            if self.use_reference
            else functools.partial(self._ops.sparse_mla_decode, workspace=op_workspace)
        )
        run(
            q,
            kv_c_and_k_pe_cache,
            slots,
            self.softmax_scale,
            self.kv_format,
            out=out,
            lse=lse,
        )
        return out, lse
