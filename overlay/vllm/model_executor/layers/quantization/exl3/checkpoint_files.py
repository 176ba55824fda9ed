# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The files of a checkpoint directory, read fail-closed before any tensor data.

Downloads and copies damage checkpoints in a few recurring ways: a Git LFS pointer or an
HTML error page saved under the weight file's name, a zero-byte or truncated file, a
header whose length or offsets are absurd, a hand-edited JSON file, a shard missing from
the index or left over beside it. Each is named here, with the file and the rule, before
anything trusts a length read from disk (a header length read blindly ends in a
`MemoryError`, an offset read blindly in a silent short read).

The rules are those of the safetensors format itself (what its reference reader
enforces): an 8-byte little-endian header length, a JSON object header, `__metadata__`
mapping strings to strings, and tensors whose `data_offsets` tile the data section
exactly, each as long as its dtype and shape require.

Imports only the standard library, so the checkpoint tools load it on their own.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
from typing import Any, NamedTuple

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_SUFFIX = ".safetensors"
# The 8-byte little-endian header length every safetensors file starts with.
HEADER_LENGTH_BYTES = 8
# A safetensors header longer than this is corrupt, not large (the format caps it
# at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
# Bytes looked at to recognise what a non-safetensors file is.
SNIFF_BYTES = 512
# First line of every Git LFS pointer file (the git-lfs specification).
LFS_POINTER_PREFIX = b"version https://git-lfs"
# How an HTML page saved in place of a download begins (lower-cased, after blanks).
HTML_PREFIXES = (b"<!doctype html", b"<html", b"<head", b"<body", b"<?xml")
# Links followed when showing where a symbolic link loop goes (the kernel's own limit
# on a chain of links is 40).
MAX_LINK_CHAIN = 40
# A Hugging Face cache stores every file once under blobs/ and links snapshots to it.
HF_CACHE_BLOBS = "blobs"
# Sharded checkpoints name their files like this (transformers and ExLlamaV3 both do).
SHARD_NAME = re.compile(
    r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.safetensors$"
)
# Bytes per element of every safetensors dtype (the format's own list).
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


class Exl3FormatError(ValueError):
    """A checkpoint breaks a format rule; the message names the file or tensor and the
    rule."""


class TensorEntry(NamedTuple):
    file: str  # shard file name, relative to the checkpoint directory
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    offsets: tuple[int, int] = (0, 0)  # absolute byte range in the file


def broken_link(path: str | os.PathLike) -> str | None:
    """Why `path` is a symbolic link that reaches no file (a dangling link or a loop),
    said with its target and what to do; None for anything else.

    A Hugging Face cache keeps each file once under `blobs/` and links
    `snapshots/<revision>/<name>` to it, so an interrupted download or a pruned cache
    leaves the name in place and its data gone; `os.path.isfile` then says False and
    the file would look absent.
    """
    path = os.fspath(path)
    if not os.path.islink(path):
        return None
    try:
        os.stat(path)
        return None
    except OSError as e:
        failure = e
    target = os.readlink(path)
    if failure.errno == errno.ELOOP:
        chain, current = [os.path.basename(path)], path
        while os.path.islink(current) and len(chain) <= MAX_LINK_CHAIN:
            step = os.readlink(current)
            chain.append(step)
            current = os.path.join(os.path.dirname(current), step)
            if chain.count(step) > 1:
                break
        return (
            f"{path}: a symbolic link loop ({' -> '.join(chain)} ...), never reaching "
            "a file: replace the link with the file itself, or download it again"
        )
    if failure.errno not in (errno.ENOENT, errno.ENOTDIR):
        return (
            f"{path}: a symbolic link to {target} that cannot be followed "
            f"({failure.strerror})"
        )
    resolved = os.path.realpath(path)
    if HF_CACHE_BLOBS in resolved.split(os.sep):
        remedy = (
            "the Hugging Face cache lost the file (an interrupted download or a pruned "
            "cache): download the model again (`hf download <repo id>` fetches only "
            "what is missing) or delete this snapshot from the cache"
        )
    else:
        remedy = "copy the file there, or point the link at the file"
    return (
        f"{path}: a broken symbolic link to {target} ({resolved} does not exist): "
        f"{remedy}"
    )


def read_json_file(path: str | os.PathLike) -> Any:
    """A JSON document; a syntax error names the file, the line and the column."""
    path = os.fspath(path)
    if reason := broken_link(path):
        raise Exl3FormatError(reason)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise Exl3FormatError(f"{path}: cannot read ({e.strerror or e})") from e
    what = _not_json(raw)
    if what:
        raise Exl3FormatError(f"{path}: {what}")
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise Exl3FormatError(
            f"{path}: not UTF-8 text at byte {e.start} (invalid JSON file)"
        ) from e
    except json.JSONDecodeError as e:
        raise Exl3FormatError(
            f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from e


def read_json_object(path: str | os.PathLike) -> dict:
    document = read_json_file(path)
    if not isinstance(document, dict):
        raise Exl3FormatError(
            f"{os.fspath(path)}: the JSON document is a {type(document).__name__}, "
            "expected an object"
        )
    return document


def _not_json(raw: bytes) -> str | None:
    if not raw.strip():
        return "empty file (0 bytes of JSON); the download or copy did not complete"
    return _foreign_file(raw[:SNIFF_BYTES])


def _foreign_file(head: bytes) -> str | None:
    """What a file is when it is a known stand-in for the real one, else None."""
    if head.startswith(LFS_POINTER_PREFIX):
        return (
            "a Git LFS pointer, not the file itself (the repository was cloned "
            "without Git LFS): run `git lfs pull` in the checkpoint's repository, or "
            "download the file again"
        )
    if head.lstrip().lower().startswith(HTML_PREFIXES):
        return (
            "an HTML page, not the file itself (a download saved an error or login "
            "page): download the file again"
        )
    return None


def _header_error(path: str, rule: str) -> Exl3FormatError:
    return Exl3FormatError(f"{path}: {rule}")


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """The tensors of one safetensors file ({name: {"dtype", "shape", "data_offsets"}})
    and the file offset where its data starts, every rule of the format checked against
    the file size."""
    path = os.fspath(path)
    if reason := broken_link(path):
        raise Exl3FormatError(reason)
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(min(size, SNIFF_BYTES))
            foreign = _foreign_file(head)
            if foreign:
                raise _header_error(path, f"{foreign} (not a safetensors file)")
            if size == 0:
                raise _header_error(
                    path,
                    "empty file (0 bytes); the download or copy did not complete: "
                    "fetch it again",
                )
            if size < HEADER_LENGTH_BYTES:
                raise _header_error(
                    path,
                    f"truncated: {size} bytes, shorter than the "
                    f"{HEADER_LENGTH_BYTES}-byte safetensors header length",
                )
            (length,) = struct.unpack("<Q", head[:HEADER_LENGTH_BYTES])
            if length > size - HEADER_LENGTH_BYTES:
                raise _header_error(
                    path,
                    f"safetensors header length {length} exceeds the file size {size} "
                    "(truncated, or not a safetensors file)",
                )
            if length > MAX_HEADER_BYTES:
                raise _header_error(
                    path,
                    f"safetensors header length {length} is over the format's "
                    f"{MAX_HEADER_BYTES}-byte limit (corrupt header)",
                )
            f.seek(HEADER_LENGTH_BYTES)
            blob = f.read(length)
    except OSError as e:
        raise Exl3FormatError(f"{path}: cannot read ({e.strerror or e})") from e
    if len(blob) != length:
        raise _header_error(path, "truncated safetensors header")
    try:
        header = json.loads(blob.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        where = getattr(e, "pos", getattr(e, "start", 0))
        raise _header_error(
            path,
            f"safetensors header is not valid JSON (byte {where} of the {length}-byte "
            "header; corrupt header)",
        ) from e
    if not isinstance(header, dict):
        raise _header_error(
            path,
            f"safetensors header is a JSON {type(header).__name__}, expected an object "
            "(corrupt header)",
        )
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise _header_error(
            path,
            "safetensors __metadata__ must map strings to strings (corrupt header)",
        )
    base = HEADER_LENGTH_BYTES + length
    _check_offsets(path, header, size - base)
    return header, base


def _check_offsets(path: str, header: dict, data_bytes: int) -> None:
    """Every entry well-formed, and the entries tile [0, data_bytes) in offset order."""
    spans = []
    for name, info in header.items():
        where = f"{path}: tensor {name}"
        if not isinstance(info, dict):
            raise Exl3FormatError(
                f"{where}: header entry is not an object (corrupt header)"
            )
        dtype, shape, offsets = (
            info.get("dtype"),
            info.get("shape"),
            info.get("data_offsets"),
        )
        if dtype not in DTYPE_BYTES:
            raise Exl3FormatError(
                f"{where}: unknown safetensors dtype {dtype!r} (corrupt header)"
            )
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise Exl3FormatError(
                f"{where}: shape {shape!r} is not a list of non-negative integers "
                "(corrupt header)"
            )
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise Exl3FormatError(
                f"{where}: data_offsets {offsets!r} is not a pair of integers (corrupt "
                "header)"
            )
        start, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        expected = numel * DTYPE_BYTES[dtype]
        if not 0 <= start <= end:
            raise Exl3FormatError(
                f"{where}: data_offsets [{start}, {end}] are not an increasing range "
                "(corrupt header)"
            )
        if end - start != expected:
            raise Exl3FormatError(
                f"{where}: data_offsets [{start}, {end}] hold {end - start} bytes, but "
                f"shape {shape} {dtype} needs {expected} (corrupt header)"
            )
        spans.append((start, end, name))
    position = 0
    for start, end, name in sorted(spans):
        where = f"{path}: tensor {name}"
        if start < position:
            raise Exl3FormatError(
                f"{where}: data_offsets [{start}, {end}] overlap the previous tensor's "
                "data (corrupt header)"
            )
        if start > position:
            raise Exl3FormatError(
                f"{where}: data_offsets start at {start}, leaving a gap after byte "
                f"{position} (corrupt header)"
            )
        if end > data_bytes:
            raise Exl3FormatError(
                f"{where}: truncated: its data ends at byte {end} of the data section "
                f"but the file holds {data_bytes} data bytes (incomplete download or "
                "copy: fetch the file again)"
            )
        position = end
    if position != data_bytes:
        raise Exl3FormatError(
            f"{path}: {data_bytes - position} bytes after the last tensor's data (the "
            f"header describes {position} data bytes, the file holds {data_bytes}; "
            "corrupt or appended-to file)"
        )


def _shard_files(
    ckpt_dir: str, names: list[str]
) -> tuple[list[str], dict[str, str] | None]:
    """(the safetensors files to read, the index's weight map or None), strays named."""
    for name in sorted(names):
        read = name.endswith(SAFETENSORS_SUFFIX) or name == SAFETENSORS_INDEX
        if read and (reason := broken_link(os.path.join(ckpt_dir, name))):
            raise Exl3FormatError(reason)
    present = sorted(
        n
        for n in names
        if n.endswith(SAFETENSORS_SUFFIX) and os.path.isfile(os.path.join(ckpt_dir, n))
    )
    index_path = os.path.join(ckpt_dir, SAFETENSORS_INDEX)
    if os.path.exists(index_path):
        document = read_json_object(index_path)
        weight_map = document.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise Exl3FormatError(
                f"{index_path}: no weight_map object mapping tensor names to shard "
                "files"
            )
        files = sorted(set(weight_map.values()))
        for fname in files:
            if fname not in present:
                raise Exl3FormatError(
                    f"{os.path.join(ckpt_dir, fname)}: missing; {SAFETENSORS_INDEX} "
                    f"maps {sum(v == fname for v in weight_map.values())} tensors to "
                    "it (incomplete download: fetch it again)"
                )
        strays = [n for n in present if n not in files]
        if strays:
            raise Exl3FormatError(
                f"{os.path.join(ckpt_dir, strays[0])}: stray shard, not listed in "
                f"{SAFETENSORS_INDEX} (left over from another download or "
                "conversion?): remove it or move it out of the checkpoint directory"
            )
        return files, weight_map
    if not present:
        raise Exl3FormatError(f"{ckpt_dir}: no .safetensors files found")
    if SAFETENSORS_SINGLE in present and len(present) > 1:
        stray = next(n for n in present if n != SAFETENSORS_SINGLE)
        raise Exl3FormatError(
            f"{os.path.join(ckpt_dir, stray)}: stray shard beside the single-file "
            f"checkpoint {SAFETENSORS_SINGLE} and no {SAFETENSORS_INDEX} (every "
            ".safetensors file would be loaded): remove it or move it out of the "
            "checkpoint directory"
        )
    counts = {}
    for n in present:
        m = SHARD_NAME.match(n)
        if m:
            counts.setdefault((m.group("stem"), int(m.group("count"))), set()).add(
                int(m.group("index"))
            )
    for (stem, count), found in sorted(counts.items()):
        missing = sorted(set(range(1, count + 1)) - found)
        if missing:
            name = f"{stem}-{missing[0]:05}-of-{count:05}{SAFETENSORS_SUFFIX}"
            raise Exl3FormatError(
                f"{os.path.join(ckpt_dir, name)}: missing ({len(missing)} of {count} "
                f"shards absent and no {SAFETENSORS_INDEX}; incomplete download)"
            )
    return present, None


def read_safetensors_index(ckpt_dir: str | os.PathLike) -> dict[str, TensorEntry]:
    """Every tensor of a checkpoint (single file or sharded with an index), headers
    only: every file well-formed, every tensor in exactly one shard and where the index
    says it is, every shard file in the index."""
    ckpt_dir = os.fspath(ckpt_dir)
    try:
        names = os.listdir(ckpt_dir)
    except OSError as e:
        raise Exl3FormatError(
            f"{ckpt_dir}: cannot list the checkpoint directory ({e.strerror or e})"
        ) from e
    files, weight_map = _shard_files(ckpt_dir, names)
    headers = [
        (fname, *read_safetensors_header(os.path.join(ckpt_dir, fname)))
        for fname in files
    ]
    index: dict[str, TensorEntry] = {}
    for fname, header, base in headers:
        for name, meta in header.items():
            if name in index:
                raise Exl3FormatError(
                    f"{name}: stored in both {index[name].file} and {fname} (duplicate "
                    "tensor: which one is meant?)"
                )
            start, end = meta["data_offsets"]
            index[name] = TensorEntry(
                fname, meta["dtype"], tuple(meta["shape"]), (base + start, base + end)
            )
    for name, entry in index.items():
        if weight_map is not None and weight_map.get(name) != entry.file:
            listed = weight_map.get(name)
            raise Exl3FormatError(
                f"{name}: found in {entry.file} but {SAFETENSORS_INDEX} "
                + (f"maps it to {listed}" if listed else "does not list it")
            )
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(index))
        if missing:
            raise Exl3FormatError(
                f"{missing[0]}: listed in {SAFETENSORS_INDEX} but in no shard (not in "
                f"{weight_map[missing[0]]}'s header; {len(missing)} missing)"
            )
    return index
