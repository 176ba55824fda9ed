# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The checkpoint format: the synthetic checkpoint writer produces the layout ExLlamaV3
writes and the reader and reference decode it; every malformed checkpoint is refused
with a message naming the offending tensor and the rule it breaks.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from vllm_exl3.testing import synthetic_checkpoint as synth
from vllm_exl3.testing.qwen3_tiny import FIXTURES


def test_qwen3_tiny_layout_equals_real_exllamav3_conversion(fmt, tmp_path):
    # Same config, rate and codebook as the real 3.0 bpw mcg conversion: every tensor
    # name, shape and dtype, the tensor_storage map and config.json must come out
    # identical.
    real = FIXTURES / "exl3-3.0bpw-mcg"
    synth.write_checkpoint(
        FIXTURES / "bf16" / "config.json", tmp_path, bits=3, codebook="mcg"
    )
    ours, theirs = (
        fmt.read_safetensors_index(tmp_path),
        fmt.read_safetensors_index(real),
    )
    assert {n: (e.dtype, e.shape) for n, e in ours.items()} == {
        n: (e.dtype, e.shape) for n, e in theirs.items()
    }
    q_ours = json.loads((tmp_path / "quantization_config.json").read_text())
    q_real = json.loads((real / "quantization_config.json").read_text())
    assert q_ours == q_real
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        (real / "config.json").read_text()
    )
    # No __metadata__ in the shard, as the converter writes it.
    raw = (tmp_path / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert "__metadata__" not in header


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"])
@pytest.mark.parametrize("bits,codebook", [(2, "3inst"), (3.5, "mul1"), (5, "mcg")])
def test_presets_read_and_decode(fmt, ref, tmp_path, preset, bits, codebook):
    written = synth.write_checkpoint(
        preset, tmp_path, bits=bits, codebook=codebook, layers=2, head_bits=4
    )
    index = fmt.read_safetensors_index(tmp_path)
    specs = fmt.find_exl3_modules(index)
    assert set(specs) == set(written)
    cb = synth.CODEBOOK_NAMES[codebook]
    for name, spec in specs.items():
        assert spec.codebook == cb, name
        assert spec.bits == (4 if name == "lm_head" else bits), name
    # Decode a few modules fully, including the padded lm_head.
    for name in ["lm_head", sorted(specs)[1], sorted(specs)[-1]]:
        w = fmt.load_module(tmp_path, specs[name], index=index)
        rec = ref.reconstruct(w.trellis, w.suh, w.svh, w.codebook)
        assert torch.isfinite(rec).all()
        rms = rec.pow(2).mean().sqrt().item()
        assert 0.005 < rms < 0.1, (name, rms)  # the intended ~0.02 weight scale


def test_moe_layout(fmt, tmp_path):
    synth.write_checkpoint("qwen3-moe-tiny", tmp_path, bits=4, layers=1)
    index = fmt.read_safetensors_index(tmp_path)
    specs = fmt.find_exl3_modules(index)
    for e in range(8):
        for proj, (k, n) in {
            "gate_proj": (256, 256),
            "up_proj": (256, 256),
            "down_proj": (256, 256),
        }.items():
            spec = specs[f"model.layers.0.mlp.experts.{e}.{proj}"]
            assert (spec.in_features, spec.out_features) == (k, n)
    assert index["model.layers.0.mlp.gate.weight"].dtype == "F16"
    assert index["model.layers.0.mlp.gate.weight"].shape == (8, 256)
    assert "model.layers.0.mlp.gate" not in specs
    assert index["model.layers.0.self_attn.q_norm.weight"].dtype == "BF16"


def test_mla_padding_and_mtp(fmt, ref, tmp_path):
    synth.write_checkpoint(
        "deepseek-v3-tiny", tmp_path, bits=3, codebook="mul1", mtp_bits=5
    )
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["mtp_bits"] == 5
    assert cfg["tie_word_embeddings"] is False
    index = fmt.read_safetensors_index(tmp_path)
    specs = fmt.find_exl3_modules(index)
    # lm_head: vocab 4000 padded to 4096, padded columns exactly zero (svh = 0).
    head = fmt.load_module(tmp_path, specs["lm_head"], index=index)
    w = ref.reconstruct(head.trellis, head.suh, head.svh, head.codebook)
    assert w.shape == (256, 4096)
    assert (w[:, 4000:] == 0).all() and (w[:, :4000].abs().sum(0) > 0).all()
    # MLA: q_a 256->192 (n padded to 256), q_b 192->384 (k padded), kv_a 256->160 (n
    # padded).
    a = "model.layers.0.self_attn"
    assert (
        specs[f"{a}.q_a_proj"].in_features,
        specs[f"{a}.q_a_proj"].out_features,
    ) == (256, 256)
    assert (
        specs[f"{a}.q_b_proj"].in_features,
        specs[f"{a}.q_b_proj"].out_features,
    ) == (256, 384)
    assert specs[f"{a}.kv_a_proj_with_mqa"].out_features == 256
    assert index[f"{a}.kv_b_proj.weight"].shape == (4 * (64 + 64), 128)
    assert index[f"{a}.kv_b_proj.weight"].dtype == "F16"
    # Layer 0 dense (first_k_dense_replace = 1), layers 1-2 MoE with a shared expert,
    # layer 3 the MTP layer at mtp_bits.
    assert "model.layers.0.mlp.gate_proj" in specs
    assert "model.layers.1.mlp.experts.7.down_proj" in specs
    assert "model.layers.1.mlp.shared_experts.up_proj" in specs
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in index
    assert specs["model.layers.3.eh_proj"].in_features == 512
    assert specs["model.layers.3.eh_proj"].bits == 5
    assert specs["model.layers.3.mlp.experts.0.up_proj"].bits == 5
    assert specs["model.layers.2.mlp.experts.0.up_proj"].bits == 3
    assert "model.layers.3.shared_head.norm.weight" in index

    no_mtp = tmp_path / "no-mtp"
    synth.write_checkpoint("deepseek-v3-tiny", no_mtp, bits=3, mtp=False)
    assert not any(
        n.startswith("model.layers.3.") for n in fmt.read_safetensors_index(no_mtp)
    )
    assert (
        "mtp_bits"
        not in json.loads((no_mtp / "config.json").read_text())["quantization_config"]
    )


def test_mixed_per_tensor_rates_and_codebooks(fmt, tmp_path):
    written = synth.write_checkpoint(
        "qwen3-moe-tiny",
        tmp_path,
        bits=4,
        codebook="mcg",
        layers=2,
        bits_overrides={"*.experts.*.down_proj": 6, "*.experts.*": 2.5, "*.q_proj": 1},
        codebook_overrides={
            "*.experts.*": "mul1",
            "model.layers.1.self_attn.*": "3inst",
        },
    )
    specs = fmt.find_exl3_modules(fmt.read_safetensors_index(tmp_path))
    storage = json.loads((tmp_path / "quantization_config.json").read_text())[
        "tensor_storage"
    ]
    expect = {
        "model.layers.0.mlp.experts.3.down_proj": (6, 2),
        "model.layers.1.mlp.experts.5.gate_proj": (2.5, 2),
        "model.layers.0.self_attn.q_proj": (1, 1),
        "model.layers.1.self_attn.q_proj": (1, 0),
        "model.layers.1.self_attn.o_proj": (4, 0),
        "model.layers.0.self_attn.k_proj": (4, 1),
        "lm_head": (6, 1),
    }
    for name, (bits, cb) in expect.items():
        assert (specs[name].bits, int(specs[name].codebook)) == (bits, cb), name
        assert written[name] == (bits, cb)
        entry = storage[name]
        assert entry["bits_per_weight"] == bits
        assert ("mcg_multiplier" in entry, "mul1_multiplier" in entry) == (
            cb == 1,
            cb == 2,
        )
    # config.json bits = the weighted average over the decoder linears (lm_head
    # excluded).
    q = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    decoder = [s for n, s in specs.items() if n != "lm_head"]
    avg = sum(s.bits * s.in_features * s.out_features for s in decoder) / sum(
        s.in_features * s.out_features for s in decoder
    )
    assert q["bits"] == round(avg, 2) and q["codebook"] == "mcg"


def test_invalid_rate_requests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="half rate 2.5 needs the mul1 codebook"):
        synth.write_checkpoint("qwen3-tiny", tmp_path, bits=2.5, codebook="mcg")
    with pytest.raises(ValueError, match="not an EXL3 rate"):
        synth.write_checkpoint(
            "qwen3-tiny", tmp_path / "b", bits=4, bits_overrides={"*.o_proj": 9}
        )


def test_shards_and_index_over_the_cap(fmt, tmp_path):
    synth.write_checkpoint("qwen3-tiny", tmp_path, bits=2, shard_size_bytes=400_000)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    entries = fmt.read_safetensors_index(tmp_path)
    assert set(index["weight_map"]) == set(entries)
    assert index["metadata"]["total_size"] == sum(
        (e.offsets[1] - e.offsets[0]) for e in entries.values()
    )
    # A module is never split across shards.
    for spec in fmt.find_exl3_modules(entries).values():
        assert len({entries[n].file for n in spec.tensor_names}) == 1


def test_legacy_signs_and_unquantized_head(fmt, ref, tmp_path):
    synth.write_checkpoint(
        "qwen3-tiny", tmp_path, bits=3, legacy_signs=True, head_bits=16, layers=1
    )
    index = fmt.read_safetensors_index(tmp_path)
    specs = fmt.find_exl3_modules(index)
    assert "lm_head" not in specs and index["lm_head.weight"].dtype == "F16"
    spec = specs["model.layers.0.self_attn.o_proj"]
    assert spec.legacy_signs
    w = fmt.load_module(tmp_path, spec, index=index)
    assert set(w.suh.unique().tolist()) <= {-1.0, 1.0}
    assert torch.isfinite(ref.reconstruct(w.trellis, w.suh, w.svh, w.codebook)).all()


def test_plan_of_qwen3_8b(tmp_path):
    from vllm_exl3.architecture import plan_model

    cfg = synth.load_config("qwen3-8b")
    plan = plan_model(cfg)
    dims = {s.name: (s.in_features, s.out_features) for s in plan.linears}
    assert dims["model.layers.35.self_attn.q_proj"] == (4096, 4096)
    assert dims["model.layers.0.self_attn.k_proj"] == (4096, 1024)
    assert dims["model.layers.0.mlp.down_proj"] == (12288, 4096)
    assert dims["lm_head"] == (4096, 151936)
    assert len(plan.linears) == 36 * 7 + 1


def test_plan_refuses_deepseek_v4():
    """Named as what it is, not by the first key the planner cannot place."""
    from vllm_exl3.architecture import PlanError, plan_model

    cfg = {
        "model_type": "deepseek_v4",
        "architectures": ["DeepseekV4ForCausalLM"],
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "vocab_size": 512,
        "index_topk": 16,
    }
    with pytest.raises(PlanError, match=r"DeepseekV4ForCausalLM.*not supported"):
        plan_model(cfg)


def test_script_mode(fmt, tmp_path):
    out = tmp_path / "ckpt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_exl3.testing.synthetic_checkpoint",
            "--config",
            "qwen3-moe-tiny",
            "--bits",
            "2.5",
            "--codebook",
            "mul1",
            "--layers",
            "1",
            "--bits-override",
            "*.down_proj=5",
            "--out",
            str(out),
            "--copy-from",
            str(FIXTURES / "tokenizer"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    specs = fmt.find_exl3_modules(fmt.read_safetensors_index(out))
    assert specs["model.layers.0.mlp.experts.0.down_proj"].bits == 5
    assert specs["model.layers.0.mlp.experts.0.up_proj"].bits == 2.5
    assert (out / "tokenizer.json").is_file()


# Every fail-closed rule of format.py: the error is an Exl3FormatError (a ValueError)
# whose message names the offending tensor and the rule it breaks.

P = "model.layers.0.mlp.down_proj"


def good(
    k: int = 256, n: int = 128, width: int = 64, marker: str | None = None
) -> dict:
    t = {
        "trellis": ((k // 16, n // 16, width), "I16"),
        "suh": ((k,), "F16"),
        "svh": ((n,), "F16"),
    }
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
    (
        "unexpected tensor",
        with_(good(), weight=((128, 256), "F16")),
        f"{P}.weight",
        "unexpected tensor",
    ),
    (
        "unknown suffix",
        with_(good(), zeros=((128,), "F16")),
        f"{P}.zeros",
        "unexpected tensor",
    ),
    (
        "quantized embedding",
        with_(good(), signs=((1, 256), "F16")),
        f"{P}.signs",
        "quantized token embedding",
    ),
    (
        "trellis dtype",
        with_(good(), trellis=((16, 8, 64), "F16")),
        f"{P}.trellis",
        "wrong dtype",
    ),
    (
        "trellis rank",
        with_(good(), trellis=((16, 512), "I16")),
        f"{P}.trellis",
        "wrong shape",
    ),
    ("suh dtype", with_(good(), suh=((256,), "F32")), f"{P}.suh", "wrong dtype"),
    ("suh length", with_(good(), suh=((128,), "F16")), f"{P}.suh", "wrong shape"),
    ("svh dtype", with_(good(), svh=((128,), "BF16")), f"{P}.svh", "wrong dtype"),
    ("svh length", with_(good(), svh=((256,), "F16")), f"{P}.svh", "wrong shape"),
    ("su dtype", with_(good(), suh=None, su=((16,), "F16")), f"{P}.su", "wrong dtype"),
    ("su length", with_(good(), suh=None, su=((8,), "I16")), f"{P}.su", "wrong shape"),
    ("sv length", with_(good(), svh=None, sv=((16,), "I16")), f"{P}.sv", "wrong shape"),
    ("bias dtype", with_(good(), bias=((128,), "I32")), f"{P}.bias", "wrong dtype"),
    ("bias length", with_(good(), bias=((256,), "F16")), f"{P}.bias", "wrong shape"),
    (
        "both markers",
        good(marker="mcg") | {"mul1": ((), "I32")},
        f"{P}.mcg / {P}.mul1",
        "both codebook markers",
    ),
    (
        "marker dtype",
        good(marker="mcg") | {"mcg": ((), "I16")},
        f"{P}.mcg",
        "wrong dtype",
    ),
    (
        "marker shape",
        good(marker="mul1") | {"mul1": ((1,), "I32")},
        f"{P}.mul1",
        "wrong shape",
    ),
    ("bitrate 9", good(width=144), f"{P}.trellis", "valid rates"),
    ("bitrate 0.5", good(width=8), f"{P}.trellis", "valid rates"),
    ("bitrate 1.25", good(width=20), f"{P}.trellis", "valid rates"),
    ("bitrate 4.5", good(width=72, marker="mul1"), f"{P}.trellis", "valid rates"),
    (
        "half rate with 3inst",
        good(width=40),
        f"{P}.trellis",
        "half rates are MUL1 only",
    ),
    (
        "half rate with mcg",
        good(width=24, marker="mcg"),
        f"{P}.trellis",
        "half rates are MUL1 only",
    ),
    ("k not multiple of 128", good(k=192), f"{P}.trellis", "not a multiple of 128"),
    ("n not multiple of 128", good(n=64), f"{P}.trellis", "not a multiple of 128"),
]


@pytest.mark.parametrize(
    "tensors,name,rule", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
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
    assert set(spec.tensor_names) == {
        f"{P}.{s}" for s in ("trellis", "suh", "svh", "bias")
    } | ({f"{P}.{marker}"} if marker else set())


@pytest.mark.parametrize(
    "width,bits", [(16, 1), (24, 1.5), (40, 2.5), (56, 3.5), (128, 8)]
)
def test_bits_from_trellis_width(fmt, width, bits):
    assert fmt.bits_from_trellis_width(width, "x") == bits


def test_legacy_bitfields_stand_in_for_scales(fmt):
    spec = fmt.module_spec(
        P, with_(good(), suh=None, svh=None, su=((16,), "I16"), sv=((8,), "I16"))
    )
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
    t = {
        f"{prefix}.trellis": torch.zeros(16, 8, 64, dtype=torch.int16),
        f"{prefix}.suh": torch.ones(256, dtype=torch.float16),
        f"{prefix}.svh": torch.ones(128, dtype=torch.float16),
    }
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
        specs = {
            d: fmt.find_exl3_modules(fmt.read_safetensors_index(tmp_path / d))[P]
            for d in ("plain", "scaled")
        }
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
    (tmp_path / "model.safetensors").rename(
        tmp_path / "model-00001-of-00001.safetensors"
    )
    index = {
        "metadata": {},
        "weight_map": {
            f"{P}.trellis": "model-00001-of-00001.safetensors",
            f"{P}.suh": "model-00001-of-00001.safetensors",
            f"{P}.svh": "model-00001-of-00001.safetensors",
            "lm_head.trellis": "model-00001-of-00001.safetensors",
        },
    }
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
        ref.reconstruct(
            trellis,
            torch.ones(128, dtype=torch.float16),
            torch.ones(128, dtype=torch.float16),
            0,
        )
    with pytest.raises(ValueError, match="trellis"):
        ref.decode_rotated(trellis.float(), 0)
