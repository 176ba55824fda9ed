# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Checkpoint module names <-> vLLM module prefixes.

ExLlamaV3 writes one tensor set per projection under the source model's names
(`model.layers.3.self_attn.q_proj`); vLLM asks per layer, under its own prefix, often
for a fused layer (`...self_attn.qkv_proj`). A vLLM name resolves to a checkpoint
module in this order:

1. exact: the name itself is a checkpoint module;
2. mapped: the model's `hf_to_vllm_mapper` (stacked entries removed) renames a
   checkpoint module to the name;
3. wrappers dropped: equal once every `model` / `language_model` segment is removed
   from both sides (multimodal wrappers nest the text model differently in vLLM and
   in checkpoints). A stripped name that two checkpoint modules share is ambiguous
   and never used.

`VLLM_EXL3_DEBUG_NAMES=1` logs every resolution, hits and misses.
"""

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import vllm.envs as envs
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.model_executor.models.utils import WeightsMapper

logger = init_logger(__name__)

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
    # The Qwen3-VL vision tower's attention: one `qkv` in HF checkpoints (its
    # packed_modules_mapping maps it to itself), q_proj / k_proj / v_proj in
    # ExLlamaV3's, which quantizes the three separately.
    "qkv": ("q_proj", "k_proj", "v_proj"),
}

# A module key is mapped through the model's tensor-name mapper as this tensor name.
_PROBE_SUFFIX = ".trellis"


def strip_wrappers(name: str) -> str:
    """`name` without its `model` / `language_model` segments."""
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
    else the built-in fallback table; any other layer is its own single shard. A
    layer the mapping packs into itself (already fused on disk) expands through the
    fallback table: the caller asks only after the fused module itself was not found.
    """
    parent, _, last = prefix.rpartition(".")
    members = packed_modules_mapping.get(last)
    if not members or list(members) == [last]:
        members = FUSED_SHARDS_FALLBACK.get(last)
    if not members:
        return [prefix]
    return [f"{parent}.{m}" if parent else m for m in members]
