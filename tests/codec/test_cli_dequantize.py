# SPDX-License-Identifier: Apache-2.0
"""`vllm-exl3 dequantize`: the written HF checkpoint loads in transformers and reproduces the
reconstructed model's perplexity; dtypes, padding trimming, copied files, progress and refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

import synthetic_checkpoint as synth
from fixture_paths import FIXTURES, TOKENIZER


def _assembled(tmp_path, ckpt: str):
    """The fixture as the converter left it: weights, configs and the tokenizer files."""
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / ckpt, src)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, src / f.name)
    return src


def test_dequantized_fixture_reproduces_reconstructed_perplexity(tmp_path, val_windows,
                                                                 reconstructed_ppl, capsys):
    from perplexity import perplexity
    from vllm_exl3.cli import main

    src, out = _assembled(tmp_path, "exl3-4.0bpw"), tmp_path / "out"
    assert main(["dequantize", str(src), str(out), "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert err.count("] model.layers.") == 28 and "[1/29] lm_head" in err  # progress lines
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float32"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not (out / "quantization_config.json").exists()

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ppl = perplexity(model, val_windows)
    assert ppl == pytest.approx(reconstructed_ppl("exl3-4.0bpw"), rel=1e-6)
    # And so, directly, the issue's acceptance: ExLlamaV3's own perplexity within 0.5%.
    from test_fixture_perplexity import TOLERANCE, recorded_perplexity
    assert abs(ppl / recorded_perplexity("exl3-4.0bpw") - 1) < TOLERANCE


def test_default_bfloat16_output(fmt, ref, tmp_path):
    from vllm_exl3.dequantize import dequantize

    out = tmp_path / "out"
    summary = dequantize(FIXTURES / "exl3-3.0bpw-mcg", out, progress=False)
    assert summary["exl3_modules"] == 29 and summary["shards"] == 1
    tensors = load_file(str(out / "model.safetensors"))
    original = load_file(str(FIXTURES / "bf16" / "model.safetensors"))
    assert set(tensors) == set(original)  # exactly the HF names of the source model
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    # EXL3 weights: the fp32 reconstruction rounded once to bf16; other tensors copied as is.
    index = fmt.read_safetensors_index(FIXTURES / "exl3-3.0bpw-mcg")
    spec = fmt.find_exl3_modules(index)["model.layers.1.mlp.down_proj"]
    w = fmt.load_module(FIXTURES / "exl3-3.0bpw-mcg", spec, index=index)
    expect = ref.reconstruct(w.trellis, w.suh, w.svh, w.codebook).t().to(torch.bfloat16)
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.weight"], expect)
    stored = fmt.read_tensor(FIXTURES / "exl3-3.0bpw-mcg", "model.norm.weight",
                             index["model.norm.weight"])
    assert torch.equal(tensors["model.norm.weight"], stored)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_padding_is_trimmed_to_real_dims(fmt, ref, tmp_path):
    from vllm_exl3.dequantize import dequantize

    src, out = tmp_path / "src", tmp_path / "out"
    synth.write_checkpoint("deepseek-v3-tiny", src, bits=3, codebook="mul1",
                           shard_size_bytes=1 << 20)
    summary = dequantize(src, out, dtype="float16", shard_mib=1, progress=False)
    assert summary["shards"] > 1 and (out / "model.safetensors.index.json").is_file()
    index = fmt.read_safetensors_index(out)
    a = "model.layers.1.self_attn"
    shapes = {n: index[n].shape for n in (
        "lm_head.weight", f"{a}.q_a_proj.weight", f"{a}.q_b_proj.weight",
        f"{a}.kv_a_proj_with_mqa.weight", f"{a}.kv_b_proj.weight", f"{a}.o_proj.weight",
        "model.layers.3.eh_proj.weight", "model.layers.2.mlp.experts.5.down_proj.weight",
        "model.embed_tokens.weight")}
    assert shapes == {
        "lm_head.weight": (4000, 256), f"{a}.q_a_proj.weight": (192, 256),
        f"{a}.q_b_proj.weight": (384, 192), f"{a}.kv_a_proj_with_mqa.weight": (160, 256),
        f"{a}.kv_b_proj.weight": (512, 128), f"{a}.o_proj.weight": (256, 256),
        "model.layers.3.eh_proj.weight": (256, 512),
        "model.layers.2.mlp.experts.5.down_proj.weight": (256, 128),
        "model.embed_tokens.weight": (4000, 256)}
    # The trimmed weight is the top-left block of the padded reconstruction.
    src_index = fmt.read_safetensors_index(src)
    spec = fmt.find_exl3_modules(src_index)[f"{a}.q_b_proj"]
    w = fmt.load_module(src, spec, index=src_index)
    full = ref.reconstruct(w.trellis, w.suh, w.svh, w.codebook)
    got = fmt.read_tensor(out, f"{a}.q_b_proj.weight", index[f"{a}.q_b_proj.weight"])
    assert torch.equal(got, full[:192, :384].t().half())
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float16"


def test_refusals(tmp_path):
    from vllm_exl3.dequantize import dequantize
    from vllm_exl3.errors import ToolError

    src = FIXTURES / "exl3-4.0bpw"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    with pytest.raises(ToolError, match="exists and is not empty"):
        dequantize(src, busy)
    with pytest.raises(ToolError, match="must differ"):
        dequantize(src, src)
    with pytest.raises(ToolError, match="no EXL3 tensors"):
        dequantize(FIXTURES / "bf16", tmp_path / "plain")
    with pytest.raises(ToolError, match="no config.json"):
        dequantize(tmp_path / "busy", tmp_path / "out")
