# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The parameters of one EXL3 layer and how checkpoint tensors are loaded into them.

One parameter per checkpoint tensor suffix of the layer's modules, named as on disk, so
both of vLLM's loader styles (`AutoWeightsLoader` + `WeightsMapper` shard ids, and
hand-written `stacked_params_mapping` loaders) route `...q_proj.trellis` to
`qkv_proj.trellis` with shard "q". A checkpoint module covering several consecutive
shards (layout.py) arrives once, with the tuple of their ids (Qwen3.5's
`in_proj_qkv` -> `in_proj_qkvz` shards (0, 1, 2)), and is placed into each:

* `trellis`, `suh`, `svh`: the data (see layout.py);
* `out_index` int64 (a non-persistent buffer, only when some shard keeps part of what it
  computes): for each column vLLM receives, its column in the computed output;
* `mcg` / `mul1` int32 `[S]`: one codebook-marker slot per shard, value-checked after
  loading, then dropped;
* `su` / `sv` (legacy sign bitfields), `scale` (never applied by the format): empty
  placeholders whose loads are consumed (`su`/`sv` unpacked into `suh`/`svh` rows), then
  dropped.

`Exl3Parameter` overrides vLLM's four v2 load entry points and places each tensor by the
layer's `Exl3Layout`, never by vLLM's offset arithmetic (which knows neither the
128-padding nor mixed bitrates). After loading, `finish` checks that every tensor the
checkpoint has for these modules arrived (LoadLedger below: every tensor exactly once)
and leaves exactly trellis + suh + svh as plain parameters. The values of `suh`/`svh`
are checked as they arrive (checkpoint.py).
"""

from collections.abc import Callable, Iterable

import torch
from vllm.logger import init_logger
from vllm.model_executor.parameter import BasevLLMParameter

from .checkpoint import check_scale_values
from .format import (
    DATA_SUFFIXES,
    IGNORED,
    LEGACY_SIGNS,
    MARKERS,
    TILE,
    Exl3FormatError,
    Exl3ModuleSpec,
    unpack_sign_bits,
)
from .layout import Exl3Layout, Exl3LayoutError, ShardLayout, trellis_words

logger = init_logger(__name__)

OUT_INDEX = "out_index"  # layer buffer: returned column -> computed column (Exl3Layout)
# The layer's own bias parameter loads `.bias`; it is not an EXL3 parameter.
LAYER_OWNED = ("bias",)
QKV_SHARD_IDS = {"q": 0, "k": 1, "v": 2}


# Every parameter an EXL3 checkpoint owns is written exactly once, or loading fails.
#
# vLLM checks for unloaded parameters only when a model is not quantized, so a layer the
# checkpoint does not cover would keep whatever its allocation held. One ledger per
# model (per `Exl3Config`, so per rank) records each checkpoint tensor a layer receives:
# a second write of the same tensor to the same layer fails at once, and after loading
# every EXL3-owned or padding-owned layer checks that it received all it expects.
#
# A model that received no checkpoint tensor at all was not loaded from a checkpoint
# (`load_format="dummy"` fills parameters with random values without loaders); its
# layers are not held to the rule.


class LoadLedger:
    """The tensors each layer of one model received. A layer is keyed by its owner
    object (its weights or its module): two layers built under one name stay apart."""

    def __init__(self) -> None:
        self._written: dict[int, set[str]] = {}
        self._owners: dict[int, object] = {}  # keeps each id() valid until checked
        self.started = False  # any checkpoint tensor reached any layer of this model

    def record(self, owner: object, layer: str, tensor: str) -> None:
        written = self._written.setdefault(id(owner), set())
        self._owners[id(owner)] = owner
        if tensor in written:
            raise Exl3LayoutError(
                f"EXL3 {layer}: {tensor} written twice (the checkpoint holds it twice, "
                "or two checkpoint names map to it)"
            )
        written.add(tensor)
        self.started = True

    def written(self, owner: object, tensor: str) -> bool:
        return tensor in self._written.get(id(owner), ())

    def check(
        self,
        owner: object,
        layer: str,
        expected: Iterable[str],
        rank: int | None = None,
    ) -> None:
        """After loading: every expected tensor of the layer was written (unless nothing
        in the model was); the layer's record is dropped."""
        written = self._written.pop(id(owner), set())
        self._owners.pop(id(owner), None)
        if not self.started:
            return
        missing = [t for t in expected if t not in written]
        if missing:
            where = f" (rank {rank})" if rank is not None else ""
            raise Exl3LayoutError(
                f"EXL3 {layer}{where}: checkpoint tensors never loaded: "
                f"{', '.join(missing)} (nothing in the checkpoint reached them; the "
                "layer would run on uninitialised memory)"
            )


ShardIds = int | str | tuple[int, ...] | None


def shard_indices(shard_id: ShardIds) -> tuple[int, ...]:
    """The layer shards a loader's shard id names (None: the layer's only shard)."""
    if shard_id is None:
        return (0,)
    if isinstance(shard_id, str):
        return (QKV_SHARD_IDS[shard_id],)
    if isinstance(shard_id, int):
        return (shard_id,)
    return tuple(shard_id)


class Exl3Parameter(BasevLLMParameter):
    """A parameter whose loads are placed by the layer's `Exl3LayerWeights`."""

    def __init__(
        self,
        data: torch.Tensor,
        weight_loader: Callable,
        suffix: str,
        owner: "Exl3LayerWeights",
    ):
        super().__init__(data=data, weight_loader=weight_loader)
        self.exl3_suffix = suffix
        self.exl3_owner = owner

    @property
    def output_dim(self) -> int:
        # vLLM reads output_dim only to split a fused-on-disk tensor by its own offsets.
        raise AttributeError(
            f"EXL3 {self.exl3_owner.layout.prefix}.{self.exl3_suffix}: a fused-on-disk "
            "checkpoint tensor (no shard id) cannot be split into EXL3 shards: this "
            "layer's shards come from several checkpoint modules, each loaded with "
            "its shard id"
        )

    def load_column_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        self.exl3_owner.load(self.exl3_suffix, loaded_weight, (0,))

    def load_row_parallel_weight(self, loaded_weight: torch.Tensor) -> None:
        self.exl3_owner.load(self.exl3_suffix, loaded_weight, (0,))

    def load_merged_column_weight(self, loaded_weight: torch.Tensor, **kwargs) -> None:
        self.exl3_owner.load(
            self.exl3_suffix, loaded_weight, shard_indices(kwargs.get("shard_id"))
        )

    def load_qkv_weight(self, loaded_weight: torch.Tensor, **kwargs) -> None:
        self.exl3_owner.load(
            self.exl3_suffix, loaded_weight, shard_indices(kwargs.get("shard_id"))
        )


def direct_weight_loader(
    param: Exl3Parameter, loaded_weight: torch.Tensor, shard_id: ShardIds = None
) -> None:
    """For layers whose own loader knows no v2 parameters (ReplicatedLinear,
    ParallelLMHead), and for a checkpoint module covering several shards (vLLM's
    loader would split it by its own offsets)."""
    param.exl3_owner.load(param.exl3_suffix, loaded_weight, shard_indices(shard_id))


class Exl3LayerWeights:
    """Creates, loads and finalises the EXL3 parameters of one layer on one rank."""

    def __init__(
        self,
        layout: Exl3Layout,
        specs: list[Exl3ModuleSpec],
        ledger: LoadLedger | None = None,
        real: list[tuple[int | None, int | None]] | None = None,
    ):
        """`specs`: the checkpoint modules in shard order; `ledger`: the model's (a
        private one when None); `real`: per module, the real (unpadded) input and output
        features, for the value rule of suh/svh."""
        self.layout = layout
        self.expected = [set(spec.suffixes) - set(LAYER_OWNED) for spec in specs]
        self.loaded: set[tuple[str, int]] = set()
        self.ledger = ledger if ledger is not None else LoadLedger()
        self.real = real if real is not None else [(None, None)] * len(specs)
        self._params: dict[str, Exl3Parameter] = {}

    def create(self, layer: torch.nn.Module, weight_loader: Callable) -> None:
        layout, num_shards = self.layout, len(self.layout.shards)
        shapes = {
            "trellis": (layout.trellis_shape, torch.int16),
            "suh": ((num_shards, layout.k_alloc), torch.float16),
            "svh": ((layout.n_alloc,), torch.float16),
        }
        for marker in MARKERS:
            if any(marker in e for e in self.expected):
                shapes[marker] = ((num_shards,), torch.int32)
        for suffix in (*LEGACY_SIGNS, *IGNORED):
            if any(suffix in e for e in self.expected):
                shapes[suffix] = ((0,), torch.int16)
        unknown = set().union(*self.expected) - set(shapes)
        if unknown:
            raise Exl3FormatError(
                f"EXL3 {layout.prefix}: checkpoint tensors with suffixes "
                f"{sorted(unknown)} have "
                f"no place in an EXL3 linear"
            )
        for suffix, (shape, dtype) in shapes.items():
            # Zeros, not empty: what the checkpoint does not cover must contribute
            # nothing.
            param = Exl3Parameter(
                data=torch.zeros(shape, dtype=dtype),
                weight_loader=weight_loader,
                suffix=suffix,
                owner=self,
            )
            layer.register_parameter(suffix, param)
            self._params[suffix] = param
        kept = layout.kept_columns()
        if kept is not None:
            # Created here, like the parameters, on the device the layer is built on.
            layer.register_buffer(
                OUT_INDEX, torch.tensor(kept, dtype=torch.int64), persistent=False
            )

    # ---- loading
    # -------------------------------------------------------------------------

    def _fail(self, shard: ShardLayout, suffix: str, rule: str) -> Exl3LayoutError:
        return Exl3LayoutError(
            f"EXL3 {shard.name}.{suffix} -> {self.layout.prefix} (rank "
            f"{self.layout.tp_rank}): "
            f"{rule}"
        )

    def load(self, suffix: str, loaded: torch.Tensor, ids: tuple[int, ...]) -> None:
        """One checkpoint tensor of the module covering exactly the shards `ids`."""
        layout = self.layout
        if not ids or not all(0 <= i < len(layout.shards) for i in ids):
            raise Exl3LayoutError(
                f"EXL3 {layout.prefix}.{suffix}: shard {ids} does not exist "
                f"(the layer has {len(layout.shards)})"
            )
        module = layout.shards[ids[0]].module
        covered = layout.module_shards(module)
        shard = layout.shards[ids[0]]
        if ids != covered:
            # The tensor's own name is not known here, only the shards it was sent to.
            raise Exl3LayoutError(
                f"EXL3 {layout.prefix}.{suffix} (rank {layout.tp_rank}): a tensor "
                f"loaded as shard(s) {list(ids)}, but shard {ids[0]} is part of "
                f"checkpoint module {shard.name}, which covers shard(s) "
                f"{list(covered)} (from its stored width against the layer's shard "
                "widths); the model's loader and the checkpoint disagree"
            )
        if suffix not in self.expected[module]:
            raise self._fail(
                shard,
                suffix,
                "tensor not listed in the checkpoint's safetensors "
                "headers for this module",
            )
        self.ledger.record(self, layout.prefix, f"{shard.name}.{suffix}")
        self.loaded.add((suffix, module))
        if suffix == "trellis":
            self._load_trellis(shard, covered, loaded)
        elif suffix in ("suh", "svh"):
            self._load_scales(shard, module, covered, suffix, loaded)
        elif suffix in LEGACY_SIGNS:
            full = LEGACY_SIGNS[suffix]
            if full in self.expected[module]:
                logger.debug("%s.%s ignored: %s is present", shard.name, suffix, full)
                return
            self._check(
                shard, suffix, loaded, torch.int16, self._scale_len(shard, full) // TILE
            )
            self._load_scales(
                shard, module, covered, full, unpack_sign_bits(loaded), checked=True
            )
        elif suffix in MARKERS:
            if loaded.numel() != 1 or loaded.dtype != torch.int32:
                raise self._fail(
                    shard,
                    suffix,
                    f"marker must be one int32, got shape "
                    f"{list(loaded.shape)} {loaded.dtype}",
                )
            for i in covered:
                self._params[suffix].data[i] = loaded.reshape(())
        elif suffix in IGNORED:
            logger.debug("%s.%s consumed and not applied", shard.name, suffix)

    def _check(
        self,
        shard: ShardLayout,
        suffix: str,
        loaded: torch.Tensor,
        dtype: torch.dtype,
        *shape: int,
    ) -> None:
        if loaded.dtype != dtype or tuple(loaded.shape) != shape:
            raise self._fail(
                shard,
                suffix,
                f"got {list(loaded.shape)} {loaded.dtype}, the "
                f"headers describe {list(shape)} {dtype}",
            )

    def _scale_len(self, shard: ShardLayout, full: str) -> int:
        return shard.ckpt_rows if full == "suh" else shard.ckpt_cols

    def _load_trellis(
        self, module: ShardLayout, covered: tuple[int, ...], loaded: torch.Tensor
    ) -> None:
        layout = self.layout
        words = trellis_words(module.bits)
        self._check(
            module,
            "trellis",
            loaded,
            torch.int16,
            module.ckpt_rows // TILE,
            module.ckpt_cols // TILE,
            words,
        )
        for index in covered:
            shard = layout.shards[index]
            run = layout.run_of(index)
            block = layout.run_trellis(self._params["trellis"].data, run)
            dst = block.narrow(1, (shard.col - run.col) // TILE, shard.alloc // TILE)
            rows, cols = layout.copy_rows(shard) // TILE, shard.copy_cols // TILE
            dst.zero_()
            if rows and cols:
                src = loaded.narrow(0, layout.src_row // TILE, rows)
                dst[:rows, :cols].copy_(src.narrow(1, shard.src_col // TILE, cols))

    def _load_scales(
        self,
        module: ShardLayout,
        index: int,
        covered: tuple[int, ...],
        suffix: str,
        loaded: torch.Tensor,
        checked: bool = False,
    ) -> None:
        """`module`: the first shard of checkpoint module `index`, which covers the
        layer's shards `covered`."""
        layout = self.layout
        if not checked:
            self._check(
                module, suffix, loaded, torch.float16, self._scale_len(module, suffix)
            )
            real = self.real[index][0 if suffix == "suh" else 1]
            note = check_scale_values(f"{module.name}.{suffix}", loaded, real)
            if note:
                logger.warning("EXL3 %s", note)
        param = self._params[suffix].data
        for i in covered:
            shard = layout.shards[i]
            if suffix == "suh":
                dst = param[i]
                rows = layout.copy_rows(shard)
                dst.zero_()
                if rows:
                    dst[:rows].copy_(loaded.narrow(0, layout.src_row, rows))
                continue
            dst = param.narrow(0, shard.col, shard.alloc)
            cols = shard.copy_cols
            dst.zero_()
            if cols:
                dst[:cols].copy_(loaded.narrow(0, shard.src_col, cols))
            # Columns past the real outputs (lm_head vocab padding) are forced to
            # exactly zero.
            real = max(0, shard.real_cols - shard.src_col)
            if real < cols:
                dst[real:cols].zero_()

    # ---- after loading
    # -------------------------------------------------------------------

    def finish(self, layer: torch.nn.Module) -> None:
        """Check completeness and markers, then keep exactly trellis + suh + svh."""
        layout = self.layout
        self.ledger.check(
            self,
            layout.prefix,
            [
                f"{layout.shards[covered[0]].name}.{suffix}"
                for m, expected in enumerate(self.expected)
                if (covered := layout.module_shards(m))
                for suffix in sorted(expected)
            ],
            rank=layout.tp_rank,
        )
        if not self.loaded:
            # Nothing came from a checkpoint: load_format="dummy" (random-weight perf
            # runs).
            logger.debug(
                "EXL3 %s: no checkpoint tensors loaded (dummy weights)", layout.prefix
            )
        else:
            for marker, (codebook, value) in MARKERS.items():
                for i, shard in enumerate(layout.shards):
                    if marker not in self.expected[shard.module]:
                        continue
                    got = int(self._params[marker].data[i])
                    if got != value or shard.codebook != codebook:
                        raise Exl3LayoutError(
                            f"EXL3 {shard.name}.{marker} (rank {layout.tp_rank}): "
                            "marker value "
                            f"{got}, expected {value} for the {codebook.name} codebook"
                        )
        for name in list(self._params):
            if name not in DATA_SUFFIXES:
                delattr(layer, name)
        for name in DATA_SUFFIXES:
            data = self._params[name].data
            setattr(layer, name, torch.nn.Parameter(data, requires_grad=False))
        self._params = {}
