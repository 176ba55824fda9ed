# SPDX-License-Identifier: Apache-2.0
"""Every fail-closed rule of format.py: the error is an Exl3FormatError (a ValueError) whose
message names the offending tensor and the rule it breaks."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

P = "model.layers.0.mlp.down_proj"


def good(k: int = 256, n: int = 128, width: int = 64, marker: str | None = None) -> dict:
    t = {"trellis": ((k // 16, n // 16, width), "I16"), "suh": ((k,), "F16"),
         "svh": ((n,), "F16")}
    if marker:
        t[marker] = ((), "I32")
    return t


def with_(base: dict, **changes) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key)
        else:
            out[key] = value
    return out


# (case id, tensors, tensor named in the message, rule phrase in the message)
CASES = [
    ("missing trellis", with_(good(), trellis=None), f"{P}.trellis", "missing tensor"),
    ("missing suh and su", with_(good(), suh=None), f"{P}.suh", "missing tensor"),
    ("missing svh and sv", with_(good(), svh=None), f"{P}.svh", "missing tensor"),
    ("unexpected tensor", with_(good(), weight=((128, 256), "F16")), f"{P}.weight",
     "unexpected tensor"),
    ("unknown suffix", with_(good(), zeros=((128,), "F16")), f"{P}.zeros", "unexpected tensor"),
    ("quantized embedding", with_(good(), signs=((1, 256), "F16")), f"{P}.signs",
     "not supported"),
    ("trellis dtype", with_(good(), trellis=((16, 8, 64), "F16")), f"{P}.trellis",
     "wrong dtype"),
    ("trellis rank", with_(good(), trellis=((16, 512), "I16")), f"{P}.trellis", "wrong shape"),
    ("suh dtype", with_(good(), suh=((256,), "F32")), f"{P}.suh", "wrong dtype"),
    ("suh length", with_(good(), suh=((128,), "F16")), f"{P}.suh", "wrong shape"),
    ("svh dtype", with_(good(), svh=((128,), "BF16")), f"{P}.svh", "wrong dtype"),
    ("svh length", with_(good(), svh=((256,), "F16")), f"{P}.svh", "wrong shape"),
    ("su dtype", with_(good(), suh=None, su=((16,), "F16")), f"{P}.su", "wrong dtype"),
    ("su length", with_(good(), suh=None, su=((8,), "I16")), f"{P}.su", "wrong shape"),
    ("sv length", with_(good(), svh=None, sv=((16,), "I16")), f"{P}.sv", "wrong shape"),
    ("bias dtype", with_(good(), bias=((128,), "I32")), f"{P}.bias", "wrong dtype"),
    ("bias length", with_(good(), bias=((256,), "F16")), f"{P}.bias", "wrong shape"),
    ("both markers", good(marker="mcg") | {"mul1": ((), "I32")}, f"{P}.mcg / {P}.mul1",
     "both codebook markers"),
    ("marker dtype", good(marker="mcg") | {"mcg": ((), "I16")}, f"{P}.mcg", "wrong dtype"),
    ("marker shape", good(marker="mul1") | {"mul1": ((1,), "I32")}, f"{P}.mul1", "wrong shape"),
    ("bitrate 9", good(width=144), f"{P}.trellis", "valid rates"),
    ("bitrate 0.5", good(width=8), f"{P}.trellis", "valid rates"),
    ("bitrate 1.25", good(width=20), f"{P}.trellis", "valid rates"),
    ("bitrate 4.5", good(width=72, marker="mul1"), f"{P}.trellis", "valid rates"),
    ("half rate with 3inst", good(width=40), f"{P}.trellis", "half rates are MUL1 only"),
    ("half rate with mcg", good(width=24, marker="mcg"), f"{P}.trellis",
     "half rates are MUL1 only"),
    ("k not multiple of 128", good(k=192), f"{P}.trellis", "not a multiple of 128"),
    ("n not multiple of 128", good(n=64), f"{P}.trellis", "not a multiple of 128"),
]


@pytest.mark.parametrize("tensors,name,rule", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_module_spec_fails_closed(fmt, tensors, name, rule):
    with pytest.raises(fmt.Exl3FormatError) as info:
        fmt.module_spec(P, tensors)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert message.startswith(name), message
    assert rule in message, message


@pytest.mark.parametrize("marker,codebook", [(None, 0), ("mcg", 1), ("mul1", 2)])
def test_module_spec_accepts_valid(fmt, marker, codebook):
    spec = fmt.module_spec(P, good(marker=marker) | {"bias": ((128,), "F32")})
    assert (spec.in_features, spec.out_features, spec.bits) == (256, 128, 4)
    assert spec.codebook == codebook and spec.has_bias and not spec.legacy_signs
    assert set(spec.tensor_names) == {f"{P}.{s}" for s in ("trellis", "suh", "svh", "bias")} | (
        {f"{P}.{marker}"} if marker else set())


@pytest.mark.parametrize("width,bits", [(16, 1), (24, 1.5), (40, 2.5), (56, 3.5), (128, 8)])
def test_bits_from_trellis_width(fmt, width, bits):
    assert fmt.bits_from_trellis_width(width, "x") == bits


def test_legacy_bitfields_stand_in_for_scales(fmt):
    spec = fmt.module_spec(P, with_(good(), suh=None, svh=None, su=((16,), "I16"),
                                    sv=((8,), "I16")))
    assert spec.legacy_signs


def test_legacy_next_to_full_scales_is_ignored_with_warning(fmt, caplog):
    with caplog.at_level(logging.WARNING):
        spec = fmt.module_spec(P, good() | {"su": ((16,), "I16")})
    assert not spec.legacy_signs
    assert f"{P}.su is ignored" in caplog.text


def _write(path, tensors: dict[str, torch.Tensor]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))


def _module(prefix: str = P, **extra: torch.Tensor) -> dict[str, torch.Tensor]:
    t = {f"{prefix}.trellis": torch.zeros(16, 8, 64, dtype=torch.int16),
         f"{prefix}.suh": torch.ones(256, dtype=torch.float16),
         f"{prefix}.svh": torch.ones(128, dtype=torch.float16)}
    t.update({f"{prefix}.{k}": v for k, v in extra.items()})
    return t


@pytest.mark.parametrize("marker,value", [("mcg", 0), ("mul1", -877912083), ("mcg", 1)])
def test_wrong_marker_value(fmt, tmp_path, marker, value):
    _write(tmp_path, _module(**{marker: torch.tensor(value, dtype=torch.int32)}))
    index = fmt.read_safetensors_index(tmp_path)
    spec = fmt.find_exl3_modules(index)[P]
    with pytest.raises(fmt.Exl3FormatError) as info:
        fmt.load_module(tmp_path, spec, index=index)
    assert str(info.value).startswith(f"{P}.{marker}: marker value {value}")
    assert "wrong codebook marker value" in str(info.value)


def test_orphan_exl3_tensor_without_trellis(fmt, tmp_path):
    tensors = _module()
    del tensors[f"{P}.trellis"]
    _write(tmp_path, tensors)
    with pytest.raises(fmt.Exl3FormatError, match=rf"^{P}\.trellis: missing tensor"):
        fmt.find_exl3_modules(fmt.read_safetensors_index(tmp_path))


def test_scale_tensor_warns_and_is_not_applied(fmt, ref, tmp_path, caplog):
    plain = _module()
    scaled = _module(scale=torch.tensor([4.0]))
    _write(tmp_path / "plain", plain)
    _write(tmp_path / "scaled", scaled)
    with caplog.at_level(logging.WARNING):
        specs = {d: fmt.find_exl3_modules(fmt.read_safetensors_index(tmp_path / d))[P]
                 for d in ("plain", "scaled")}
    assert f"{P}.scale is present but not applied" in caplog.text
    w = {d: fmt.load_module(tmp_path / d, s) for d, s in specs.items()}
    a = ref.reconstruct(w["plain"].trellis, w["plain"].suh, w["plain"].svh, 0)
    b = ref.reconstruct(w["scaled"].trellis, w["scaled"].suh, w["scaled"].svh, 0)
    assert torch.equal(a, b)


def test_legacy_bitfields_load_as_signs(fmt, ref, tmp_path):
    su = torch.tensor([0x0005] + [0] * 15, dtype=torch.int16)
    sv = torch.tensor([-1] * 8, dtype=torch.int16)  # every output sign negative
    tensors = _module(su=su, sv=sv)
    del tensors[f"{P}.suh"], tensors[f"{P}.svh"]
    _write(tmp_path, tensors)
    spec = fmt.find_exl3_modules(fmt.read_safetensors_index(tmp_path))[P]
    w = fmt.load_module(tmp_path, spec)
    assert spec.legacy_signs and w.suh.dtype == torch.float16
    assert w.suh[:3].tolist() == [-1.0, 1.0, -1.0] and (w.suh[3:] == 1).all()
    assert (w.svh == -1).all()


def test_index_pointing_at_missing_shard_data(fmt, tmp_path):
    _write(tmp_path, _module())
    (tmp_path / "model.safetensors").rename(tmp_path / "model-00001-of-00001.safetensors")
    index = {"metadata": {}, "weight_map": {f"{P}.trellis": "model-00001-of-00001.safetensors",
                                            f"{P}.suh": "model-00001-of-00001.safetensors",
                                            f"{P}.svh": "model-00001-of-00001.safetensors",
                                            "lm_head.trellis": "model-00001-of-00001.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(fmt.Exl3FormatError, match=r"^lm_head\.trellis: listed in"):
        fmt.read_safetensors_index(tmp_path)


def test_truncated_file(fmt, tmp_path):
    _write(tmp_path, _module())
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    # Named from the header alone, before any tensor is read.
    with pytest.raises(fmt.Exl3FormatError, match=rf"tensor {P}\.\w+: truncated"):
        fmt.read_safetensors_index(tmp_path)


def test_reference_rejects_mismatched_scales(ref):
    trellis = torch.zeros(16, 8, 32, dtype=torch.int16)
    with pytest.raises(ValueError, match="suh"):
        ref.reconstruct(trellis, torch.ones(128, dtype=torch.float16),
                        torch.ones(128, dtype=torch.float16), 0)
    with pytest.raises(ValueError, match="trellis"):
        ref.decode_rotated(trellis.float(), 0)
