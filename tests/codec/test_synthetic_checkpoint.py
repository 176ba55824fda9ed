# SPDX-License-Identifier: Apache-2.0
"""The synthetic EXL3 checkpoint writer (tests/synthetic_checkpoint.py): its output has exactly
the layout ExLlamaV3 writes (checked against a real conversion), the reader accepts it, the
reference decodes it, and per-tensor rates/codebooks come out as requested."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import synthetic_checkpoint as synth
from fixture_paths import FIXTURES, REPO


def test_qwen3_tiny_layout_equals_real_exllamav3_conversion(fmt, tmp_path):
    # Same config, rate and codebook as the real 3.0 bpw mcg conversion: every tensor name,
    # shape and dtype, the tensor_storage map and config.json must come out identical.
    real = FIXTURES / "exl3-3.0bpw-mcg"
    synth.write_checkpoint(FIXTURES / "bf16" / "config.json", tmp_path, bits=3, codebook="mcg")
    ours, theirs = fmt.read_safetensors_index(tmp_path), fmt.read_safetensors_index(real)
    assert {n: (e.dtype, e.shape) for n, e in ours.items()} == {
        n: (e.dtype, e.shape) for n, e in theirs.items()}
    q_ours = json.loads((tmp_path / "quantization_config.json").read_text())
    q_real = json.loads((real / "quantization_config.json").read_text())
    assert q_ours == q_real
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        (real / "config.json").read_text())
    # No __metadata__ in the shard, as the converter writes it.
    raw = (tmp_path / "model.safetensors").read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert "__metadata__" not in header


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"])
@pytest.mark.parametrize("bits,codebook", [(2, "3inst"), (3.5, "mul1"), (5, "mcg")])
def test_presets_read_and_decode(fmt, ref, tmp_path, preset, bits, codebook):
    written = synth.write_checkpoint(preset, tmp_path, bits=bits, codebook=codebook,
                                     layers=2, head_bits=4)
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
        for proj, (k, n) in {"gate_proj": (256, 256), "up_proj": (256, 256),
                             "down_proj": (256, 256)}.items():
            spec = specs[f"model.layers.0.mlp.experts.{e}.{proj}"]
            assert (spec.in_features, spec.out_features) == (k, n)
    assert index["model.layers.0.mlp.gate.weight"].dtype == "F16"
    assert index["model.layers.0.mlp.gate.weight"].shape == (8, 256)
    assert "model.layers.0.mlp.gate" not in specs
    assert index["model.layers.0.self_attn.q_norm.weight"].dtype == "BF16"


def test_mla_padding_and_mtp(fmt, ref, tmp_path):
    synth.write_checkpoint("deepseek-v3-tiny", tmp_path, bits=3, codebook="mul1", mtp_bits=5)
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
    # MLA: q_a 256->192 (n padded to 256), q_b 192->384 (k padded), kv_a 256->160 (n padded).
    a = "model.layers.0.self_attn"
    assert (specs[f"{a}.q_a_proj"].in_features, specs[f"{a}.q_a_proj"].out_features) == (256, 256)
    assert (specs[f"{a}.q_b_proj"].in_features, specs[f"{a}.q_b_proj"].out_features) == (256, 384)
    assert specs[f"{a}.kv_a_proj_with_mqa"].out_features == 256
    assert index[f"{a}.kv_b_proj.weight"].shape == (4 * (64 + 64), 128)
    assert index[f"{a}.kv_b_proj.weight"].dtype == "F16"
    # Layer 0 dense (first_k_dense_replace = 1), layers 1-2 MoE with a shared expert, layer 3
    # the MTP layer at mtp_bits.
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
    assert not any(n.startswith("model.layers.3.") for n in fmt.read_safetensors_index(no_mtp))
    assert "mtp_bits" not in json.loads((no_mtp / "config.json").read_text())[
        "quantization_config"]


def test_mixed_per_tensor_rates_and_codebooks(fmt, tmp_path):
    written = synth.write_checkpoint(
        "qwen3-moe-tiny", tmp_path, bits=4, codebook="mcg", layers=2,
        bits_overrides={"*.experts.*.down_proj": 6, "*.experts.*": 2.5, "*.q_proj": 1},
        codebook_overrides={"*.experts.*": "mul1", "model.layers.1.self_attn.*": "3inst"})
    specs = fmt.find_exl3_modules(fmt.read_safetensors_index(tmp_path))
    storage = json.loads((tmp_path / "quantization_config.json").read_text())["tensor_storage"]
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
        assert ("mcg_multiplier" in entry, "mul1_multiplier" in entry) == (cb == 1, cb == 2)
    # config.json bits = the weighted average over the decoder linears (lm_head excluded).
    q = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    decoder = [s for n, s in specs.items() if n != "lm_head"]
    avg = sum(s.bits * s.in_features * s.out_features for s in decoder) / sum(
        s.in_features * s.out_features for s in decoder)
    assert q["bits"] == round(avg, 2) and q["codebook"] == "mcg"


def test_invalid_rate_requests_are_refused(tmp_path):
    with pytest.raises(ValueError, match="half rate 2.5 needs the mul1 codebook"):
        synth.write_checkpoint("qwen3-tiny", tmp_path, bits=2.5, codebook="mcg")
    with pytest.raises(ValueError, match="not an EXL3 rate"):
        synth.write_checkpoint("qwen3-tiny", tmp_path / "b", bits=4,
                               bits_overrides={"*.o_proj": 9})


def test_shards_and_index_over_the_cap(fmt, tmp_path):
    synth.write_checkpoint("qwen3-tiny", tmp_path, bits=2, shard_size_bytes=400_000)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    entries = fmt.read_safetensors_index(tmp_path)
    assert set(index["weight_map"]) == set(entries)
    assert index["metadata"]["total_size"] == sum(
        (e.offsets[1] - e.offsets[0]) for e in entries.values())
    # A module is never split across shards.
    for spec in fmt.find_exl3_modules(entries).values():
        assert len({entries[n].file for n in spec.tensor_names}) == 1


def test_legacy_signs_and_unquantized_head(fmt, ref, tmp_path):
    synth.write_checkpoint("qwen3-tiny", tmp_path, bits=3, legacy_signs=True, head_bits=16,
                           layers=1)
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


def test_script_mode(fmt, tmp_path):
    out = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "synthetic_checkpoint.py"), "--config",
         "qwen3-moe-tiny", "--bits", "2.5", "--codebook", "mul1", "--layers", "1",
         "--bits-override", "*.down_proj=5", "--out", str(out), "--copy-from",
         str(FIXTURES / "tokenizer")],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    specs = fmt.find_exl3_modules(fmt.read_safetensors_index(out))
    assert specs["model.layers.0.mlp.experts.0.down_proj"].bits == 5
    assert specs["model.layers.0.mlp.experts.0.up_proj"].bits == 2.5
    assert (out / "tokenizer.json").is_file()
