# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MTP end-to-end pieces on the CPU: the synthetic EXL3 checkpoint with its MTP
layer and its bf16 twin (which vLLM's strict bf16 loader takes, draft included), the
agreement measures, and (faked) engine runs turned into the right checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
E2E = REPO / "scripts" / "e2e"
sys.path.insert(0, str(E2E))

import run_fixture_e2e as fx  # noqa: E402
import run_mtp_e2e as mtp  # noqa: E402


def test_token_agreement():
    assert mtp.token_agreement([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [4, 5, 6]]) == 5 / 6
    assert mtp.token_agreement([[1, 2]], [[1, 2, 3]]) == 2 / 3


def test_arguments():
    r = subprocess.run(
        [sys.executable, str(E2E / "run_mtp_e2e.py"), "--models", "fp8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "choose from exl3,bf16" in r.stderr
    assert mtp.parse_args([]).models == ["exl3", "bf16"]


def _run(
    monkeypatch, tmp_path, tokens: dict, drafts: int | None = 5, budget=3600
) -> dict:
    calls = []

    def generate(path, batch, *, speculative, attention_backend):
        calls.append((path.name, speculative))
        metrics = {} if drafts is None else {"spec_decode_num_drafts": drafts}
        return {"tokens": tokens[(path.name, speculative)], "metrics": metrics}

    monkeypatch.setattr(mtp, "generate", generate)
    args = mtp.parse_args(["--out", str(tmp_path)])
    out = mtp.run(
        args,
        [[0, 1]],
        {"exl3": Path("exl3"), "bf16": Path("bf16")},
        fx.Deadline(budget, mtp.STAGE_COST_S),
    )
    out["calls"] = calls
    return out


PLAIN = [[1, 2, 3, 4]] * 4


def test_mtp_checks_pass_when_exl3_agrees_like_bf16(monkeypatch, tmp_path):
    bf16_spec = [[1, 2, 3, 4]] * 3 + [[1, 2, 9, 9]]
    out = _run(
        monkeypatch,
        tmp_path,
        {
            ("exl3", False): PLAIN,
            ("exl3", True): PLAIN,
            ("bf16", False): PLAIN,
            ("bf16", True): bf16_spec,
        },
    )
    assert out["calls"] == [
        ("exl3", False),
        ("exl3", True),
        ("bf16", False),
        ("bf16", True),
    ]
    assert [c["check"] for c in out["checks"]] == [
        "exl3: speculation drafted tokens",
        "bf16: speculation drafted tokens",
        "exl3: speculative vs plain greedy matched fraction vs bf16's",
    ]
    assert all(c["pass"] for c in out["checks"]), out["checks"]
    assert out["summary"]["bf16"]["continuations"]["identical"] == 3
    assert json.loads((tmp_path / "mtp_e2e.progress.json").read_text())["runs"]


def test_mtp_checks_fail_when_exl3_diverges_or_nothing_was_drafted(
    monkeypatch, tmp_path
):
    exl3_spec = [[1, 9, 9, 9]] * 2 + [[1, 2, 3, 4]] * 2
    out = _run(
        monkeypatch,
        tmp_path,
        {
            ("exl3", False): PLAIN,
            ("exl3", True): exl3_spec,
            ("bf16", False): PLAIN,
            ("bf16", True): PLAIN,
        },
        drafts=0,
    )
    assert {c["check"] for c in out["checks"] if not c["pass"]} == {
        "exl3: speculation drafted tokens",
        "bf16: speculation drafted tokens",
        "exl3: speculative vs plain greedy matched fraction vs bf16's",
    }


def test_mtp_time_budget(monkeypatch, tmp_path):
    # Room for the plain engines (75 s each), not for the speculative ones (110 s).
    out = _run(
        monkeypatch,
        tmp_path,
        {("exl3", False): PLAIN, ("bf16", False): PLAIN},
        budget=100,
    )
    assert out["calls"] == [("exl3", False), ("bf16", False)]
    assert out["skipped"] == ["exl3 spec (time budget)", "bf16 spec (time budget)"]
    assert not out["checks"] and not out["summary"]


def test_checkpoints_carry_the_mtp_layer_and_the_twin_its_shared_tensors(tmp_path):
    """The EXL3 checkpoint has an EXL3 MTP layer; the bf16 twin has every tensor
    dequantized plus the MTP layer's own embedding and head that vLLM's strict bf16
    loader asks for (copies of the model's). Loading both into vLLM needs its MoE
    kernels: the GPU run proves that."""
    from safetensors.torch import load_file

    exl3, bf16 = mtp.write_checkpoints(tmp_path)
    cfg = json.loads((exl3 / "config.json").read_text())
    assert (
        cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == mtp.LAYERS
    )
    assert cfg["quantization_config"]["quant_method"] == "exl3"
    assert cfg["scoring_func"] == "sigmoid" and cfg["topk_method"] == "noaux_tc"
    q = load_file(exl3 / "model.safetensors")
    m = f"model.layers.{mtp.LAYERS}"
    for module in (
        "eh_proj",
        "self_attn.q_b_proj",
        "mlp.experts.15.down_proj",
        "mlp.shared_experts.gate_proj",
    ):
        assert f"{m}.{module}.trellis" in q, module
    twin_cfg = json.loads((bf16 / "config.json").read_text())
    assert "quantization_config" not in twin_cfg
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == twin_cfg
    w = load_file(bf16 / "model.safetensors")
    shared = load_file(bf16 / "model-mtp-shared.safetensors")
    assert not any(k.endswith((".trellis", ".suh", ".svh")) for k in w)
    assert w[f"{m}.eh_proj.weight"].shape == (
        cfg["hidden_size"],
        2 * cfg["hidden_size"],
    )
    assert set(shared) == {f"{m}.embed_tokens.weight", f"{m}.shared_head.head.weight"}
    assert (shared[f"{m}.embed_tokens.weight"] == w["model.embed_tokens.weight"]).all()
    assert (shared[f"{m}.shared_head.head.weight"] == w["lm_head.weight"]).all()
    assert (bf16 / "tokenizer.json").is_file() and (exl3 / "tokenizer.json").is_file()
