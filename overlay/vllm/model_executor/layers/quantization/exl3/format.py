# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The EXL3 on-disk format: tensor names, dtypes, shapes, bitrate and codebook
detection, and safetensors header reading.

An EXL3 checkpoint has no per-tensor version field: a module is EXL3 because `P.trellis`
exists, its bitrate is the trellis width / 16 and its codebook is the marker tensor
present (`P.mcg`, `P.mul1`, neither = 3INST). Both JSON files are informational.
Everything here validates and fails closed with `Exl3FormatError`, naming the tensor and
the rule it breaks.

Imports only the standard library and torch, so tools outside vLLM can load it on its
own.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from . import checkpoint_files

# The file-level readers and the error type live in checkpoint_files.py (standard
# library only); they are part of this module's API too.
Exl3FormatError = checkpoint_files.Exl3FormatError
TensorEntry = checkpoint_files.TensorEntry
SAFETENSORS_INDEX = checkpoint_files.SAFETENSORS_INDEX
SAFETENSORS_SINGLE = checkpoint_files.SAFETENSORS_SINGLE
read_safetensors_header = checkpoint_files.read_safetensors_header
read_safetensors_index = checkpoint_files.read_safetensors_index

# vLLM's init_logger is logging.getLogger under the vllm namespace; this module must
# not import vLLM (the tools load it standalone), and under vLLM __name__ already sits
# in that namespace.
logger = logging.getLogger(__name__)

# Width of every EXL3 Hadamard block; all quantized dims are padded to a multiple of it.
HADAMARD_SIZE = 128
# Side of one trellis tile (16x16 weights, one mma.m16n8k16 B fragment pair).
TILE = 16


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (the format pads dims to
    HADAMARD_SIZE)."""
    return -(-value // multiple) * multiple


class Codebook(enum.IntEnum):
    """Procedural codebooks; the values are the kernel ids."""

    THREE_INST = 0
    MCG = 1
    MUL1 = 2


# Marker scalars as stored (int32 views of the codebook multipliers 0xCBAC1FED and
# 0x83DCD12D).
MCG_MARKER_VALUE = -877912083
MUL1_MARKER_VALUE = -2082680531

VALID_BITS = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
# Half-integer rates exist only for MUL1 (ExLlamaV3 instantiates no other combination).
HALF_BITS = (1.5, 2.5, 3.5)

# int16 words per bit of rate in one tile: a tile holds 256 codes, 256*K bits = 16*K
# words.
WORDS_PER_BIT = TILE

# The tensors of one EXL3 linear, by suffix (docs/design/exl3_format.md §1.4).
# The data every kernel reads: trellis int16 [k/16, n/16, 16K], suh fp16 [k], svh fp16
# [n].
DATA_SUFFIXES = ("trellis", "suh", "svh")
# Legacy sign bitfields (int16, one bit per row / column) -> the fp16 tensor each stands
# in for; where both are stored the fp16 tensor takes precedence.
LEGACY_SIGNS = {"su": "suh", "sv": "svh"}
# Codebook markers: the marker suffix -> (its codebook, the int32 value it must hold).
# Neither present means 3INST.
MARKERS = {
    "mcg": (Codebook.MCG, MCG_MARKER_VALUE),
    "mul1": (Codebook.MUL1, MUL1_MARKER_VALUE),
}
# Stored by old converters and never applied (ExLlamaV3 1.6.5 ignores them too).
IGNORED = ("scale",)
EXL3_SUFFIXES = (*DATA_SUFFIXES, *LEGACY_SIGNS, *MARKERS, "bias", *IGNORED)
# Suffixes that exist only on EXL3 modules (a `.bias`/`.scale` can belong to anything).
EXL3_ONLY_SUFFIXES = (*DATA_SUFFIXES, *LEGACY_SIGNS, *MARKERS)
# A quantized token embedding (--embed_bits; docs/design/exl3_format.md §8) is its own
# container: `P.trellis` int16 [rows, groups * (1 + 16K)] and `P.signs` fp16
# [groups, 256], nothing else. Its trellis is 2-D (a linear's is 3-D) and its signs
# tensor exists in no other container, so either marks the group as an embedding.
EMBED_SIGNS_SUFFIX = "signs"
EMBED_SUFFIXES = ("trellis", EMBED_SIGNS_SUFFIX)
# Elements per group: one tail-biting ring of 256 codes, rotated by one 256-point
# Hadamard transform; a row is zero-padded to whole groups before quantization.
EMBED_GROUP = 256
# Word 0 of a group's ring holds the bit pattern of its fp16 scale.
EMBED_SCALE_WORDS = 1
# int16 words of ring bitstream per bit of rate: 256 codes of K bits = 16K words.
EMBED_STREAM_WORDS_PER_BIT = EMBED_GROUP // 16
# The converter's --embed_bits: integer rates only (16 stores the table unquantized).
EMBED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)

# A tensor as the headers describe it: (shape, safetensors dtype string).
TensorShape = tuple[tuple[int, ...], str]

# safetensors dtype strings -> torch dtypes (the subset a checkpoint of ours can hold).
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
BIAS_DTYPES = ("F16", "BF16", "F32")  # ExLlamaV3 casts a non-fp16 bias to fp16 at load


def bits_from_trellis_width(width: int, where: str) -> float:
    """Bitrate K from the trellis' last dim (16*K int16 words per tile)."""
    bits = width / WORDS_PER_BIT
    if bits == int(bits):
        bits = int(bits)
    if width <= 0 or bits not in VALID_BITS:
        raise Exl3FormatError(
            f"{where}: trellis width {width} gives {width}/16 = "
            f"{width / WORDS_PER_BIT:g} bits per "
            f"weight; valid rates are {', '.join(str(b) for b in VALID_BITS)} "
            f"(width 16*K)"
        )
    return bits


@dataclass(frozen=True)
class Exl3ModuleSpec:
    """One EXL3 linear as found on disk (shapes only, no data)."""

    prefix: str
    in_features: int  # k, padded to a multiple of 128
    out_features: int  # n, padded to a multiple of 128
    bits: float
    codebook: Codebook
    has_bias: bool
    legacy_signs: bool  # su and/or sv bitfields stand in for suh/svh
    tensor_names: tuple[str, ...]  # every stored tensor of the module, full names

    @property
    def suffixes(self) -> frozenset[str]:
        """The suffixes of the module's stored tensors."""
        return frozenset(name.rpartition(".")[2] for name in self.tensor_names)


@dataclass(frozen=True)
class Exl3EmbeddingSpec:
    """One quantized token embedding as found on disk (shapes only, no data)."""

    prefix: str
    rows: int  # the table's rows: config.json's vocab_size
    groups: int  # ceil(hidden_size / 256)
    bits: int  # K, 1..8; the codebook is always MUL1
    tensor_names: tuple[str, ...]

    @property
    def group_words(self) -> int:
        """int16 words per group: the scale word and 16K stream words."""
        return EMBED_SCALE_WORDS + EMBED_STREAM_WORDS_PER_BIT * self.bits

    @property
    def row_words(self) -> int:
        return self.groups * self.group_words

    def hidden_problem(self, hidden: int) -> str | None:
        """Why the table cannot be the embedding of a model with `hidden` columns, or
        None: its groups must cover hidden exactly once padded to whole groups."""
        want = -(-hidden // EMBED_GROUP)
        if self.groups == want:
            return None
        return (
            f"{self.prefix}.{EMBED_SIGNS_SUFFIX}: {self.groups} groups of "
            f"{EMBED_GROUP}, but hidden_size {hidden} is stored as ceil({hidden} / "
            f"{EMBED_GROUP}) = {want} groups (quantized token embedding)"
        )


@dataclass
class Exl3Weights:
    trellis: torch.Tensor  # int16 [k/16, n/16, 16K]
    suh: torch.Tensor  # fp16 [k]
    svh: torch.Tensor  # fp16 [n]
    bias: torch.Tensor | None  # fp16 [n]
    codebook: Codebook
    bits: float


def _expect(
    prefix: str,
    suffix: str,
    tensors: Mapping[str, TensorShape],
    dtypes: tuple[str, ...],
    shape: tuple[int, ...],
) -> None:
    got_shape, got_dtype = tensors[suffix]
    name = f"{prefix}.{suffix}"
    if got_dtype not in dtypes:
        raise Exl3FormatError(
            f"{name}: dtype {got_dtype}, expected {' or '.join(dtypes)} (wrong dtype)"
        )
    if tuple(got_shape) != shape:
        raise Exl3FormatError(
            f"{name}: shape {list(got_shape)}, expected {list(shape)} (wrong shape)"
        )


def module_spec(prefix: str, tensors: Mapping[str, TensorShape]) -> Exl3ModuleSpec:
    """Validate the tensors of one EXL3 linear. `tensors` maps suffix -> (shape, dtype
    string)."""
    for suffix in tensors:
        if suffix == EMBED_SIGNS_SUFFIX:
            raise Exl3FormatError(
                f"{prefix}.{suffix}: a quantized token embedding's tensor (trellis + "
                "signs, --embed_bits) in an EXL3 linear (unexpected tensor; "
                "embedding_spec reads that container)"
            )
        if suffix not in EXL3_SUFFIXES:
            raise Exl3FormatError(
                f"{prefix}.{suffix}: unexpected tensor in an EXL3 module (allowed "
                "suffixes: "
                f"{', '.join(EXL3_SUFFIXES)})"
            )
    if "trellis" not in tensors:
        raise Exl3FormatError(
            f"{prefix}.trellis: missing tensor (required for an EXL3 module)"
        )
    t_shape, t_dtype = tensors["trellis"]
    t_name = f"{prefix}.trellis"
    if t_dtype != "I16":
        raise Exl3FormatError(f"{t_name}: dtype {t_dtype}, expected I16 (wrong dtype)")
    if len(t_shape) != 3:
        raise Exl3FormatError(
            f"{t_name}: shape {list(t_shape)}, expected 3 dims [k/16, n/16, 16*bits] "
            "(wrong shape)"
        )
    k, n = t_shape[0] * TILE, t_shape[1] * TILE
    if k <= 0 or n <= 0:
        raise Exl3FormatError(
            f"{t_name}: shape {list(t_shape)} has an empty dim (wrong shape)"
        )
    for dim_name, dim in (("in_features k", k), ("out_features n", n)):
        if dim % HADAMARD_SIZE:
            raise Exl3FormatError(
                f"{t_name}: {dim_name} = {dim} is not a multiple of {HADAMARD_SIZE} "
                f"(dims must be padded to the Hadamard block)"
            )
    bits = bits_from_trellis_width(t_shape[2], t_name)

    markers = [m for m in MARKERS if m in tensors]
    if len(markers) > 1:
        raise Exl3FormatError(
            f"{prefix}.mcg / {prefix}.mul1: both codebook markers present (at most one "
            "allowed)"
        )
    codebook = Codebook.THREE_INST
    for marker in markers:
        _expect(prefix, marker, tensors, ("I32",), ())
        codebook = MARKERS[marker][0]
    if bits in HALF_BITS and codebook != Codebook.MUL1:
        raise Exl3FormatError(
            f"{t_name}: half-integer rate {bits} needs the mul1 codebook, found "
            f"{codebook.name} (half rates are MUL1 only)"
        )

    legacy = False
    for packed, full in LEGACY_SIGNS.items():
        side, dim = ("input", k) if full == "suh" else ("output", n)
        if full in tensors:
            _expect(prefix, full, tensors, ("F16",), (dim,))
            if packed in tensors:
                _expect(prefix, packed, tensors, ("I16",), (dim // TILE,))
                logger.warning(
                    "%s.%s is ignored: %s.%s is present and takes precedence",
                    prefix,
                    packed,
                    prefix,
                    full,
                )
        elif packed in tensors:
            _expect(prefix, packed, tensors, ("I16",), (dim // TILE,))
            legacy = True
        else:
            raise Exl3FormatError(
                f"{prefix}.{full}: missing tensor ({side} scales: {full} or the legacy "
                f"{packed} "
                f"bitfield is required)"
            )
    if "bias" in tensors:
        _expect(prefix, "bias", tensors, BIAS_DTYPES, (n,))
    if "scale" in tensors:
        logger.warning(
            "%s.scale is present but not applied: ExLlamaV3 1.6.5 ignores legacy scale "
            "tensors (docs/design/exl3_format.md, Open points)",
            prefix,
        )
    return Exl3ModuleSpec(
        prefix=prefix,
        in_features=k,
        out_features=n,
        bits=bits,
        codebook=codebook,
        has_bias="bias" in tensors,
        legacy_signs=legacy,
        tensor_names=tuple(f"{prefix}.{s}" for s in EXL3_SUFFIXES if s in tensors),
    )


def is_embedding_group(members: Mapping[str, tuple[tuple[int, ...], str]]) -> bool:
    """Whether a tensor group is a quantized token embedding's container (§8), not a
    linear: it has `signs`, or a 2-D trellis."""
    trellis = members.get("trellis")
    return EMBED_SIGNS_SUFFIX in members or (
        trellis is not None and len(trellis[0]) == 2
    )


def embedding_geometry(
    prefix: str, trellis_shape: tuple[int, ...], signs_shape: tuple[int, ...]
) -> tuple[int, int, int]:
    """(rows, groups, bits) of a quantized token embedding from its two shapes, failing
    closed with the tensor and the rule (shared by the headers' check, the loader and
    the reference decode)."""
    t_name, s_name = f"{prefix}.trellis", f"{prefix}.{EMBED_SIGNS_SUFFIX}"
    if len(signs_shape) != 2 or signs_shape[1] != EMBED_GROUP or signs_shape[0] <= 0:
        raise Exl3FormatError(
            f"{s_name}: shape {list(signs_shape)}, expected [groups, {EMBED_GROUP}] "
            "with groups >= 1 (wrong shape; quantized token embedding)"
        )
    groups = signs_shape[0]
    if len(trellis_shape) != 2 or trellis_shape[0] <= 0:
        raise Exl3FormatError(
            f"{t_name}: shape {list(trellis_shape)}, expected 2 dims [rows, groups * "
            "(1 + 16 * bits)] with rows >= 1 (wrong shape; quantized token embedding)"
        )
    rows, width = trellis_shape
    per_group, rest = divmod(width, groups)
    stream, odd = divmod(per_group - EMBED_SCALE_WORDS, EMBED_STREAM_WORDS_PER_BIT)
    bits = stream if not rest and not odd else None
    if bits not in EMBED_BITS:
        raise Exl3FormatError(
            f"{t_name}: width {width} is not {groups} groups (from {s_name}) x (1 + 16 "
            f"* bits) words for bits in 1..8 (wrong shape; quantized token embedding)"
        )
    return rows, groups, bits


def embedding_spec(
    prefix: str, tensors: Mapping[str, tuple[tuple[int, ...], str]]
) -> Exl3EmbeddingSpec:
    """Validate the tensors of one quantized token embedding (§8). `tensors` maps
    suffix -> (shape, dtype string)."""
    for suffix in tensors:
        if suffix not in EMBED_SUFFIXES:
            raise Exl3FormatError(
                f"{prefix}.{suffix}: unexpected tensor in a quantized token embedding "
                f"(allowed suffixes: {', '.join(EMBED_SUFFIXES)})"
            )
    for suffix in EMBED_SUFFIXES:
        if suffix not in tensors:
            raise Exl3FormatError(
                f"{prefix}.{suffix}: missing tensor (a quantized token embedding needs "
                f"{' and '.join(EMBED_SUFFIXES)})"
            )
    for suffix, dtype in (("trellis", "I16"), (EMBED_SIGNS_SUFFIX, "F16")):
        got = tensors[suffix][1]
        if got != dtype:
            raise Exl3FormatError(
                f"{prefix}.{suffix}: dtype {got}, expected {dtype} (wrong dtype; "
                "quantized token embedding)"
            )
    rows, groups, bits = embedding_geometry(
        prefix, tuple(tensors["trellis"][0]), tuple(tensors[EMBED_SIGNS_SUFFIX][0])
    )
    return Exl3EmbeddingSpec(
        prefix=prefix,
        rows=rows,
        groups=groups,
        bits=bits,
        tensor_names=tuple(f"{prefix}.{s}" for s in EMBED_SUFFIXES),
    )


def check_embedding_signs(name: str, signs: torch.Tensor) -> None:
    """A quantized embedding's signs hold only +1 and -1 (§8)."""
    bad = (signs != 1) & (signs != -1)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise Exl3FormatError(
            f"{name}: value {float(signs[tuple(at)])} at {at}; every sign must be +1 "
            "or -1 (quantized token embedding)"
        )


def split_name(name: str) -> tuple[str, str]:
    prefix, _, suffix = name.rpartition(".")
    return prefix, suffix


def tensor_shapes(index: Mapping[str, TensorEntry]) -> dict[str, TensorShape]:
    """A safetensors index as name -> (shape, dtype)."""
    return {name: (entry.shape, entry.dtype) for name, entry in index.items()}


def group_shapes(
    tensors: Mapping[str, TensorShape],
) -> dict[str, dict[str, TensorShape]]:
    """Tensors grouped by module prefix: {prefix: {suffix: (shape, dtype)}}, prefixes
    sorted."""
    groups: dict[str, dict[str, TensorShape]] = {}
    for name, info in tensors.items():
        prefix, suffix = split_name(name)
        groups.setdefault(prefix, {})[suffix] = info
    return {p: groups[p] for p in sorted(groups)}


def group_tensors(
    index: Mapping[str, TensorEntry],
) -> dict[str, dict[str, TensorShape]]:
    """A safetensors index grouped by module prefix (group_shapes)."""
    return group_shapes(tensor_shapes(index))


def group_spec(
    prefix: str, members: Mapping[str, TensorShape]
) -> Exl3ModuleSpec | None:
    """The spec of one tensor group if it is an EXL3 module, None if it is not one at
    all."""
    if "trellis" in members:
        return module_spec(prefix, members)
    orphans = sorted(s for s in members if s in EXL3_ONLY_SUFFIXES)
    if orphans:
        raise Exl3FormatError(
            f"{prefix}.trellis: missing tensor ({prefix}.{orphans[0]} is an EXL3 "
            "tensor "
            f"but the module has no trellis)"
        )
    return None


def find_exl3_modules(index: Mapping[str, TensorEntry]) -> dict[str, Exl3ModuleSpec]:
    """Every EXL3 linear of a checkpoint, keyed by module prefix, validated."""
    specs: dict[str, Exl3ModuleSpec] = {}
    for prefix, members in group_tensors(index).items():
        spec = group_spec(prefix, members)
        if spec is not None:
            specs[prefix] = spec
    return specs


def read_tensor(
    ckpt_dir: str | os.PathLike,
    name: str,
    entry: TensorEntry,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Read one tensor's bytes from its shard (little-endian, as safetensors stores
    them)."""
    dtype = SAFETENSORS_DTYPES.get(entry.dtype)
    if dtype is None:
        raise Exl3FormatError(f"{name}: unsupported safetensors dtype {entry.dtype}")
    start, end = entry.offsets
    numel = 1
    for d in entry.shape:
        numel *= d
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if end - start != nbytes:
        raise Exl3FormatError(
            f"{name}: {end - start} bytes stored for shape {list(entry.shape)} "
            f"{entry.dtype} "
            f"(expected {nbytes}; corrupt header)"
        )
    with open(os.path.join(os.fspath(ckpt_dir), entry.file), "rb") as f:
        f.seek(start)
        buf = bytearray(f.read(nbytes))
    if len(buf) != nbytes:
        raise Exl3FormatError(f"{name}: truncated data in {entry.file}")
    if nbytes == 0:
        t = torch.empty(entry.shape, dtype=dtype)
    else:
        t = torch.frombuffer(buf, dtype=dtype).reshape(entry.shape)
    return t.to(device)


def unpack_sign_bits(words: torch.Tensor) -> torch.Tensor:
    """Legacy sign bitfield: element 16w+b is -1 if bit b of word w is set, else +1
    (fp16)."""
    if words.dtype != torch.int16:
        raise Exl3FormatError(f"sign bitfield has dtype {words.dtype}, expected int16")
    bits = torch.arange(TILE, device=words.device, dtype=torch.int32)
    set_ = (words.to(torch.int32).unsqueeze(-1) >> bits) & 1
    signs = 1 - 2 * set_
    return signs.reshape(*words.shape[:-1], words.shape[-1] * TILE).to(torch.float16)


def check_marker(name: str, value: int) -> None:
    """A codebook marker scalar must hold its codebook's multiplier (as int32)."""
    expected = MARKERS[split_name(name)[1]][1]
    if value != expected:
        raise Exl3FormatError(
            f"{name}: marker value {value}, expected {expected} (wrong codebook marker "
            "value)"
        )


def load_module(
    ckpt_dir: str | os.PathLike,
    spec: Exl3ModuleSpec,
    device: str | torch.device = "cpu",
    index: Mapping[str, TensorEntry] | None = None,
) -> Exl3Weights:
    """Load one validated module; checks marker values and expands legacy sign
    bitfields."""
    if index is None:
        index = read_safetensors_index(ckpt_dir)

    def get(suffix: str) -> torch.Tensor | None:
        name = f"{spec.prefix}.{suffix}"
        if name not in spec.tensor_names:
            return None
        if name not in index:
            raise Exl3FormatError(
                f"{name}: missing tensor (in the module spec, not on disk)"
            )
        return read_tensor(ckpt_dir, name, index[name], device)

    for marker in MARKERS:
        value = get(marker)
        if value is not None:
            check_marker(f"{spec.prefix}.{marker}", int(value.item()))
    suh = get("suh")
    if suh is None:
        suh = unpack_sign_bits(get("su"))
    svh = get("svh")
    if svh is None:
        svh = unpack_sign_bits(get("sv"))
    bias = get("bias")
    if bias is not None:
        bias = bias.to(torch.float16)
    trellis = get("trellis")
    if trellis is None:
        raise Exl3FormatError(f"{spec.prefix}.trellis: missing tensor")
    return Exl3Weights(
        trellis=trellis,
        suh=suh,
        svh=svh,
        bias=bias,
        codebook=spec.codebook,
        bits=spec.bits,
    )
