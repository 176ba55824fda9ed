# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The `vllm-exl3` codec commands on the fixture checkpoints: `inspect` (tensor-parallel
blockers named, every disagreement between the JSON files and the tensors reported) and
`dequantize` (the reconstructed model's perplexity; dtypes, padding trimming, copied
files, progress and refusals).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from vllm_exl3 import ToolError, inspect_ckpt
from vllm_exl3.cli import main
from vllm_exl3.dequantize import dequantize
from vllm_exl3.testing import synthetic_checkpoint as synth
from vllm_exl3.testing.fixtures import CLI, TOKENIZER
from vllm_exl3.testing.qwen3_tiny import (
    EXL3_FIXTURES,
    FIXTURES,
    TOLERANCE,
    perplexity,
    recorded_perplexity,
)


@pytest.fixture(scope="module")
def inspect_mod():
    return inspect_ckpt


def _recorded_storage(ckpt: str) -> tuple[float, float]:
    """(decoder, head) bits per weight incl. suh/svh as ExLlamaV3 measured them."""
    runs = json.loads((FIXTURES / "ppl_exllamav3_dense.json").read_text())
    (run,) = [r for r in runs if r["label"] == ckpt]
    layers, head, _ = (float(v) for v in run["storage"].strip("()").split(","))
    return layers, head


@pytest.mark.parametrize("ckpt", sorted(EXL3_FIXTURES))
def test_fixture_report(inspect_mod, ckpt):
    decoder_bits, head_bits, codebook = EXL3_FIXTURES[ckpt]
    report = inspect_mod.inspect_checkpoint(FIXTURES / ckpt)
    assert report["errors"] == [] and report["disagreements"] == []
    modules = {m["name"]: m for m in report["modules"]}
    assert len(modules) == 29
    for name, m in modules.items():
        assert m["bits"] == (head_bits if name == "lm_head" else decoder_bits), name
        assert m["codebook"] == codebook, name
    q = modules["model.layers.2.self_attn.k_proj"]
    assert (q["in_features"], q["out_features"], q["trellis_shape"]) == (
        256,
        128,
        [16, 8, 16 * decoder_bits],
    )
    assert q["fused_group"] == "model.layers.2.self_attn.qkv_proj"
    assert (
        modules["model.layers.0.mlp.up_proj"]["fused_group"]
        == "model.layers.0.mlp.gate_up_proj"
    )
    assert (
        modules["model.layers.0.mlp.down_proj"]["fused_group"]
        == "model.layers.0.mlp.down_proj"
    )
    plain = {u["name"] for u in report["unquantized"]}
    assert "model.embed_tokens" in plain and "model.layers.3.self_attn.k_norm" in plain
    # Storage per weight incl. the fp16 scale vectors equals ExLlamaV3's own accounting.
    layers, head = _recorded_storage(ckpt)
    groups = report["totals"]["by_group"]
    assert groups["decoder"]["storage_bits_per_weight"] == pytest.approx(
        layers, rel=1e-12
    )
    assert groups["head"]["storage_bits_per_weight"] == pytest.approx(head, rel=1e-12)
    assert groups["decoder"]["bits_per_weight"] == decoder_bits
    size = (FIXTURES / ckpt / "model.safetensors").stat().st_size
    assert 0 < size - report["totals"]["total_bytes"] < 20_000  # all but the header
    tp = report["tensor_parallel"]
    assert tp["1"] == {
        "ok": True,
        "blockers": [],
        "partial_blocks": [],
        "redundant_compute": 0.0,
    }
    # k/v have 2 heads x 64: each rank owns half a Hadamard block and computes all of
    # it.
    assert tp["2"]["ok"] and tp["2"]["blockers"] == []
    assert tp["2"]["partial_blocks"] == [
        {
            "module": f"model.layers.{i}.self_attn.{p}",
            "returned_columns": 64,
            "computed_columns": 128,
        }
        for i in range(4)
        for p in ("k_proj", "v_proj")
    ]
    # Per layer and rank: q 256x128, k/v 256x64 (computed 256x128), o 128x256, gate/up
    # 256x384, down 384x256; lm_head 256x2048: 4 * 2 * 256*64 extra over 2097152
    # returned.
    assert tp["2"]["redundant_compute"] == 4 * 2 * 256 * 64 / 2097152
    # o_proj and down_proj: k/4 = 64 and 192 rows per rank cut Hadamard blocks of x.
    assert not tp["4"]["ok"]
    rules = {b["module"]: b["rule"] for b in tp["4"]["blockers"]}
    assert rules["model.layers.0.self_attn.o_proj"].startswith(
        "row-parallel input slice of 64 features is not a multiple of 128"
    )
    assert rules["model.layers.0.mlp.down_proj"].startswith(
        "row-parallel input slice of 192 features"
    )


def test_headers_only(inspect_mod, monkeypatch):
    """Without --values inspect reads the 4-byte markers only (through the verdict's
    shared reader), and its verdict says the scales were not read."""
    read = []
    original = inspect_mod.checkpoint.read_tensor
    monkeypatch.setattr(
        inspect_mod.checkpoint,
        "read_tensor",
        lambda d, name, e, device="cpu": read.append(name) or original(d, name, e),
    )
    report = inspect_mod.inspect_checkpoint(FIXTURES / "exl3-3.0bpw-mcg")
    assert len(read) == 29 and all(n.endswith(".mcg") for n in read)
    assert report["values_checked"] is False
    assert "suh/svh values NOT read" in inspect_mod.format_text(report)
    read.clear()
    report = inspect_mod.inspect_checkpoint(FIXTURES / "exl3-3.0bpw-mcg", values=True)
    assert len(read) == 3 * 29 and report["values_checked"] is True
    text = inspect_mod.format_text(report)
    assert "verdict: no problems found" in text and "NOT read" not in text


def test_json_mode_through_the_tool():
    proc = subprocess.run(
        [
            sys.executable,
            str(CLI),
            "inspect",
            "--json",
            str(FIXTURES / "exl3-3.0bpw-mcg"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    bits = {m["name"]: (m["bits"], m["codebook"]) for m in report["modules"]}
    assert bits["lm_head"] == (6, "mcg")
    assert bits["model.layers.1.mlp.gate_proj"] == (3, "mcg")
    assert report["tensor_parallel"]["2"]["ok"]


def test_text_mode(capsys):
    assert main(["inspect", str(FIXTURES / "exl3-4.0bpw")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.0.self_attn.q_proj" in out and "qkv_proj" in out
    assert "3inst" in out and "tp=1: ok\n" in out
    assert (
        "tp=2: ok; partial 128-blocks in 8 modules (model.layers.0.self_attn.k_proj, "
        "model.layers.0.self_attn.v_proj, model.layers.1.self_attn.k_proj and 5 more): "
        "+6.2% weights decoded on the busiest rank"
    ) in out
    assert "tp=4: blocked by" in out
    assert "4.0990 with scales" in out
    assert "agree with the tensors" in out


def test_disagreements_are_reported(inspect_mod, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "exl3-4.0bpw", ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"].update(codebook="mul1", bits=3.0, head_bits=8)
    (ckpt / "config.json").write_text(json.dumps(cfg))
    qjson = json.loads((ckpt / "quantization_config.json").read_text())
    storage = qjson["tensor_storage"]
    storage["model.layers.1.mlp.up_proj"]["bits_per_weight"] = 5
    storage["model.layers.2.self_attn.o_proj"]["mcg_multiplier"] = 3417055213
    del storage["model.layers.3.mlp.down_proj"]
    storage["model.layers.0.self_attn.q_proj"]["stored_tensors"][
        "model.layers.0.self_attn.q_proj.suh"
    ]["shape"] = [512]
    (ckpt / "quantization_config.json").write_text(json.dumps(qjson))

    found = "\n".join(inspect_mod.inspect_checkpoint(ckpt)["disagreements"])
    assert "codebook = 'mul1' but 29 modules use another codebook" in found
    assert "bits = 3.0 but the decoder linears average 4.0000" in found
    assert "head_bits = 8 but lm_head.trellis holds 6 bits" in found
    assert (
        "bits_per_weight differs from the trellis: "
        "model.layers.1.mlp.up_proj (5 listed, 4"
    ) in found
    assert (
        "codebook differs from the marker tensors: "
        "model.layers.2.self_attn.o_proj (mcg listed, 3inst stored)"
    ) in found
    assert "missing from tensor_storage: model.layers.3.mlp.down_proj" in found
    assert "model.layers.0.self_attn.q_proj.suh (listed torch.float16 [512]" in found
    assert (
        "quantization_config.json and config.json disagree on "
        "['bits', 'codebook', 'head_bits']"
    ) in found


def test_quantized_embedding_is_reported_not_an_error(inspect_mod, tmp_path):
    synth.write_checkpoint("qwen3-tiny", tmp_path, layers=1, bits=4, embed_bits=3)
    report = inspect_mod.inspect_checkpoint(tmp_path)
    assert report["errors"] == []
    (note,) = [n for n in report["notes"] if n.startswith("model.embed_tokens:")]
    assert "quantized token embedding (--embed_bits 3)" in note
    assert not any(u["name"] == "model.embed_tokens" for u in report["unquantized"])


def test_missing_modules_and_missing_json(inspect_mod, tmp_path):
    synth.write_checkpoint("qwen3-tiny", tmp_path, bits=2, layers=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "quantization_config.json").unlink()
    found = "\n".join(inspect_mod.inspect_checkpoint(tmp_path)["disagreements"])
    assert (
        "config.json implies modules missing from the checkpoint: model.layers.2."
        in found
    )
    assert "quantization_config.json: missing" in found


def test_tensor_parallel_blockers_name_the_module(inspect_mod, tmp_path):
    cfg = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 1,
        "vocab_size": 1000,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 256,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    synth.write_checkpoint(cfg, tmp_path, bits=2, codebook="mul1", head_bits=2)
    report = inspect_mod.inspect_checkpoint(tmp_path)
    assert report["disagreements"] == [] and report["errors"] == []
    tp = report["tensor_parallel"]
    assert tp["1"]["ok"] and tp["2"]["ok"]
    blockers = tp["4"]["blockers"]
    assert blockers and all(".mlp.experts." in b["module"] for b in blockers)
    assert any(
        b["rule"].startswith("column-parallel n/tp = 256/4 = 64") for b in blockers
    )
    assert any(
        b["rule"].startswith("row-parallel input slice of 64 features")
        for b in blockers
    )
    assert tp["8"]["blockers"]
    # The synthetic checkpoint untied the head like the converter does; vocab 1000 is
    # padded.
    assert (
        json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"]
        is False
    )
    head = next(m for m in report["modules"] if m["name"] == "lm_head")
    assert (head["out_features"], head["real_out_features"]) == (1024, 1000)


def test_replicated_kv_heads_run_with_partial_blocks(inspect_mod, tmp_path):
    """8 heads, 2 KV heads x 64: at tp=4 each KV head is replicated on two ranks, each
    rank computes the head's whole block; at tp=8 o_proj's k/8 = 64 rows cut a block of
    x."""
    cfg = {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 1,
        "vocab_size": 1000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    synth.write_checkpoint(cfg, tmp_path, bits=2, codebook="mul1", head_bits=2)
    tp = inspect_mod.inspect_checkpoint(tmp_path)["tensor_parallel"]
    assert tp["4"]["ok"]
    partial = {
        p["module"]: (p["returned_columns"], p["computed_columns"])
        for p in tp["4"]["partial_blocks"]
    }
    # lm_head: vocab 1000 padded to 1024 by vLLM, 256 per rank, whole blocks.
    assert partial == {
        "model.layers.0.self_attn.k_proj": (64, 128),
        "model.layers.0.self_attn.v_proj": (64, 128),
    }
    assert tp["8"]["blockers"][0]["module"] == "model.layers.0.self_attn.o_proj"
    assert tp["8"]["blockers"][0]["rule"].startswith(
        "row-parallel input slice of 64 features"
    )


def test_format_errors_are_reported_with_exit_code(inspect_mod, tmp_path, capsys):
    synth.write_checkpoint("qwen3-tiny", tmp_path, bits=2, codebook="mul1", layers=1)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.mul1"] = torch.tensor(7, dtype=torch.int32)
    tensors["model.layers.0.self_attn.o_proj.suh"] = torch.ones(
        256, dtype=torch.float32
    )
    save_file(tensors, str(tmp_path / "model.safetensors"))
    report = inspect_mod.inspect_checkpoint(tmp_path)
    assert any(
        e.startswith("model.layers.0.mlp.up_proj.mul1: marker value 7")
        for e in report["errors"]
    )
    assert any(
        e.startswith("model.layers.0.self_attn.o_proj.suh: dtype F32")
        and "wrong dtype" in e
        for e in report["errors"]
    )
    assert main(["inspect", str(tmp_path)]) == 1
    assert "errors (format rules broken)" in capsys.readouterr().out


# `vllm-exl3 dequantize`: the written HF checkpoint loads in transformers and reproduces
# the reconstructed model's perplexity; dtypes, padding trimming, copied files, progress
# and refusals.


def _assembled(tmp_path, ckpt: str):
    """The fixture as the converter left it: weights, configs and the tokenizer
    files.
    """
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / ckpt, src)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, src / f.name)
    return src


def test_dequantized_fixture_reproduces_reconstructed_perplexity(
    tmp_path, val_windows, reconstructed_ppl, capsys
):
    src, out = _assembled(tmp_path, "exl3-4.0bpw"), tmp_path / "out"
    assert main(["dequantize", str(src), str(out), "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert (
        err.count("] model.layers.") == 28 and "[1/29] lm_head" in err
    )  # progress lines
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["torch_dtype"] == "float32"
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert not (out / "quantization_config.json").exists()

    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ppl = perplexity(model, val_windows)
    assert ppl == pytest.approx(reconstructed_ppl("exl3-4.0bpw"), rel=1e-6)
    # And so, directly, the issue's acceptance: ExLlamaV3's own perplexity within 0.5%.

    assert abs(ppl / recorded_perplexity("exl3-4.0bpw") - 1) < TOLERANCE


def test_default_bfloat16_output(fmt, ref, tmp_path):
    out = tmp_path / "out"
    summary = dequantize(FIXTURES / "exl3-3.0bpw-mcg", out, progress=False)
    assert summary["exl3_modules"] == 29 and summary["shards"] == 1
    tensors = load_file(str(out / "model.safetensors"))
    original = load_file(str(FIXTURES / "bf16" / "model.safetensors"))
    assert set(tensors) == set(original)  # exactly the HF names of the source model
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    # EXL3 weights: the fp32 reconstruction rounded once to bf16; other tensors copied
    # as is.
    index = fmt.read_safetensors_index(FIXTURES / "exl3-3.0bpw-mcg")
    spec = fmt.find_exl3_modules(index)["model.layers.1.mlp.down_proj"]
    w = fmt.load_module(FIXTURES / "exl3-3.0bpw-mcg", spec, index=index)
    expect = ref.reconstruct(w.trellis, w.suh, w.svh, w.codebook).t().to(torch.bfloat16)
    assert torch.equal(tensors["model.layers.1.mlp.down_proj.weight"], expect)
    stored = fmt.read_tensor(
        FIXTURES / "exl3-3.0bpw-mcg", "model.norm.weight", index["model.norm.weight"]
    )
    assert torch.equal(tensors["model.norm.weight"], stored)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_padding_is_trimmed_to_real_dims(fmt, ref, tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    synth.write_checkpoint(
        "deepseek-v3-tiny", src, bits=3, codebook="mul1", shard_size_bytes=1 << 20
    )
    summary = dequantize(src, out, dtype="float16", shard_mib=1, progress=False)
    assert summary["shards"] > 1 and (out / "model.safetensors.index.json").is_file()
    index = fmt.read_safetensors_index(out)
    a = "model.layers.1.self_attn"
    shapes = {
        n: index[n].shape
        for n in (
            "lm_head.weight",
            f"{a}.q_a_proj.weight",
            f"{a}.q_b_proj.weight",
            f"{a}.kv_a_proj_with_mqa.weight",
            f"{a}.kv_b_proj.weight",
            f"{a}.o_proj.weight",
            "model.layers.3.eh_proj.weight",
            "model.layers.2.mlp.experts.5.down_proj.weight",
            "model.embed_tokens.weight",
        )
    }
    assert shapes == {
        "lm_head.weight": (4000, 256),
        f"{a}.q_a_proj.weight": (192, 256),
        f"{a}.q_b_proj.weight": (384, 192),
        f"{a}.kv_a_proj_with_mqa.weight": (160, 256),
        f"{a}.kv_b_proj.weight": (512, 128),
        f"{a}.o_proj.weight": (256, 256),
        "model.layers.3.eh_proj.weight": (256, 512),
        "model.layers.2.mlp.experts.5.down_proj.weight": (256, 128),
        "model.embed_tokens.weight": (4000, 256),
    }
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
