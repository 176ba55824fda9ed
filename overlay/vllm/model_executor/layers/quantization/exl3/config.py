# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`Exl3Config`: what the checkpoint holds, and which method each vLLM layer gets (the
layer's prefix resolved to its checkpoint module by names.py).

An EXL3 module is defined by its tensors (`P.trellis` exists; bitrate = trellis width /
16; codebook = the marker present), not by the JSON. config.json's `quantization_config`
block makes vLLM pick this method (`from_config`); `maybe_update_config` then reads the
per-module description: the safetensors headers (shapes and dtypes only, no data) and
quantization_config.json's `tensor_storage`. Where they disagree the tensors win, with a
warning; modules the JSON does not list (an MTP head) are recovered from the headers. A
local checkpoint directory is validated as a whole first (checkpoint.py, the same
verdict as the tools give), so a damaged or mismatched one fails here, before vLLM reads
any weight; an architecture vLLM cannot run with EXL3 weights (unsupported_models.py)
fails before that.
"""

import os
from collections.abc import Mapping
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.transformers_utils.config import get_safetensors_params_metadata
from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

from .capability import MIN_CAPABILITY
from .checkpoint import (
    MTP_PREFIX,
    QUANT_CONFIG_FILE,
    declared_disagreements,
    find_modules,
    storage_claims,
    validate_checkpoint,
)
from .checkpoint_files import SAFETENSORS_INDEX, SAFETENSORS_SUFFIX, Exl3FormatError
from .dequantized import DENSE_CONSUMED, Exl3DequantizedLinearMethod
from .embedding import Exl3EmbeddingMethod
from .env_compat import adopt_deprecated_env_names
from .format import Codebook, Exl3EmbeddingSpec, Exl3ModuleSpec, TensorShape
from .layout import Exl3LayoutError
from .linear import (
    Exl3LinearMethod,
    Exl3LMHeadMethod,
    Exl3PaddedUnquantizedLinearMethod,
)
from .moe import Exl3MoEMethod, plan_experts
from .names import ModuleNameResolver, shard_names
from .unsupported_models import refuse_unsupported_architecture
from .weights import LoadLedger

logger = init_logger(__name__)

# tensor_storage spells dtypes as torch does; module_spec takes safetensors' spelling.
TORCH_TO_SAFETENSORS_DTYPE = {
    "torch.int16": "I16",
    "torch.int32": "I32",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.float32": "F32",
}


def header_tensors(
    metadata: Mapping[str, Any],
) -> dict[str, TensorShape]:
    """vLLM's safetensors metadata ({name: {"dtype", "shape", ...}}) as name -> (shape,
    dtype)."""
    return {
        name: (tuple(info["shape"]), info["dtype"])
        for name, info in metadata.items()
        if isinstance(info, Mapping) and "dtype" in info
    }


def storage_tensors(
    storage: Mapping[str, Any],
) -> dict[str, TensorShape]:
    """quantization_config.json's tensor_storage: name -> (shape, safetensors dtype)."""
    out = {}
    for entry in storage.values():
        for name, info in entry.get("stored_tensors", {}).items():
            dtype = TORCH_TO_SAFETENSORS_DTYPE.get(info.get("dtype"), info.get("dtype"))
            out[name] = (tuple(info["shape"]), dtype)
    return out


def describe_checkpoint(
    headers: Mapping[str, TensorShape],
    storage: Mapping[str, Any] | None,
    source: str,
) -> tuple[dict[str, Exl3ModuleSpec], dict[str, Exl3EmbeddingSpec]]:
    """Reconcile the safetensors headers (authoritative) with tensor_storage: where
    they disagree, the warnings a local checkpoint gets (declared_disagreements)."""
    if not headers:
        if not storage:
            raise ValueError(
                f"EXL3 checkpoint {source}: neither the safetensors headers nor "
                f"{QUANT_CONFIG_FILE}'s tensor_storage could be read; cannot tell "
                "which modules "
                f"are EXL3"
            )
        logger.warning(
            "EXL3 checkpoint %s: safetensors headers not readable; describing the "
            "modules from %s's tensor_storage",
            source,
            QUANT_CONFIG_FILE,
        )
        return find_modules(storage_tensors(storage))
    specs, embeddings = find_modules(headers)
    if storage is None:
        logger.info(
            "EXL3 checkpoint %s: no %s tensor_storage; %d EXL3 modules found in the "
            "safetensors headers",
            source,
            QUANT_CONFIG_FILE,
            len(specs),
        )
        return specs, embeddings
    for warning in declared_disagreements(None, {"tensor_storage": storage}, specs):
        logger.warning("EXL3 checkpoint %s: %s", source, warning)
    return specs, embeddings


def building_a_dropped_tower() -> bool:
    """Whether the layer being built is part of a multimodal tower that vLLM builds only
    to drop (every modality's limit 0, e.g. --language-model-only: the model's
    _mark_tower_model builds it on the meta device and puts a StageMissingLayer in its
    place). None of its weights is loaded or run, so it takes vLLM's unquantized method:
    an EXL3 layout would be planned, and could be refused (a row-parallel width that
    does not split on 128 columns at this TP size), for a layer that never exists."""
    if torch.get_default_device().type != "meta":
        return False
    config = get_current_vllm_config_or_none()
    return (
        config is not None
        and config.model_config is not None
        and config.model_config.multimodal_config is not None
    )


class Exl3Config(QuantizationConfig):
    """EXL3 (ExLlamaV3 trellis quantization)."""

    def __init__(self, quant_block: Mapping[str, Any]):
        super().__init__()
        adopt_deprecated_env_names()
        block = dict(quant_block)
        # Present when the block came from quantization_config.json itself.
        self.tensor_storage: Mapping[str, Any] | None = block.pop(
            "tensor_storage", None
        )
        self.quant_block = block
        self.modules: dict[str, Exl3ModuleSpec] | None = None
        self.embeddings: dict[str, Exl3EmbeddingSpec] = {}
        self.resolver: ModuleNameResolver | None = None
        self._mapper = None
        # tensor_storage's (bits, codebook) per module; MoE experts must agree with it.
        self.claims: dict[str, tuple[float, Codebook]] = {}
        # One per model (per rank): every EXL3- and padding-owned tensor written
        # exactly once.
        self.ledger = LoadLedger()
        # Whether the checkpoint stores `mtp.` MTP layers (None: not described yet). The
        # target and its MTP draft share this config; the draft's layers resolve to
        # those tensors by their own names (mtp.fc, mtp.layers.0...).
        self.mtp_stored: bool | None = None

    def __repr__(self) -> str:
        described = (
            "undescribed" if self.modules is None else f"{len(self.modules)} modules"
        )
        return f"Exl3Config({self.quant_block}, {described})"

    @classmethod
    def get_name(cls) -> str:
        return "exl3"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return MIN_CAPABILITY

    @staticmethod
    def get_config_filenames() -> list[str]:
        # Only consulted when config.json has no quantization_config block.
        return [QUANT_CONFIG_FILE]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Exl3Config":
        return cls(config)

    def maybe_update_config(
        self, model_name: str, hf_config: Any = None, revision: str | None = None
    ) -> None:
        # Before the checkpoint is read: no tensor can make these models loadable.
        refuse_unsupported_architecture(hf_config, str(model_name))
        if _holds_weights(model_name):
            description = validate_checkpoint(model_name, tied=_tied(hf_config))
            for warning in description.warnings:
                logger.warning("EXL3 checkpoint %s: %s", model_name, warning)
            storage = self.tensor_storage
            if storage is None:
                storage = (description.quant_document or {}).get("tensor_storage")
            self.claims = (
                storage_claims(storage) if isinstance(storage, Mapping) else {}
            )
            self.mtp_stored = any(n.startswith(MTP_PREFIX) for n in description.tensors)
            self.set_checkpoint(description.modules, description.embeddings)
            return
        storage = self.tensor_storage
        if storage is None:
            kwargs = {} if revision is None else {"revision": revision}
            document = get_hf_file_to_dict(QUANT_CONFIG_FILE, model_name, **kwargs)
            storage = document.get("tensor_storage") if document else None
        headers = header_tensors(
            get_safetensors_params_metadata(model_name, revision=revision)
        )
        self.claims = storage_claims(storage) if storage else {}
        if headers:
            self.mtp_stored = any(n.startswith(MTP_PREFIX) for n in headers)
        self.set_checkpoint(*describe_checkpoint(headers, storage, str(model_name)))

    def set_checkpoint(
        self,
        modules: dict[str, Exl3ModuleSpec],
        embeddings: dict[str, Exl3EmbeddingSpec],
    ) -> None:
        self.modules = modules
        self.embeddings = embeddings
        self.resolver = ModuleNameResolver([*modules, *embeddings])
        if self._mapper is not None:
            self.resolver.set_mapper(self._mapper)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        self._mapper = hf_to_vllm_mapper
        if self.resolver is not None:
            self.resolver.set_mapper(hf_to_vllm_mapper)

    # ---- per layer
    # -----------------------------------------------------------------------

    def _resolve(self, name: str) -> str | None:
        assert self.resolver is not None
        return self.resolver.resolve(name)

    def linear_specs(self, prefix: str, num_shards: int) -> list[Exl3ModuleSpec] | None:
        """The EXL3 modules of a (fused) linear in shard order (one per output shard,
        or fewer: layout.module_spans), or None if it is not EXL3."""
        assert self.modules is not None
        direct = self._resolve(prefix)
        if direct is not None:
            # Possibly one module for several shards (the Qwen3-VL vision tower's
            # fused attn.qkv): layout.module_spans holds its width to theirs.
            return [self.modules[direct]]
        names = shard_names(prefix, self.packed_modules_mapping)
        if names == [prefix]:
            return None
        keys = [self._resolve(name) for name in names]
        if all(k is None for k in keys):
            return None
        if any(k is None for k in keys):
            found = ", ".join(f"{n} -> {k or 'not EXL3'}" for n, k in zip(names, keys))
            raise Exl3LayoutError(
                f"EXL3 {prefix}: fused layer mixes EXL3 and non-EXL3 shards ({found}); "
                "set "
                f"VLLM_EXL3_DEBUG_NAMES=1 to see how names resolve"
            )
        # A module may cover several consecutive shards (Qwen3.5's in_proj_qkv);
        # layout.module_spans decides which, from the stored widths.
        return [self.modules[k] for k in keys]

    def get_quant_method(
        self, layer: torch.nn.Module, prefix: str
    ) -> QuantizeMethodBase | None:
        if self.modules is None:
            raise ValueError(
                "Exl3Config.get_quant_method called before maybe_update_config "
                "described the "
                "checkpoint's modules"
            )
        if prefix.startswith(MTP_PREFIX) and self.mtp_stored is False:
            raise Exl3FormatError(
                f"{prefix}: missing: the checkpoint stores no MTP layers (no "
                f"{MTP_PREFIX}* tensor; ExLlamaV3 keeps them only where its "
                "architecture has an MTP model, e.g. Qwen3.5 / 3.6 multimodal, not "
                "Qwen3-Next), so the MTP draft cannot be built from it; run without "
                "speculative_config method 'mtp'"
            )
        if isinstance(layer, LinearBase):
            if building_a_dropped_tower():
                return UnquantizedLinearMethod()
            specs = self.linear_specs(prefix, len(layer.output_partition_sizes))
            if specs is None:
                # The format keeps unquantized linears 128-padded too; this is vLLM's
                # unquantized method with a loader that trims that padding (linear.py).
                return Exl3PaddedUnquantizedLinearMethod(self.ledger)
            if prefix.rpartition(".")[2] in DENSE_CONSUMED:
                return Exl3DequantizedLinearMethod(specs)
            return Exl3LinearMethod(specs, self.ledger)
        if isinstance(layer, ParallelLMHead):
            key = self._resolve(prefix)
            if key is None:
                return None
            return Exl3LMHeadMethod(prefix, self.modules[key], self.ledger)
        if isinstance(layer, VocabParallelEmbedding):
            key = self._resolve(prefix)
            if key not in self.embeddings:
                return None
            return Exl3EmbeddingMethod(prefix, self.embeddings[key], self.ledger)
        if isinstance(layer, RoutedExperts):
            return self._moe_method(layer, prefix)
        return None

    def _moe_method(
        self, layer: torch.nn.Module, prefix: str
    ) -> QuantizeMethodBase | None:
        """Exl3MoEMethod when the layer's experts are EXL3 modules; None (vLLM's
        unquantized experts) when the checkpoint has no EXL3 module under the prefix."""
        assert self.resolver is not None and self.modules is not None
        under = self.resolver.modules_under(prefix)
        inside = [k for k in under if k in self.modules]
        if not inside:
            return None
        moe = layer.moe_config
        experts = plan_experts(
            prefix,
            inside,
            self.modules,
            (
                layer.ckpt_gate_proj_name,
                layer.ckpt_up_proj_name,
                layer.ckpt_down_proj_name,
            ),
            moe.num_logical_experts,
            moe.hidden_dim_unpadded or moe.hidden_dim,
            moe.intermediate_size,
            self.claims,
        )
        return Exl3MoEMethod(moe, prefix, experts)


def _holds_weights(model_name: str) -> bool:
    """A local checkpoint directory with safetensors weights (not a hub id, not a
    config-only directory for load_format="dummy")."""
    return os.path.isdir(model_name) and any(
        name.endswith(SAFETENSORS_SUFFIX) or name == SAFETENSORS_INDEX
        for name in os.listdir(model_name)
    )


def _tied(hf_config: Any) -> bool | None:
    """Whether the model vLLM builds ties its head to the embedding (the model class's
    default included, which config.json may leave out)."""
    if hf_config is None:
        return None
    text = (
        hf_config.get_text_config()
        if hasattr(hf_config, "get_text_config")
        else hf_config
    )
    tied = getattr(text, "tie_word_embeddings", None)
    return tied if isinstance(tied, bool) else None
