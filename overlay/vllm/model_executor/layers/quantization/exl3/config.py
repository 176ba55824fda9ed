# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`Exl3Config`: what the checkpoint holds, and which method each vLLM layer gets (the
layer's prefix resolved to its checkpoint module, below).

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
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import vllm.envs as envs
from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)

from .checkpoint import MTP_PREFIX, storage_claims, validate_checkpoint
from .checkpoint_files import SAFETENSORS_INDEX, SAFETENSORS_SUFFIX, Exl3FormatError
from .env_compat import adopt_deprecated_env_names
from .format import EMBED_SIGNS_SUFFIX, Codebook, Exl3ModuleSpec, group_spec
from .layout import Exl3LayoutError
from .unsupported_models import refuse_unsupported_architecture
from .weights import LoadLedger

if TYPE_CHECKING:
    from vllm.model_executor.models.utils import WeightsMapper

logger = init_logger(__name__)

QUANT_CONFIG_FILE = "quantization_config.json"
# tensor_storage spells dtypes as torch does; module_spec takes safetensors' spelling.
TORCH_TO_SAFETENSORS_DTYPE = {
    "torch.int16": "I16",
    "torch.int32": "I32",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.float32": "F32",
}
# Names listed in warnings before "and N more".
LIST_LIMIT = 5

TensorShapes = dict[
    str, tuple[tuple[int, ...], str]
]  # suffix -> (shape, safetensors dtype)


# Checkpoint module names <-> vLLM module prefixes.
#
# ExLlamaV3 writes one tensor set per projection under the source model's names
# (`model.layers.3.self_attn.q_proj`); vLLM asks per layer, under its own prefix, often
# for a fused layer (`...self_attn.qkv_proj`). A vLLM name resolves to a checkpoint
# module in this order:
#
# 1. exact: the name itself is a checkpoint module;
# 2. mapped: the model's `hf_to_vllm_mapper` (stacked entries removed) renames a
#    checkpoint module to the name;
# 3. wrappers dropped: equal once every `model` / `language_model` segment is removed
#    from both sides (multimodal wrappers nest the text model differently in vLLM and
#    in checkpoints). A stripped name that two checkpoint modules share is ambiguous
#    and never used.
#
# `VLLM_EXL3_DEBUG_NAMES=1` logs every resolution, hits and misses.

WRAPPER_SEGMENTS = frozenset({"model", "language_model"})

# Fused vLLM layers and the checkpoint projections they stack, for models whose
# packed_modules_mapping lacks an entry (e.g. Qwen3-MoE lists gate_up_proj only
# sometimes).
FUSED_SHARDS_FALLBACK: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "kv_proj": ("k_proj", "v_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}

# A module key is mapped through the model's tensor-name mapper as this tensor name.
_PROBE_SUFFIX = ".trellis"


def strip_wrappers(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in WRAPPER_SEGMENTS)


class ModuleNameResolver:
    """Resolves vLLM module names against a fixed set of checkpoint module keys."""

    def __init__(self, checkpoint_modules: Iterable[str]):
        self.modules = frozenset(checkpoint_modules)
        self._mapped: dict[str, str] = {}
        self._stripped: dict[str, str | None] = {}
        for key in sorted(self.modules):
            stripped = strip_wrappers(key)
            # None marks a stripped name shared by two checkpoint modules.
            self._stripped[stripped] = None if stripped in self._stripped else key

    def set_mapper(self, mapper: "WeightsMapper") -> None:
        """Index the checkpoint modules under the names the model's mapper gives."""
        self._mapped = {}
        for key in sorted(self.modules):
            mapped = mapper._map_name(key + _PROBE_SUFFIX)
            if mapped is None or not mapped.endswith(_PROBE_SUFFIX):
                continue
            mapped = mapped[: -len(_PROBE_SUFFIX)]
            if mapped != key:
                self._mapped[mapped] = key

    def resolve(self, name: str) -> str | None:
        key, how = self._lookup(name)
        if envs.VLLM_EXL3_DEBUG_NAMES:
            if key is None:
                logger.info(
                    "exl3 names: %r -> no EXL3 checkpoint module (%s)", name, how
                )
            else:
                logger.info("exl3 names: %r -> %r (%s)", name, key, how)
        return key

    def _lookup(self, name: str) -> tuple[str | None, str]:
        if name in self.modules:
            return name, "exact"
        if name in self._mapped:
            return self._mapped[name], "model mapper"
        stripped = strip_wrappers(name)
        if stripped in self._stripped:
            key = self._stripped[stripped]
            if key is None:
                return (
                    None,
                    f"ambiguous: several checkpoint modules strip to {stripped!r}",
                )
            return key, "model/language_model segments dropped"
        return None, "no match"

    def modules_under(self, prefix: str) -> list[str]:
        """Checkpoint modules inside the vLLM module `prefix` (exact or wrappers
        dropped)."""
        stripped = strip_wrappers(prefix) + "."
        exact = prefix + "."
        return sorted(
            k
            for k in self.modules
            if k.startswith(exact) or strip_wrappers(k).startswith(stripped)
        )


def shard_names(
    prefix: str, packed_modules_mapping: Mapping[str, list[str]]
) -> list[str]:
    """The checkpoint-side names of the logical shards of vLLM layer `prefix`, in shard
    order.

    A fused layer (`...qkv_proj`) expands through the model's packed_modules_mapping,
    else the built-in fallback table; any other layer is its own single shard.
    """
    parent, _, last = prefix.rpartition(".")
    members = packed_modules_mapping.get(last) or FUSED_SHARDS_FALLBACK.get(last)
    if not members:
        return [prefix]
    return [f"{parent}.{m}" if parent else m for m in members]


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:LIST_LIMIT])
    return shown + (
        f" and {len(names) - LIST_LIMIT} more" if len(names) > LIST_LIMIT else ""
    )


def _group(
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
) -> dict[str, TensorShapes]:
    groups: dict[str, TensorShapes] = {}
    for name, info in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        groups.setdefault(prefix, {})[suffix] = info
    return groups


def header_tensors(
    metadata: Mapping[str, Any],
) -> dict[str, tuple[tuple[int, ...], str]]:
    """vLLM's safetensors metadata ({name: {"dtype", "shape", ...}}) as name -> (shape,
    dtype)."""
    return {
        name: (tuple(info["shape"]), info["dtype"])
        for name, info in metadata.items()
        if isinstance(info, Mapping) and "dtype" in info
    }


def storage_tensors(
    storage: Mapping[str, Any],
) -> dict[str, tuple[tuple[int, ...], str]]:
    """quantization_config.json's tensor_storage: name -> (shape, safetensors dtype)."""
    out = {}
    for entry in storage.values():
        for name, info in entry.get("stored_tensors", {}).items():
            dtype = TORCH_TO_SAFETENSORS_DTYPE.get(info.get("dtype"), info.get("dtype"))
            out[name] = (tuple(info["shape"]), dtype)
    return out


def find_modules(
    tensors: Mapping[str, tuple[tuple[int, ...], str]],
) -> tuple[dict[str, Exl3ModuleSpec], dict[str, str]]:
    """EXL3 linears (validated, fail closed) and unsupported EXL3 containers, by module
    key."""
    specs: dict[str, Exl3ModuleSpec] = {}
    unsupported: dict[str, str] = {}
    for prefix, members in sorted(_group(tensors).items()):
        if EMBED_SIGNS_SUFFIX in members:
            unsupported[prefix] = (
                f"{prefix} is a quantized token embedding (trellis + signs, "
                f"--embed_bits), which is not supported"
            )
        elif (spec := group_spec(prefix, members)) is not None:
            specs[prefix] = spec
    return specs, unsupported


def describe_checkpoint(
    headers: Mapping[str, tuple[tuple[int, ...], str]],
    storage: Mapping[str, Any] | None,
    source: str,
) -> tuple[dict[str, Exl3ModuleSpec], dict[str, str]]:
    """Reconcile the safetensors headers (authoritative) with tensor_storage."""
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
    specs, unsupported = find_modules(headers)
    if storage is None:
        logger.info(
            "EXL3 checkpoint %s: no %s tensor_storage; %d EXL3 modules found in the "
            "safetensors headers",
            source,
            QUANT_CONFIG_FILE,
            len(specs),
        )
        return specs, unsupported
    claims = storage_claims(storage)
    phantom = sorted(k for k in claims if k not in specs)
    if phantom:
        logger.warning(
            "EXL3 checkpoint %s: %s lists %s as EXL3 but the safetensors hold no "
            "trellis for them; the tensors win (not EXL3)",
            source,
            QUANT_CONFIG_FILE,
            _listing(phantom),
        )
    for key in sorted(set(claims) & set(specs)):
        bits, codebook = claims[key]
        spec = specs[key]
        if (bits, codebook) != (spec.bits, spec.codebook):
            logger.warning(
                "EXL3 %s: %s says %s bits, codebook %s; the tensors say %s bits, "
                "codebook %s; using the tensors",
                key,
                QUANT_CONFIG_FILE,
                bits,
                codebook.name,
                spec.bits,
                spec.codebook.name,
            )
    recovered = sorted(k for k in specs if k not in claims)
    if recovered:
        logger.info(
            "EXL3 checkpoint %s: %d EXL3 modules missing from %s recovered from the "
            "safetensors headers: %s",
            source,
            len(recovered),
            QUANT_CONFIG_FILE,
            _listing(recovered),
        )
    return specs, unsupported


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
        self.unsupported: dict[str, str] = {}
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
        # The lowest of the architectures CMakeLists.txt builds the kernels for
        # (EXL3_ARCHS): their portable path needs mma.sync m16n8k16 and cp.async.
        return 80

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
        from vllm.transformers_utils.config import get_safetensors_params_metadata
        from vllm.transformers_utils.repo_utils import get_hf_file_to_dict

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
            self.set_checkpoint(description.modules, description.unsupported)
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
        self, modules: dict[str, Exl3ModuleSpec], unsupported: dict[str, str]
    ) -> None:
        self.modules = modules
        self.unsupported = unsupported
        self.resolver = ModuleNameResolver([*modules, *unsupported])
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
        key = self.resolver.resolve(name)
        if key in self.unsupported:
            raise NotImplementedError(f"EXL3: {self.unsupported[key]} (layer {name})")
        return key

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
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

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
            specs = self.linear_specs(prefix, len(layer.output_partition_sizes))
            if specs is None:
                from .linear import Exl3PaddedUnquantizedLinearMethod

                # The format keeps unquantized linears 128-padded too; this is vLLM's
                # unquantized method with a loader that trims that padding (linear.py).
                return Exl3PaddedUnquantizedLinearMethod(self.ledger)
            from .dequantized import DENSE_CONSUMED, Exl3DequantizedLinearMethod
            from .linear import Exl3LinearMethod

            if prefix.rpartition(".")[2] in DENSE_CONSUMED:
                return Exl3DequantizedLinearMethod(specs)
            return Exl3LinearMethod(specs, self.ledger)
        if isinstance(layer, ParallelLMHead):
            key = self._resolve(prefix)
            if key is None:
                return None
            from .linear import Exl3LMHeadMethod

            return Exl3LMHeadMethod(prefix, self.modules[key], self.ledger)
        if isinstance(layer, VocabParallelEmbedding):
            self._resolve(prefix)  # raises for a quantized embedding
            return None
        if _is_routed_experts(layer):
            return self._moe_method(layer, prefix)
        return None

    def _moe_method(
        self, layer: torch.nn.Module, prefix: str
    ) -> QuantizeMethodBase | None:
        """Exl3MoEMethod when the layer's experts are EXL3 modules; None (vLLM's
        unquantized experts) when the checkpoint has no EXL3 module under the prefix."""
        assert self.resolver is not None and self.modules is not None
        under = self.resolver.modules_under(prefix)
        for key in under:
            if key in self.unsupported:
                raise NotImplementedError(
                    f"EXL3: {self.unsupported[key]} (layer {prefix})"
                )
        inside = [k for k in under if k in self.modules]
        if not inside:
            return None
        from .moe import Exl3MoEMethod, plan_experts

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


def _is_routed_experts(layer: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return isinstance(layer, RoutedExperts)
