# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Damaged and unusual EXL3 checkpoints, derived from the in-repo fixtures at test time.

Each `Case` builds one checkpoint directory (from tests/fixtures/qwen3-tiny, or a small
synthetic one from vllm_exl3.testing.synthetic_checkpoint) damaged or mismatched the way
downloads and hand edits damage them, and says what every tool must answer: an error, a
warning (the tensors decide, the checkpoint still loads) or nothing, with the phrases
the message must contain (the tensor or file it names, and the rule). Unchanged files
are symlinked, so a case costs only the files it damages.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from . import synthetic_checkpoint as synth
from .fixtures import QWEN3_TINY

FIXTURES = QWEN3_TINY
BASE = FIXTURES / "exl3-4.0bpw"  # 4 bpw decoder, 6 bpw head, 3inst
BASE_MCG = FIXTURES / "exl3-3.0bpw-mcg"  # 3 bpw decoder, 6 bpw head, mcg
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PATHS = ("inspect", "dequantize", "vllm")
LFS_POINTER = (
    "version https://git-lfs.github.com/spec/v1\noid "
    "sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\nsize "
    "4520418\n"
)
HTML_PAGE = (
    "<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>\n<body><h1>Not "
    "Found</h1></body></html>\n"
)
L0 = "model.layers.0"

# ---- expectations
# ------------------------------------------------------------------------------

ERROR, WARNING, LOADS = "error", "warning", "loads"


@dataclass(frozen=True)
class Expect:
    verdict: (
        str  # ERROR: every path fails; WARNING: every path warns and succeeds; LOADS
    )
    needles: tuple[str, ...] = ()  # phrases every path's message contains
    per_path: dict[str, tuple[str, ...]] = field(
        default_factory=dict
    )  # path -> its phrases

    def phrases(self, path: str) -> tuple[str, ...]:
        return self.per_path.get(path, self.needles)


@dataclass(frozen=True)
class Case:
    id: str
    # file, json, shards, config, declared, values, module or unusual
    kind: str
    build: Callable[[Path], None]
    expect: Expect
    vllm: bool = True  # whether vLLM's CPU loader can build this architecture today
    # The checkpoint directory inside what build makes (a Hugging Face cache's
    # snapshot lies two levels down).
    inside: str = ""

    def make(self, root: Path) -> Path:
        dst = root / self.id
        self.build(dst)
        return dst / self.inside


def error(*needles: str, **per_path: tuple[str, ...]) -> Expect:
    return Expect(ERROR, needles, per_path)


def warning(*needles: str, **per_path: tuple[str, ...]) -> Expect:
    return Expect(WARNING, needles, per_path)


# ---- building blocks
# ---------------------------------------------------------------------------


@functools.cache
def _tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(path)


def tensors_of(src: Path = BASE) -> dict[str, torch.Tensor]:
    """The fixture's tensors (a fresh dict; the tensors are shared: clone before
    editing)."""
    return dict(_tensors(str(src / WEIGHTS)))


def copy_of(src: Path, dst: Path, *, weights: bool = True) -> Path:
    """dst with src's files: JSON copied (cases edit them), weights symlinked."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, dst / f.name)
        elif weights:
            os.symlink(f, dst / f.name)
    return dst


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document, indent=4))


def edit_config(**changes) -> Callable[[Path], None]:
    def build(dst: Path) -> None:
        copy_of(BASE, dst)
        edit_json(dst / "config.json", lambda c: c.update(changes))

    return build


def save(
    dst: Path,
    named: dict[str, torch.Tensor],
    name: str = WEIGHTS,
    metadata: dict | None = None,
) -> None:
    path = dst / name
    if path.is_symlink() or path.exists():
        path.unlink()
    save_file(named, str(path), metadata=metadata)


def with_tensors(
    edit: Callable[[dict[str, torch.Tensor]], None],
    src: Path = BASE,
    config: dict | None = None,
) -> Callable[[Path], None]:
    def build(dst: Path) -> None:
        copy_of(src, dst)
        named = tensors_of(src)
        edit(named)
        save(dst, named)
        if config:
            edit_json(dst / "config.json", lambda c: c.update(config))

    return build


def drop(*prefixes: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(named: dict[str, torch.Tensor]) -> None:
        for name in [n for n in named if n.startswith(prefixes)]:
            del named[name]

    return edit


def set_value(name: str, index: int, value: float) -> Callable[[dict], None]:
    def edit(named: dict[str, torch.Tensor]) -> None:
        t = named[name].clone()
        t[index] = value
        named[name] = t

    return edit


def replace_file(
    text: str | bytes, name: str = WEIGHTS, src: Path = BASE
) -> Callable[[Path], None]:
    def build(dst: Path) -> None:
        copy_of(src, dst)
        (dst / name).unlink()
        data = text.encode() if isinstance(text, str) else text
        (dst / name).write_bytes(data)

    return build


def _lfs_pointer_config_without_dtype(dst: Path) -> None:
    """Without a dtype in config.json, vLLM's ModelConfig reads the safetensors headers
    itself, before any quantization method exists (patch 0004 bounds that reader)."""
    replace_file(LFS_POINTER)(dst)
    edit_json(
        dst / "config.json",
        lambda c: [c.pop(k, None) for k in ("dtype", "torch_dtype")],
    )


def raw_parts(path: Path) -> tuple[dict, bytes]:
    """(the header as JSON, the data section) of a safetensors file."""
    blob = path.read_bytes()
    (length,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + length]), blob[8 + length :]


def raw_write(
    path: Path, header: dict | list | bytes, data: bytes, length: int | None = None
) -> None:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes
    path.unlink(missing_ok=True)
    path.write_bytes(
        struct.pack("<Q", len(text) if length is None else length) + text + data
    )


def raw_edit(
    edit: Callable[[dict, bytes], tuple], src: Path = BASE
) -> Callable[[Path], None]:
    """Rewrite model.safetensors from edit(header, data) -> (header, data[, length])."""

    def build(dst: Path) -> None:
        copy_of(src, dst)
        header, data = raw_parts(src / WEIGHTS)
        raw_write(dst / WEIGHTS, *edit(header, data))

    return build


def bytes_edit(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def build(dst: Path) -> None:
        copy_of(BASE, dst)
        blob = (BASE / WEIGHTS).read_bytes()
        (dst / WEIGHTS).unlink()
        (dst / WEIGHTS).write_bytes(edit(blob))

    return build


def sharded(
    dst: Path,
    named: dict[str, torch.Tensor] | None = None,
    parts: int = 2,
    src: Path = BASE,
) -> dict[str, str]:
    """dst as a sharded checkpoint (parts shards + index, split by module like the
    converter); returns the weight map."""
    copy_of(src, dst, weights=False)
    named = tensors_of(src) if named is None else named
    names = sorted(named)
    per = -(-len(names) // parts)
    weight_map = {}
    for i in range(parts):
        fname = f"model-{i + 1:05}-of-{parts:05}.safetensors"
        chunk = {n: named[n] for n in names[i * per : (i + 1) * per]}
        save_file(chunk, str(dst / fname))
        weight_map.update({n: fname for n in chunk})
    write_index(dst, weight_map)
    return weight_map


def write_index(dst: Path, weight_map: dict[str, str]) -> None:
    (dst / INDEX).write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2)
    )


def shard_edit(edit: Callable[[Path, dict[str, str]], None]) -> Callable[[Path], None]:
    def build(dst: Path) -> None:
        edit(dst, sharded(dst))

    return build


def synthetic(
    config: str | dict,
    *,
    tensor_edit: Callable[[dict], None] | None = None,
    config_edit: dict | None = None,
    **kwargs,
) -> Callable[[Path], None]:
    """A small synthetic checkpoint (random trellis codes, the converter's layout)."""

    def build(dst: Path) -> None:
        synth.write_checkpoint(config, dst, **kwargs)
        if tensor_edit is not None:
            named = load_file(str(dst / WEIGHTS))
            tensor_edit(named)
            save(dst, named)
        if config_edit:
            edit_json(dst / "config.json", lambda c: c.update(config_edit))

    return build


# Small synthetic architectures: a 1-layer qwen3 MoE (4 experts), and qwen3-tiny with
# dims that are not multiples of 128 (vocab 4000, intermediate 700), so the format's
# padding is exercised.
MOE_TINY = {
    "model_type": "qwen3_moe",
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 1,
    "vocab_size": 1024,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
}
PADDED_TINY = {"vocab_size": 4000, "intermediate_size": 700}


def _padded_config() -> dict:
    return {
        **synth.PRESETS["qwen3-tiny"],
        **PADDED_TINY,
        "num_hidden_layers": 2,
        "layer_types": ["full_attention"] * 2,
    }


def padded(**kwargs) -> Callable[[Path], None]:
    def build(dst: Path) -> None:
        synthetic(_padded_config(), bits=4, codebook="mul1", **kwargs)(dst)

    return build


# ---- the cases
# ---------------------------------------------------------------------------------


def _shift_offsets(header, data):
    """down_proj.suh's range one byte wider than its shape needs."""
    name = f"{L0}.mlp.down_proj.suh"
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end + 1]
    return header, data


def _overlap(header, data):
    """Two equal-sized tensors pointed at the same bytes (and a hole where one was)."""
    a, b = (
        f"{L0}.self_attn.k_proj.suh",
        f"{L0}.self_attn.q_proj.suh",
    )  # a is stored first
    header[b]["data_offsets"] = list(header[a]["data_offsets"])
    return header, data


def _dtype(header, data):
    header[f"{L0}.mlp.up_proj.svh"]["dtype"] = "Q4"
    return header, data


def _metadata(header, data):
    header["__metadata__"] = {"format": 1}
    return header, data


def _header_length(header, data):
    return header, data, 1 << 40


def _cut_header(blob: bytes) -> bytes:
    (length,) = struct.unpack("<Q", blob[:8])
    return blob[: 8 + length // 2]


def _garble_header(blob: bytes) -> bytes:
    return blob[:20] + b"\xff\xfe{{" + blob[24:]


def _not_object(header, data):
    return b"[]", b""


def _config_missing_comma(dst: Path) -> None:
    copy_of(BASE, dst)
    text = (dst / "config.json").read_text()
    (dst / "config.json").write_text(
        text.replace('"hidden_size": 256,', '"hidden_size": 256', 1)
    )


def _quant_json_truncated(dst: Path) -> None:
    copy_of(BASE, dst)
    text = (dst / "quantization_config.json").read_text()
    (dst / "quantization_config.json").write_text(text[: len(text) // 2])


def _index_truncated(dst: Path, weight_map: dict[str, str]) -> None:
    text = (dst / INDEX).read_text()
    (dst / INDEX).write_text(text[: len(text) // 3])


def _index_lfs(dst: Path, weight_map: dict[str, str]) -> None:
    (dst / INDEX).write_text(LFS_POINTER)


def _index_without_map(dst: Path, weight_map: dict[str, str]) -> None:
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}}))


def _shard_missing(dst: Path, weight_map: dict[str, str]) -> None:
    (dst / "model-00002-of-00002.safetensors").unlink()


def _index_lists_absent(dst: Path, weight_map: dict[str, str]) -> None:
    weight_map[f"{L0}.mlp.up_proj.bias"] = "model-00001-of-00002.safetensors"
    write_index(dst, weight_map)


def _index_wrong_shard(dst: Path, weight_map: dict[str, str]) -> None:
    weight_map["model.norm.weight"] = "model-00001-of-00002.safetensors"
    write_index(dst, weight_map)


def _twice_across_shards(dst: Path, weight_map: dict[str, str]) -> None:
    named = tensors_of()
    first = {n: named[n] for n, f in weight_map.items() if f.startswith("model-00001")}
    first["model.norm.weight"] = named["model.norm.weight"]
    save(dst, first, "model-00001-of-00002.safetensors")


def _not_in_index(dst: Path, weight_map: dict[str, str]) -> None:
    del weight_map["model.norm.weight"]
    write_index(dst, weight_map)


def _stray_beside_index(dst: Path, weight_map: dict[str, str]) -> None:
    save(
        dst,
        {"model.norm.weight": tensors_of()["model.norm.weight"]},
        "model-00003-of-00003.safetensors",
    )


def _stray_beside_single(dst: Path) -> None:
    copy_of(BASE, dst)
    save(
        dst,
        {"model.norm.weight": tensors_of()["model.norm.weight"]},
        "model-00002-of-00002.safetensors",
    )


def _shards_without_index(dst: Path) -> None:
    sharded(dst, parts=3)
    (dst / INDEX).unlink()
    (dst / "model-00002-of-00003.safetensors").unlink()


def _no_weights(dst: Path) -> None:
    copy_of(BASE, dst, weights=False)


def _more_layers(dst: Path) -> None:
    copy_of(BASE, dst)
    edit_json(
        dst / "config.json",
        lambda c: c.update(num_hidden_layers=5, layer_types=["full_attention"] * 5),
    )


def _fewer_layers(dst: Path) -> None:
    copy_of(BASE, dst)
    edit_json(
        dst / "config.json",
        lambda c: c.update(num_hidden_layers=3, layer_types=["full_attention"] * 3),
    )


def _add_bias(named: dict[str, torch.Tensor]) -> None:
    named[f"{L0}.self_attn.q_proj.bias"] = torch.zeros(256, dtype=torch.float16)


def _wide_trellis(named: dict[str, torch.Tensor]) -> None:
    t = named[f"{L0}.mlp.down_proj.trellis"]
    named[f"{L0}.mlp.down_proj.trellis"] = torch.cat(
        [t, t[..., :8]], dim=-1
    )  # 4.5 bits


def _half_rate_3inst(named: dict[str, torch.Tensor]) -> None:
    t = named[f"{L0}.mlp.down_proj.trellis"]
    named[f"{L0}.mlp.down_proj.trellis"] = t[..., :40].contiguous()  # 2.5 bits, no mul1


def _narrow_module(named: dict[str, torch.Tensor]) -> None:
    p = f"{L0}.self_attn.k_proj"
    named[f"{p}.trellis"] = named[f"{p}.trellis"][:, :7].contiguous()
    named[f"{p}.svh"] = named[f"{p}.svh"][:112].contiguous()


def _suh_fp32(named: dict[str, torch.Tensor]) -> None:
    p = f"{L0}.self_attn.o_proj.suh"
    named[p] = named[p].float()


def _trellis_fp16(named: dict[str, torch.Tensor]) -> None:
    p = f"{L0}.mlp.gate_proj.trellis"
    named[p] = named[p].view(torch.float16)


def _both_markers(named: dict[str, torch.Tensor]) -> None:
    named[f"{L0}.mlp.up_proj.mcg"] = torch.tensor(-877912083, dtype=torch.int32)
    named[f"{L0}.mlp.up_proj.mul1"] = torch.tensor(-2082680531, dtype=torch.int32)


def _bad_marker(named: dict[str, torch.Tensor]) -> None:
    named[f"{L0}.mlp.up_proj.mcg"] = torch.tensor(7, dtype=torch.int32)


def _quantized_indexer_wk(named: dict[str, torch.Tensor]) -> None:
    """The DSA indexer's wk stored as EXL3 (ExLlamaV3 keeps it fp16)."""
    module = f"{L0}.self_attn.indexer.wk"
    n, k = named.pop(f"{module}.weight").shape
    slot = synth.LinearSlot(module, k, n, "replicated", module)
    gen = torch.Generator().manual_seed(0)
    named.update(synth._exl3_tensors(slot, 4, synth.fmt.Codebook.MUL1, False, gen))


def _quantized_embedding(named: dict[str, torch.Tensor]) -> None:
    """A quantized token embedding whose trellis width (130 words for 1 group) is no
    bitrate's 1 + 16K."""
    del named["model.embed_tokens.weight"]
    named["model.embed_tokens.trellis"] = torch.zeros(4096, 2 * 65, dtype=torch.int16)
    named["model.embed_tokens.signs"] = torch.zeros(1, 256, dtype=torch.float16)


def _moe_drop_expert(named: dict[str, torch.Tensor]) -> None:
    drop(f"{L0}.mlp.experts.3.")(named)


def _storage_bits(dst: Path) -> None:
    copy_of(BASE, dst)
    edit_json(
        dst / "quantization_config.json",
        lambda q: q["tensor_storage"]["model.layers.1.mlp.up_proj"].update(
            bits_per_weight=5
        ),
    )


def _storage_codebook(dst: Path) -> None:
    copy_of(BASE, dst)
    edit_json(
        dst / "quantization_config.json",
        lambda q: q["tensor_storage"]["model.layers.2.self_attn.o_proj"].update(
            mcg_multiplier=3417055213
        ),
    )


def _storage_unlisted(dst: Path) -> None:
    copy_of(BASE, dst)
    edit_json(
        dst / "quantization_config.json",
        lambda q: q["tensor_storage"].pop("model.layers.3.mlp.down_proj"),
    )


def _config_block(**changes) -> Callable[[Path], None]:
    def build(dst: Path) -> None:
        copy_of(BASE, dst)
        edit_json(
            dst / "config.json", lambda c: c["quantization_config"].update(changes)
        )

    return build


def _resaved_with_metadata(dst: Path) -> None:
    copy_of(BASE, dst)
    save(dst, tensors_of(), metadata={"format": "pt", "converted_by": "a hand re-save"})


def _no_quant_json(dst: Path) -> None:
    copy_of(BASE, dst)
    (dst / "quantization_config.json").unlink()


def _index_for_sharded(dst: Path) -> None:
    sharded(dst, parts=3)


# A Hugging Face cache: snapshots/<revision>/<file> -> ../../blobs/<hash>.
HF_SNAPSHOT = "snapshots/3f1c0a9e5b7d2c4e6a8b0d1f3e5c7a9b1d3f5e7a"


def _hf_cache_blob_missing(dst: Path) -> None:
    """The fixture as the Hugging Face cache lays it out, every file a link into
    blobs/, after an interrupted download or a pruned cache: model.safetensors' blob
    is gone, its link left in the snapshot."""
    snapshot, blobs = dst / HF_SNAPSHOT, dst / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for f in BASE.iterdir():
        blob = hashlib.sha256(f.name.encode()).hexdigest()
        if f.name != WEIGHTS:
            shutil.copy(f, blobs / blob)
        (snapshot / f.name).symlink_to(f"../../blobs/{blob}")


def _weights_link_loop(dst: Path) -> None:
    copy_of(BASE, dst, weights=False)
    (dst / WEIGHTS).symlink_to(WEIGHTS)


def _no_config_block(*, quant_json: bool) -> Callable[[Path], None]:
    """config.json rewritten without its quantization_config block (by a tool that
    drops keys it does not know), quantization_config.json kept or not."""

    def build(dst: Path) -> None:
        copy_of(BASE, dst)
        edit_json(dst / "config.json", lambda c: c.pop("quantization_config"))
        if not quant_json:
            (dst / "quantization_config.json").unlink()

    return build


def _o_proj_bias(named: dict[str, torch.Tensor]) -> None:
    named[f"{L0}.self_attn.o_proj.bias"] = torch.zeros(256, dtype=torch.float16)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """The legacy sign bitfield of a scale vector: bit b of int16 word w set where
    element 16w+b is negative (format.unpack_sign_bits reads it back)."""
    negative = (values < 0).reshape(-1, 16).to(torch.int32)
    words = (negative << torch.arange(16, dtype=torch.int32)).sum(-1)
    return ((words + (1 << 15)) % (1 << 16) - (1 << 15)).to(torch.int16)


def _storage_entry_of(dst: Path, module: str, named: dict[str, torch.Tensor]) -> None:
    """quantization_config.json's stored_tensors for `module` as now stored (what a
    tool rewriting a module writes)."""
    names = sorted(n for n in named if n.startswith(f"{module}."))

    def edit(q: dict) -> None:
        q["tensor_storage"][module]["stored_tensors"] = {
            n: {
                "shape": list(named[n].shape),
                "n_bytes": named[n].numel() * named[n].element_size(),
                "dtype": str(named[n].dtype),
            }
            for n in names
        }

    edit_json(dst / "quantization_config.json", edit)


LEGACY_MODULE = "model.layers.1.mlp.up_proj"


def _one_module_legacy_signs(dst: Path) -> None:
    """One module as an older conversion stores it: su/sv sign bitfields instead of
    suh/svh (quantization_config.json updated to match); every other module current."""
    copy_of(BASE, dst)
    named = tensors_of()
    for full, packed in (("suh", "su"), ("svh", "sv")):
        named[f"{LEGACY_MODULE}.{packed}"] = pack_signs(
            named.pop(f"{LEGACY_MODULE}.{full}")
        )
    save(dst, named)
    _storage_entry_of(dst, LEGACY_MODULE, named)


MIXED_MODULE = f"{L0}.self_attn.q_proj"


def _module_from_another_conversion(*drop_modules: str) -> Callable[[Path], None]:
    """A 3-layer mcg 3 bpw conversion whose layer-0 q_proj comes from a mul1 2.5 bpw
    conversion of the same model (its marker tensor is .mul1 where the other layers
    store .mcg), as layer-mixing tools for EXL3 write it, tensor_storage entry
    included; `drop_modules` then removed entirely."""

    def build(dst: Path) -> None:
        other = dst.parent / f"{dst.name}-other-conversion"
        synth.write_checkpoint("qwen3-tiny", dst, layers=3, bits=3, codebook="mcg")
        synth.write_checkpoint("qwen3-tiny", other, layers=3, bits=2.5, codebook="mul1")
        named = load_file(str(dst / WEIGHTS))
        donor = load_file(str(other / WEIGHTS))
        drop(f"{MIXED_MODULE}.")(named)
        named.update(
            {n: t for n, t in donor.items() if n.startswith(f"{MIXED_MODULE}.")}
        )
        drop(*(f"{m}." for m in drop_modules))(named)
        save(dst, named)
        entry = json.loads((other / "quantization_config.json").read_text())[
            "tensor_storage"
        ][MIXED_MODULE]

        def edit(q: dict) -> None:
            q["tensor_storage"][MIXED_MODULE] = entry
            for module in drop_modules:
                q["tensor_storage"].pop(module)

        edit_json(dst / "quantization_config.json", edit)
        shutil.rmtree(other)

    return build


QP = "model.layers.1.self_attn.q_proj"
CASES: list[Case] = [
    # -- files: what stands in for model.safetensors, and headers that lie about the
    # file --
    Case(
        "lfs-pointer",
        "file",
        replace_file(LFS_POINTER),
        error("model.safetensors: a Git LFS pointer", "git lfs pull"),
    ),
    Case(
        "lfs-pointer-config-without-dtype",
        "file",
        _lfs_pointer_config_without_dtype,
        error(
            inspect=("model.safetensors: a Git LFS pointer", "git lfs pull"),
            dequantize=("model.safetensors: a Git LFS pointer", "git lfs pull"),
            vllm=("model.safetensors: not a safetensors file", "Git LFS pointer"),
        ),
    ),
    Case(
        "html-page",
        "file",
        replace_file(HTML_PAGE),
        error("model.safetensors: an HTML page", "download the file again"),
    ),
    Case(
        "zero-bytes",
        "file",
        replace_file(b""),
        error("model.safetensors: empty file (0 bytes)"),
    ),
    Case(
        "five-bytes",
        "file",
        replace_file(b"\x10\x00\x00\x00\x00"),
        error("model.safetensors: truncated: 5 bytes"),
    ),
    Case(
        "header-length-absurd",
        "file",
        raw_edit(_header_length),
        error(
            "model.safetensors: safetensors header length 1099511627776 exceeds the "
            "file size"
        ),
    ),
    Case(
        "header-cut",
        "file",
        bytes_edit(_cut_header),
        error("model.safetensors: safetensors header length", "exceeds the file size"),
    ),
    Case(
        "data-truncated",
        "file",
        bytes_edit(lambda b: b[:-1000]),
        error("model.safetensors: tensor ", ": truncated: its data ends at byte"),
    ),
    Case(
        "trailing-bytes",
        "file",
        bytes_edit(lambda b: b + b"\0" * 64),
        error("model.safetensors: 64 bytes after the last tensor's data"),
    ),
    Case(
        "header-not-json",
        "file",
        bytes_edit(_garble_header),
        error("model.safetensors: safetensors header is not valid JSON"),
    ),
    Case(
        "header-not-object",
        "file",
        raw_edit(_not_object),
        error("model.safetensors: safetensors header is a JSON list"),
    ),
    Case(
        "offsets-vs-shape",
        "file",
        raw_edit(_shift_offsets),
        error(
            f"model.safetensors: tensor {L0}.mlp.down_proj.suh: data_offsets",
            "but shape [768] F16 needs 1536",
        ),
    ),
    Case(
        "offsets-overlap",
        "file",
        raw_edit(_overlap),
        error("model.safetensors: tensor ", "overlap the previous tensor's data"),
    ),
    Case(
        "unknown-dtype",
        "file",
        raw_edit(_dtype),
        error(
            f"model.safetensors: tensor {L0}.mlp.up_proj.svh: unknown safetensors "
            "dtype 'Q4'"
        ),
    ),
    Case(
        "metadata-not-strings",
        "file",
        raw_edit(_metadata),
        error(
            "model.safetensors: safetensors __metadata__ must map strings to strings"
        ),
    ),
    Case(
        "hf-cache-blob-missing",
        "file",
        _hf_cache_blob_missing,
        error(
            "model.safetensors: a broken symbolic link to ../../blobs/",
            "does not exist): the Hugging Face cache lost the file",
            "download the model again",
        ),
        inside=HF_SNAPSHOT,
    ),
    Case(
        "weights-link-loop",
        "file",
        _weights_link_loop,
        error(
            "model.safetensors: a symbolic link loop (model.safetensors -> "
            "model.safetensors",
            "replace the link with the file itself, or download it again",
        ),
    ),
    # -- JSON files --
    Case(
        "config-json-syntax",
        "json",
        _config_missing_comma,
        # transformers parses config.json before any quantization method exists; it
        # names the file (its traceback shows the line and column).
        error(
            inspect=("config.json: invalid JSON at line 13 column 5",),
            dequantize=("config.json: invalid JSON at line 13 column 5",),
            vllm=("config.json' is not a valid JSON file",),
        ),
    ),
    Case(
        "quant-json-truncated",
        "json",
        _quant_json_truncated,
        error("quantization_config.json: invalid JSON at line"),
    ),
    Case(
        "quant-json-not-object",
        "json",
        replace_file("[1, 2]", "quantization_config.json"),
        error(
            "quantization_config.json: the JSON document is a list, expected an object"
        ),
    ),
    Case(
        "index-json-truncated",
        "json",
        shard_edit(_index_truncated),
        error("model.safetensors.index.json: invalid JSON at line"),
    ),
    Case(
        "index-json-lfs-pointer",
        "json",
        shard_edit(_index_lfs),
        error("model.safetensors.index.json: a Git LFS pointer", "git lfs pull"),
    ),
    Case(
        "index-without-weight-map",
        "json",
        shard_edit(_index_without_map),
        error("model.safetensors.index.json: no weight_map"),
    ),
    # -- shards and the index --
    Case(
        "index-shard-missing",
        "shards",
        shard_edit(_shard_missing),
        error(
            "model-00002-of-00002.safetensors: missing; model.safetensors.index.json "
            "maps"
        ),
    ),
    Case(
        "index-lists-absent-tensor",
        "shards",
        shard_edit(_index_lists_absent),
        error(
            f"{L0}.mlp.up_proj.bias: listed in model.safetensors.index.json but in no "
            "shard"
        ),
    ),
    Case(
        "index-wrong-shard",
        "shards",
        shard_edit(_index_wrong_shard),
        error(
            "model.norm.weight: found in model-00002-of-00002.safetensors but "
            "model.safetensors.index.json maps it to model-00001-of-00002.safetensors"
        ),
    ),
    Case(
        "tensor-in-two-shards",
        "shards",
        shard_edit(_twice_across_shards),
        error(
            "model.norm.weight: stored in both model-00001-of-00002.safetensors and "
            "model-00002-of-00002.safetensors"
        ),
    ),
    Case(
        "tensor-not-in-index",
        "shards",
        shard_edit(_not_in_index),
        error(
            "model.norm.weight: found in model-00002-of-00002.safetensors but "
            "model.safetensors.index.json does not list it"
        ),
    ),
    Case(
        "stray-shard-beside-index",
        "shards",
        shard_edit(_stray_beside_index),
        error(
            "model-00003-of-00003.safetensors: stray shard, not listed in "
            "model.safetensors.index.json"
        ),
    ),
    Case(
        "stray-shard-beside-single",
        "shards",
        _stray_beside_single,
        error(
            "model-00002-of-00002.safetensors: stray shard beside the single-file "
            "checkpoint model.safetensors"
        ),
    ),
    Case(
        "shard-missing-no-index",
        "shards",
        _shards_without_index,
        error("model-00002-of-00003.safetensors: missing (1 of 3 shards absent"),
    ),
    Case(
        "no-weights",
        "shards",
        _no_weights,
        # A directory without weights is described from tensor_storage (for
        # load_format="dummy"); vLLM's loader then finds no weights.
        error(
            inspect=("no-weights: no .safetensors files found",),
            dequantize=("no-weights: no .safetensors files found",),
            vllm=("Cannot find any model weights", "no-weights"),
        ),
    ),
    # -- config.json against the tensors --
    Case(
        "hidden-size",
        "config",
        edit_config(hidden_size=512),
        error(
            "model.embed_tokens.weight: shape [4096, 256], but config.json "
            "hidden_size = 512"
        ),
    ),
    Case(
        "vocab-size",
        "config",
        edit_config(vocab_size=5000),
        error(
            "model.embed_tokens.weight: shape [4096, 256], but config.json vocab_size "
            "= 5000"
        ),
    ),
    Case(
        "intermediate-size",
        "config",
        edit_config(intermediate_size=1024),
        error(
            f"{L0}.mlp.down_proj.trellis: stored k x n = 768 x 256, but config.json "
            "(hidden_size, intermediate_size) implies 1024 x 256"
        ),
    ),
    Case(
        "attention-heads",
        "config",
        edit_config(num_attention_heads=8),
        error(
            f"{L0}.self_attn.o_proj.trellis: stored k x n = 256 x 256, but config.json"
        ),
    ),
    Case(
        "kv-heads",
        "config",
        edit_config(num_key_value_heads=4),
        error(
            f"{L0}.self_attn.k_proj.trellis: stored k x n = 256 x 128, but config.json",
            "implies 256 x 256",
        ),
    ),
    Case(
        "config-more-layers",
        "config",
        _more_layers,
        error(
            "model.layers.4: no tensors stored, but config.json num_hidden_layers = 5"
        ),
    ),
    Case(
        "config-fewer-layers",
        "config",
        _fewer_layers,
        error("model.layers.3: stored, but config.json num_hidden_layers = 3"),
    ),
    Case(
        "module-missing",
        "config",
        with_tensors(drop("model.layers.2.mlp.down_proj.")),
        error("model.layers.2.mlp.down_proj: missing from the checkpoint"),
    ),
    Case(
        "norm-missing",
        "config",
        with_tensors(drop("model.layers.1.input_layernorm.")),
        error("model.layers.1.input_layernorm: missing from the checkpoint"),
    ),
    Case(
        "final-norm-shape",
        "config",
        with_tensors(
            lambda n: n.update({"model.norm.weight": n["model.norm.weight"][:128]})
        ),
        error("model.norm.weight: shape [128], but config.json hidden_size = 256"),
    ),
    Case(
        "tied-with-exl3-head",
        "config",
        edit_config(tie_word_embeddings=True),
        error("lm_head.trellis: stored, but config.json tie_word_embeddings = true"),
    ),
    Case(
        "head-missing",
        "config",
        with_tensors(drop("lm_head.")),
        error("lm_head: missing (no lm_head.trellis or lm_head.weight)"),
    ),
    Case(
        "bias-not-in-config",
        "config",
        with_tensors(_add_bias),
        error(
            f"{L0}.self_attn.q_proj.bias: stored, but config.json attention_bias = "
            "false"
        ),
    ),
    Case(
        "bias-missing",
        "config",
        edit_config(attention_bias=True),
        error(
            f"{L0}.self_attn.k_proj.bias: missing, but config.json attention_bias = "
            "true"
        ),
    ),
    Case(
        "o-proj-bias-not-in-config",
        "config",
        with_tensors(_o_proj_bias),
        error(
            f"{L0}.self_attn.o_proj.bias: stored, but config.json attention_bias = "
            "false: the model builds o_proj without a bias"
        ),
    ),
    # vLLM picks the method from quant_method before any EXL3 code runs: it names the
    # unknown method itself.
    Case(
        "quant-method-exl2",
        "config",
        _config_block(quant_method="exl2"),
        error(
            inspect=(
                "config.json: quantization_config.quant_method = 'exl2', not 'exl3', "
                "but the tensors are EXL3 (29 modules with a .trellis",
                'set it to "exl3"',
            ),
            dequantize=(
                "config.json: quantization_config.quant_method = 'exl2', not 'exl3', "
                "but the tensors are EXL3 (29 modules with a .trellis",
                'set it to "exl3"',
            ),
            vllm=("Unknown quantization method: exl2",),
        ),
    ),
    # Without any declaration vLLM builds the model unquantized and no EXL3 code runs:
    # its message is its own.
    Case(
        "no-config-block-no-quant-json",
        "config",
        _no_config_block(quant_json=False),
        error(
            inspect=(
                "config.json: no quantization_config block and no "
                "quantization_config.json beside it, but the tensors are EXL3",
                '"quantization_config": {"quant_method": "exl3"}',
            ),
            dequantize=(
                "config.json: no quantization_config block and no "
                "quantization_config.json beside it, but the tensors are EXL3",
                '"quantization_config": {"quant_method": "exl3"}',
            ),
            vllm=("There is no module or parameter named 'lm_head.suh'",),
        ),
    ),
    Case(
        "module-missing-beside-mixed-forms",
        "config",
        _module_from_another_conversion("model.layers.2.self_attn.q_proj"),
        error(
            "model.layers.2.self_attn.q_proj: missing from the checkpoint "
            "(self_attn.q_proj absent from model.layers.2"
        ),
    ),
    # -- the DSA indexer (DeepSeek-V3.2, GLM-5): present on every layer vLLM builds one
    # for, in the form vLLM loads, on the schedule vLLM derives.
    Case(
        "dsa-indexer-schedule",
        "config",
        synthetic("glm5-tiny", bits=4, config_edit={"index_topk_freq": 1}),
        error(
            "config.json: indexer_types[2] = 'shared', but vLLM builds the indexers",
            '"index_topk_pattern": "FFS"',
        ),
    ),
    Case(
        "dsa-indexer-missing",
        "config",
        synthetic(
            "deepseek-v32-tiny",
            bits=3,
            layers=2,
            mtp=False,
            tensor_edit=drop("model.layers.1.self_attn.indexer.wk."),
        ),
        error("model.layers.1.self_attn.indexer.wk: missing"),
    ),
    Case(
        "dsa-indexer-wk-exl3",
        "module",
        synthetic(
            "deepseek-v32-tiny",
            bits=3,
            layers=2,
            mtp=False,
            tensor_edit=_quantized_indexer_wk,
        ),
        error(
            f"{L0}.self_attn.indexer.wk.trellis: EXL3, but vLLM builds the indexer's "
            "wk and weights_proj as one unquantized GEMM"
        ),
    ),
    Case(
        "expert-missing",
        "config",
        synthetic(MOE_TINY, bits=2, codebook="mul1", tensor_edit=_moe_drop_expert),
        error(f"{L0}.mlp.experts.3: missing (1 of 4 experts absent"),
    ),
    Case(
        "experts-beyond-config",
        "config",
        synthetic(
            MOE_TINY,
            bits=2,
            codebook="mul1",
            config_edit={"num_experts": 2, "num_experts_per_tok": 1},
        ),
        error(f"{L0}.mlp.experts.2: stored, but config.json num_experts = 2"),
    ),
    Case(
        "experts-in-dense-config",
        "config",
        synthetic(
            MOE_TINY,
            bits=2,
            codebook="mul1",
            config_edit={
                "num_experts": None,
                "model_type": "qwen3",
                "architectures": ["Qwen3ForCausalLM"],
            },
        ),
        error(
            f"{L0}.mlp.experts.0: expert tensors stored, but config.json declares no "
            "experts"
        ),
    ),
    # -- what the JSON files declare: the tensors decide, with a warning naming the
    # module --
    Case(
        "storage-bits",
        "declared",
        _storage_bits,
        warning(
            "model.layers.1.mlp.up_proj",
            inspect=("model.layers.1.mlp.up_proj (5 listed, 4 stored)",),
            dequantize=(
                "model.layers.1.mlp.up_proj: quantization_config.json says 5 bits",
            ),
            vllm=("model.layers.1.mlp.up_proj: quantization_config.json says 5 bits",),
        ),
    ),
    Case(
        "storage-codebook",
        "declared",
        _storage_codebook,
        warning(
            inspect=("model.layers.2.self_attn.o_proj (mcg listed, 3inst stored)",),
            dequantize=(
                "model.layers.2.self_attn.o_proj: quantization_config.json says 4 "
                "bits, codebook mcg",
            ),
            vllm=(
                "model.layers.2.self_attn.o_proj: quantization_config.json says 4 "
                "bits, codebook mcg",
            ),
        ),
    ),
    Case(
        "storage-module-unlisted",
        "declared",
        _storage_unlisted,
        warning(
            inspect=("missing from tensor_storage: model.layers.3.mlp.down_proj",),
            dequantize=(
                "model.layers.3.mlp.down_proj: EXL3 in the tensors but missing from "
                "quantization_config.json's tensor_storage",
            ),
            vllm=(
                "model.layers.3.mlp.down_proj: EXL3 in the tensors but missing from "
                "quantization_config.json's tensor_storage",
            ),
        ),
    ),
    Case(
        "config-codebook",
        "declared",
        _config_block(codebook="mul1"),
        warning(
            inspect=("codebook = 'mul1' but 29 modules use another codebook: lm_head",),
            dequantize=("lm_head: config.json quantization_config.codebook = 'mul1'",),
            vllm=("lm_head: config.json quantization_config.codebook = 'mul1'",),
        ),
    ),
    Case(
        "config-head-bits",
        "declared",
        _config_block(head_bits=8),
        warning(
            inspect=("head_bits = 8 but lm_head.trellis holds 6 bits",),
            dequantize=("lm_head: config.json quantization_config.head_bits = 8",),
            vllm=("lm_head: config.json quantization_config.head_bits = 8",),
        ),
    ),
    Case(
        "no-config-block",
        "declared",
        _no_config_block(quant_json=True),
        warning(
            "config.json: no quantization_config block; read as EXL3 from "
            "quantization_config.json",
            "quant_method 'exl3' (29 EXL3 modules stored)",
            "Restore the block",
        ),
    ),
    # -- values of suh/svh --
    Case(
        "suh-nan",
        "values",
        with_tensors(set_value(f"{QP}.suh", 5, float("nan"))),
        error(f"{QP}.suh: nan at index 5", "non-finite scale"),
    ),
    Case(
        "svh-inf",
        "values",
        with_tensors(set_value("lm_head.svh", 3, float("inf"))),
        error("lm_head.svh: inf at index 3", "non-finite scale"),
    ),
    Case(
        "svh-neg-inf",
        "values",
        with_tensors(set_value(f"{L0}.mlp.down_proj.svh", 0, float("-inf"))),
        error(f"{L0}.mlp.down_proj.svh: -inf at index 0"),
    ),
    Case(
        "suh-zero",
        "values",
        with_tensors(set_value(f"{L0}.mlp.down_proj.suh", 7, 0.0)),
        error(f"{L0}.mlp.down_proj.suh: 0 at index 7, on real input rows"),
    ),
    Case(
        "svh-zero-real-column",
        "values",
        with_tensors(set_value("model.layers.2.self_attn.v_proj.svh", 9, 0.0)),
        warning(
            "model.layers.2.self_attn.v_proj.svh: 0 at index 9, on real output columns"
        ),
    ),
    Case(
        "svh-nan-on-padding",
        "values",
        padded(tensor_edit=set_value("lm_head.svh", 4000, float("nan"))),
        error("lm_head.svh: nan at index 4000"),
    ),
    # -- rules of one EXL3 module (format.py), through every tool --
    Case(
        "trellis-width",
        "module",
        with_tensors(_wide_trellis),
        error(f"{L0}.mlp.down_proj.trellis: trellis width 72", "valid rates"),
    ),
    Case(
        "half-rate-3inst",
        "module",
        with_tensors(_half_rate_3inst),
        error(
            f"{L0}.mlp.down_proj.trellis: half-integer rate 2.5 needs the mul1 codebook"
        ),
    ),
    Case(
        "trellis-dtype",
        "module",
        with_tensors(_trellis_fp16),
        error(f"{L0}.mlp.gate_proj.trellis: dtype F16, expected I16 (wrong dtype)"),
    ),
    Case(
        "suh-dtype",
        "module",
        with_tensors(_suh_fp32),
        error(f"{L0}.self_attn.o_proj.suh: dtype F32, expected F16 (wrong dtype)"),
    ),
    Case(
        "svh-missing",
        "module",
        with_tensors(drop("model.layers.3.self_attn.o_proj.svh")),
        error("model.layers.3.self_attn.o_proj.svh: missing tensor"),
    ),
    Case(
        "trellis-missing",
        "module",
        with_tensors(drop("model.layers.1.mlp.gate_proj.trellis")),
        error("model.layers.1.mlp.gate_proj.trellis: missing tensor"),
    ),
    Case(
        "k-not-multiple-of-128",
        "module",
        with_tensors(_narrow_module),
        error(
            f"{L0}.self_attn.k_proj.trellis: out_features n = 112 is not a multiple of "
            "128"
        ),
    ),
    Case(
        "both-markers",
        "module",
        with_tensors(_both_markers),
        error(f"{L0}.mlp.up_proj.mcg / {L0}.mlp.up_proj.mul1: both codebook markers"),
    ),
    Case(
        "marker-value",
        "module",
        with_tensors(_bad_marker, src=BASE_MCG),
        error(f"{L0}.mlp.up_proj.mcg", "marker value 7"),
    ),
    Case(
        "quantized-embedding",
        "module",
        with_tensors(_quantized_embedding),
        error("model.embed_tokens", "quantized token embedding"),
    ),
    # -- valid but unusual: must load everywhere --
    Case("sharded-with-index", "unusual", _index_for_sharded, Expect(LOADS)),
    Case("resaved-with-metadata", "unusual", _resaved_with_metadata, Expect(LOADS)),
    Case("no-quantization-config-json", "unusual", _no_quant_json, Expect(LOADS)),
    Case(
        "mixed-bitrates",
        "unusual",
        synthetic(
            "qwen3-tiny",
            layers=2,
            bits=3,
            codebook="mul1",
            bits_overrides={"*.k_proj": 2.5, "*.down_proj": 6, "*.q_proj": 5},
        ),
        Expect(LOADS),
    ),
    # Codebooks mixed inside one fused layer load too; config.json's single `codebook`
    # then disagrees with some modules, which is reported.
    Case(
        "mixed-codebooks",
        "unusual",
        synthetic(
            "qwen3-tiny",
            layers=2,
            bits=3,
            codebook="mul1",
            codebook_overrides={"*.v_proj": "mcg", "*.o_proj": "3inst"},
        ),
        warning(
            inspect=(
                "codebook = 'mul1' but 4 modules use another codebook: "
                "model.layers.0.self_attn.o_proj",
            ),
            dequantize=(
                "model.layers.0.self_attn.o_proj: config.json "
                "quantization_config.codebook = 'mul1', but its tensors are 3inst/mcg",
            ),
            vllm=(
                "model.layers.0.self_attn.o_proj: config.json "
                "quantization_config.codebook = 'mul1', but its tensors are 3inst/mcg",
            ),
        ),
    ),
    Case("padded-dims", "unusual", padded(), Expect(LOADS)),
    Case(
        "legacy-sign-bitfields",
        "unusual",
        synthetic("qwen3-tiny", layers=1, bits=2, codebook="mcg", legacy_signs=True),
        Expect(LOADS),
    ),
    # Each module's tensors describe it completely: layers of one kind need the same
    # modules, not the same tensor names.
    Case("one-module-legacy-signs", "unusual", _one_module_legacy_signs, Expect(LOADS)),
    Case(
        "module-from-another-conversion",
        "unusual",
        _module_from_another_conversion(),
        # config.json's single codebook and bits cannot describe the mix: reported,
        # the tensors decide.
        warning(
            inspect=(
                f"codebook = 'mcg' but 1 modules use another codebook: {MIXED_MODULE}",
            ),
            dequantize=(
                f"{MIXED_MODULE}: config.json quantization_config.codebook = 'mcg', "
                "but its tensors are mul1",
            ),
            vllm=(
                f"{MIXED_MODULE}: config.json quantization_config.codebook = 'mcg', "
                "but its tensors are mul1",
            ),
        ),
    ),
]
