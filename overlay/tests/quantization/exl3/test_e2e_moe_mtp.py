# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The MoE, MTP and sparse-MLA end-to-end pieces on the CPU.

MoE: staging copies the right files and its checksums catch damage, working copies get
what vLLM needs, and (faked) engine runs turn into the right checks, judged against the
original bf16 model when staged and the dequantized twin otherwise. MTP: the synthetic
EXL3 checkpoint with its MTP layer and its bf16 twin (which vLLM's strict bf16 loader
takes, draft included), the agreement measures, and (faked) engine runs turned into the
right checks. Sparse MLA: the synthetic DeepSeek-V3.2 checkpoint and its dense twin pass
the loader's validation, (faked) engine runs are judged against the dense pair, a
backend this vLLM lacks is a failed row, and runs of an earlier call are reused only for
the same checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_exl3.e2e import run_fixture_e2e as fx
from vllm_exl3.e2e import run_moe_e2e as moe
from vllm_exl3.e2e import run_mtp_e2e as mtp
from vllm_exl3.e2e import run_sparse_mla_e2e as dsa
from vllm_exl3.repo import ROOT as REPO

E2E = REPO / "scripts" / "e2e"

STAGE = E2E / "stage_fixtures.sh"
# ExLlamaV3 1.6.5's recorded perplexities (shared fixture set's logs/), restated for the
# fakes.
RECORDED = {
    "qwen3moe-e16-tiny": {
        "bf16": 7.117916945287313,
        "exl3-3.0bpw-mcg": 7.333234444649828,
        "exl3-5.0bpw-mul1": 7.134741738780715,
    },
    "dsv3-tiny": {"bf16": 7.026745608869658, "exl3-4.0bpw-mcg": 7.084639828990078},
}
SCORED = 183960


def fake_fixture_set(root: Path) -> Path:
    """The shared fixture set's layout with small stand-in files."""
    for model, convs in RECORDED.items():
        for conv in convs:
            d = root / model / conv
            d.mkdir(parents=True)
            cfg = {"model_type": "deepseek_v3" if model == "dsv3-tiny" else "qwen3_moe"}
            (d / "config.json").write_text(json.dumps(cfg))
            (d / "tokenizer.json").write_text("{}")
            (
                d
                / (
                    "model-00001-of-00002.safetensors"
                    if conv == "bf16"
                    else "model.safetensors"
                )
            ).write_bytes(f"{model}/{conv}".encode())
            if conv != "bf16":
                (d / "quantization_config.json").write_text("{}")
    logs = root / "logs"
    logs.mkdir()
    for model, name in (
        ("qwen3moe-e16-tiny", "ppl_exllamav3_moe_e16.json"),
        ("dsv3-tiny", "ppl_exllamav3_dsv3.json"),
    ):
        (logs / name).write_text(
            json.dumps(
                [
                    {
                        "label": conv,
                        "ppl": ppl,
                        "scored_tokens": SCORED,
                        "n_tokens": 184368,
                    }
                    for conv, ppl in RECORDED[model].items()
                ]
            )
        )
    (logs / "train_dense.json").write_text("{}")  # not staged
    return root


def stage(src: Path, dest: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(STAGE), *flags, str(dest), str(src)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_staging_copies_the_exl3_conversions_and_records(tmp_path):
    src = fake_fixture_set(tmp_path / "fixtures")
    r = stage(src, tmp_path / "moe")
    assert r.returncode == 0, r.stderr
    got = sorted(
        str(p.relative_to(tmp_path / "moe"))
        for p in (tmp_path / "moe").rglob("*")
        if p.is_file()
    )
    convs = [f"{m}/{c}" for m, cs in RECORDED.items() for c in cs if c != "bf16"]
    assert got == sorted(
        ["SHA256SUMS", "ppl_exllamav3_dsv3.json", "ppl_exllamav3_moe_e16.json"]
        + [
            f"{c}/{f}"
            for c in convs
            for f in (
                "config.json",
                "model.safetensors",
                "quantization_config.json",
                "tokenizer.json",
            )
        ]
    )
    assert moe.verify_staged(tmp_path / "moe") == {"checked": len(got) - 1}


def test_staging_with_bf16_adds_the_originals(tmp_path):
    src = fake_fixture_set(tmp_path / "fixtures")
    r = stage(src, tmp_path / "moe", "--with-bf16")
    assert r.returncode == 0, r.stderr
    for model in RECORDED:
        assert (
            tmp_path / "moe" / model / "bf16" / "model-00001-of-00002.safetensors"
        ).is_file()


def test_staging_refuses_a_directory_that_is_not_the_fixture_set(tmp_path):
    r = stage(tmp_path, tmp_path / "moe")
    assert r.returncode == 1 and "no config.json (not the fixture set?)" in r.stderr
    r = stage(tmp_path, tmp_path / "moe", "--bogus")
    assert r.returncode == 2 and "unknown option --bogus" in r.stderr


def test_damaged_staged_file_is_named(tmp_path):
    src = fake_fixture_set(tmp_path / "fixtures")
    assert stage(src, tmp_path / "moe").returncode == 0
    weights = tmp_path / "moe" / "dsv3-tiny" / "exl3-4.0bpw-mcg" / "model.safetensors"
    weights.write_bytes(b"truncated")
    with pytest.raises(
        SystemExit, match="dsv3-tiny/exl3-4.0bpw-mcg/model.safetensors: SHA-256 differs"
    ):
        moe.verify_staged(tmp_path / "moe")
    weights.unlink()
    with pytest.raises(SystemExit, match="model.safetensors: missing"):
        moe.verify_staged(tmp_path / "moe")


def test_working_copy_of_deepseek_v3_gets_its_routing(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    notes = moe.assemble(src, tmp_path / "out")
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["topk_method"] == "noaux_tc" and cfg["scoring_func"] == "sigmoid"
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    assert any("topk_method='noaux_tc'" in n for n in notes)
    assert json.loads((src / "config.json").read_text()) == {
        "model_type": "deepseek_v3"
    }


def test_moe_arguments(tmp_path):
    def err(*argv):
        r = subprocess.run(
            [sys.executable, str(E2E / "run_moe_e2e.py"), *argv],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2
        return r.stderr

    assert "--moe-dir" in err()
    assert "unknown models ['mixtral']" in err(
        "--moe-dir", str(tmp_path), "--models", "mixtral"
    )
    assert "not an EXL3 conversion" in err(
        "--moe-dir",
        str(tmp_path),
        "--models",
        "dsv3-tiny",
        "--serve",
        "qwen3moe-e16-tiny/exl3-3.0bpw-mcg",
    )
    assert "not a directory" in err("--moe-dir", str(tmp_path / "nope"))
    args = moe.parse_args(["--moe-dir", str(tmp_path), "--models", "dsv3-tiny"])
    assert args.models == ["dsv3-tiny"] and args.eager and args.reference == "auto"
    assert moe.result_name(args.models) == "moe_e2e_dsv3-tiny.json"
    assert moe.result_name(list(moe.MODELS)) == "moe_e2e.json"


def _fake_run(ppl: float, jitter: float) -> dict:
    tokens = [[1, 2, 3], [4, 5, 6]]
    return {
        "ppl": ppl,
        "mean_nll": 1.0,
        "scored": SCORED,
        "windows": 360,
        "probe_logprobs": [[-1.0 - jitter, -2.0], [-0.5]],
        "greedy_tokens": tokens,
        "greedy_logprobs": [[-0.1 - jitter] * 3 for _ in tokens],
        "offline_text": "    return n\n",
    }


MLA_OFF = "VLLM_MLA_DISABLE"


def _moe_run(
    monkeypatch,
    tmp_path,
    *,
    bf16: bool,
    ppl_scale: dict[str, float] | None = None,
    jitter: dict[str, float] | None = None,
    budget: float = 3600,
    **argv,
) -> dict:
    src = fake_fixture_set(tmp_path / "fixtures")
    assert (
        stage(src, tmp_path / "moe", *(["--with-bf16"] if bf16 else [])).returncode == 0
    )
    engines, twins = [], []

    def run_mode(name, model_dir, windows, *, eager, tp, full_ppl, engine_args):
        engines.append((name, eager, engine_args, os.environ.get(MLA_OFF)))
        model, ckpt = name.split("/")
        base = RECORDED[model].get(ckpt, RECORDED[model].get("bf16"))
        if ckpt == moe.DEQUANTIZED:
            base = RECORDED[model][moe.MODELS[model].twin_source]
        scale = (ppl_scale or {}).get(name, 1.0)
        return _fake_run(base * scale, (jitter or {}).get(name, 1e-3) if eager else 0.0)

    def twin(src_dir, out):
        twins.append(src_dir.name)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(fx, "run_mode", run_mode)
    monkeypatch.setattr(
        fx,
        "serve_once",
        lambda name, d, tp, work, timeout, extra: {
            "checkpoint": name,
            "text": "    return n\n",
            "extra": extra,
            "mla_off": os.environ.get(MLA_OFF),
        },
    )
    monkeypatch.setattr(moe, "dequantized_twin", twin)
    args = moe.parse_args(
        [
            "--moe-dir",
            str(tmp_path / "moe"),
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(tmp_path / "out"),
            *[x for k, v in argv.items() for x in (f"--{k.replace('_', '-')}", v)],
        ]
    )
    args.out.mkdir()
    out = moe.run(args, windows=[], deadline=fx.Deadline(budget))
    out["engines"], out["twins"] = engines, twins
    return out


def test_checks_pass_against_the_dequantized_twin(monkeypatch, tmp_path):
    out = _moe_run(monkeypatch, tmp_path, bf16=False, attention_backend="TRITON_MLA")
    assert out["checks"] and all(c["pass"] for c in out["checks"]), out["checks"]
    assert not out["errors"] and not out["skipped"]
    assert out["twins"] == ["exl3-5.0bpw-mul1", "exl3-4.0bpw-mcg"]
    assert set(out["summary"]) == {
        "qwen3moe-e16-tiny/exl3-3.0bpw-mcg",
        "qwen3moe-e16-tiny/exl3-5.0bpw-mul1",
        "qwen3moe-e16-tiny/bf16-dequantized",
        "dsv3-tiny/exl3-4.0bpw-mcg",
        "dsv3-tiny/bf16-dequantized",
    }
    # Every engine default then eager, the backend passed to each and to the server.
    assert len(out["engines"]) == 10
    assert all(e[2] == {"attention_backend": "TRITON_MLA"} for e in out["engines"])
    assert out["serve"]["checkpoint"] == "qwen3moe-e16-tiny/exl3-3.0bpw-mcg"
    assert out["serve"]["extra"] == ("--attention-backend", "TRITON_MLA")
    assert out["serve"]["matches_offline"] is True
    assert any("topk_method" in n for n in out["notes"]["dsv3-tiny/exl3-4.0bpw-mcg"])
    # dsv3-tiny's engines (conversion and twin) run vLLM's MHA form, the others MLA's
    # default, and the setting is gone afterwards.
    assert {e[0].split("/")[0]: e[3] for e in out["engines"]} == {
        "qwen3moe-e16-tiny": None,
        "dsv3-tiny": "1",
    }
    assert out["serve"]["mla_off"] is None and MLA_OFF not in os.environ
    assert any(MLA_OFF in n for n in out["notes"]["dsv3-tiny/exl3-4.0bpw-mcg"])
    judged = [c["check"] for c in out["checks"] if "eager" in c["check"]]
    assert (
        "dsv3-tiny/exl3-4.0bpw-mcg: eager vs default mean |dlogprob| (decode) vs "
        "bf16-dequantized's"
        in judged
        and len(judged) == 6
    )
    progress = json.loads((tmp_path / "out" / "moe_e2e.progress.json").read_text())
    assert len(progress["runs"]) == 5


def test_original_bf16_is_the_reference_when_staged(monkeypatch, tmp_path):
    out = _moe_run(monkeypatch, tmp_path, bf16=True, models="dsv3-tiny", serve="none")
    assert out["twins"] == [] and out["serve"] is None
    assert set(out["summary"]) == {"dsv3-tiny/exl3-4.0bpw-mcg", "dsv3-tiny/bf16"}
    assert (
        out["summary"]["dsv3-tiny/bf16"]["exllamav3_ppl"]
        == RECORDED["dsv3-tiny"]["bf16"]
    )
    assert all(c["pass"] for c in out["checks"]), out["checks"]
    cfg = json.loads(
        (tmp_path / "w" / "models" / "dsv3-tiny" / "bf16" / "config.json").read_text()
    )
    assert cfg["scoring_func"] == "sigmoid"


def test_dsv3_serve_runs_in_its_model_environment(monkeypatch, tmp_path):
    out = _moe_run(
        monkeypatch,
        tmp_path,
        bf16=False,
        models="dsv3-tiny",
        serve="dsv3-tiny/exl3-4.0bpw-mcg",
    )
    assert out["serve"]["checkpoint"] == "dsv3-tiny/exl3-4.0bpw-mcg"
    assert out["serve"]["mla_off"] == "1" and MLA_OFF not in os.environ


def test_checks_fail_on_perplexity_and_eager_disagreement(monkeypatch, tmp_path):
    out = _moe_run(
        monkeypatch,
        tmp_path,
        bf16=False,
        models="qwen3moe-e16-tiny",
        ppl_scale={"qwen3moe-e16-tiny/exl3-3.0bpw-mcg": 1.004},
        jitter={"qwen3moe-e16-tiny/exl3-5.0bpw-mul1": 0.05},
    )
    failed = {c["check"] for c in out["checks"] if not c["pass"]}
    assert failed == {
        "qwen3moe-e16-tiny/exl3-3.0bpw-mcg: ppl vs ExLlamaV3",
        "qwen3moe-e16-tiny/exl3-5.0bpw-mul1: eager vs default mean |dlogprob| (prompt) "
        "vs "
        "bf16-dequantized's",
        "qwen3moe-e16-tiny/exl3-5.0bpw-mul1: eager vs default mean |dlogprob| (decode) "
        "vs "
        "bf16-dequantized's",
    }


def test_time_budget_skips_stages(monkeypatch, tmp_path):
    out = _moe_run(monkeypatch, tmp_path, bf16=False, models="dsv3-tiny", budget=10)
    assert out["engines"] == []
    assert out["skipped"] == [
        "dsv3-tiny/exl3-4.0bpw-mcg default (time budget)",
        "dsv3-tiny/bf16-dequantized default (time budget)",
        "serve (no EXL3 conversion ran)",
    ]


def test_failing_twin_is_recorded_and_the_conversions_still_judged(
    monkeypatch, tmp_path
):
    def broken(src_dir, out):
        raise RuntimeError("no CUDA")

    monkeypatch.setattr(moe, "dequantized_twin", broken)
    src = fake_fixture_set(tmp_path / "fixtures")
    assert stage(src, tmp_path / "moe").returncode == 0
    monkeypatch.setattr(
        fx,
        "run_mode",
        lambda name, *a, **k: _fake_run(RECORDED["dsv3-tiny"]["exl3-4.0bpw-mcg"], 0.0),
    )
    args = moe.parse_args(
        [
            "--moe-dir",
            str(tmp_path / "moe"),
            "--work",
            str(tmp_path / "w"),
            "--out",
            str(tmp_path / "w"),
            "--models",
            "dsv3-tiny",
            "--serve",
            "none",
        ]
    )
    (tmp_path / "w").mkdir()
    out = moe.run(args, windows=[], deadline=fx.Deadline(3600))
    assert list(out["errors"]) == ["dsv3-tiny/bf16-dequantized prepare"]
    assert [c["check"] for c in out["checks"]] == [
        "dsv3-tiny/exl3-4.0bpw-mcg: ppl vs ExLlamaV3",
        "dsv3-tiny/exl3-4.0bpw-mcg: scored tokens",
    ]


def test_dequantized_twin_is_a_plain_checkpoint(tmp_path):
    from safetensors import safe_open
    from vllm_exl3.testing import synthetic_checkpoint as synth

    src = tmp_path / "exl3"
    synth.write_checkpoint(
        "qwen3-moe-tiny", src, bits=3, codebook="mcg", layers=1, seed=1
    )
    moe.assemble(src, tmp_path / "copy")
    moe.dequantized_twin(tmp_path / "copy", tmp_path / "twin")
    cfg = json.loads((tmp_path / "twin" / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (tmp_path / "twin" / "tokenizer.json").is_file()
    assert not (tmp_path / "twin" / "quantization_config.json").exists()
    with safe_open(str(tmp_path / "twin" / "model.safetensors"), "pt") as f:
        w = f.get_tensor("model.layers.0.mlp.experts.3.down_proj.weight")
        assert not any(k.endswith(".trellis") for k in f.keys())  # noqa: SIM118 (safe_open)
    assert str(w.dtype) == "torch.bfloat16" and tuple(w.shape) == (
        cfg["hidden_size"],
        cfg["moe_intermediate_size"],
    )


# The MTP end-to-end pieces on the CPU: the synthetic EXL3 checkpoint with its MTP
# layer and its bf16 twin (which vLLM's strict bf16 loader takes, draft included), the
# agreement measures, and (faked) engine runs turned into the right checks.


def test_token_agreement():
    assert mtp.token_agreement([[1, 2, 3], [4, 5, 6]], [[1, 9, 3], [4, 5, 6]]) == 5 / 6
    assert mtp.token_agreement([[1, 2]], [[1, 2, 3]]) == 2 / 3


def test_mtp_arguments():
    r = subprocess.run(
        [sys.executable, str(E2E / "run_mtp_e2e.py"), "--models", "fp8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "choose from exl3,bf16" in r.stderr
    assert mtp.parse_args([]).models == ["exl3", "bf16"]


def _mtp_run(
    monkeypatch,
    tmp_path,
    tokens: dict,
    drafts: int | None = 5,
    budget=3600,
    gap: float = 0.1,
) -> dict:
    """Faked engines; a plain run's runner-up is token 9 everywhere, `gap` nats below
    its own token."""
    calls = []

    def generate(path, batch, *, speculative, attention_backend, additional_config):
        assert additional_config is None  # the DeepSeek layout has no GDN layers
        calls.append((path.name, speculative))
        metrics = {} if drafts is None else {"spec_decode_num_drafts": drafts}
        out = {"tokens": tokens[(path.name, speculative)], "metrics": metrics}
        if not speculative:
            out["top"] = [
                [[[t, -0.5], [9, -0.5 - gap]] for t in seq] for seq in out["tokens"]
            ]
        return out

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


def test_mtp_checks_pass_when_outputs_leave_plain_only_at_near_ties(
    monkeypatch, tmp_path
):
    bf16_spec = [[1, 2, 3, 4]] * 3 + [[1, 2, 9, 9]]
    out = _mtp_run(
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
        "exl3: speculative output leaves plain only at near ties",
        "bf16: speculation drafted tokens",
        "bf16: speculative output leaves plain only at near ties",
    ]
    assert all(c["pass"] for c in out["checks"]), out["checks"]
    assert out["summary"]["bf16"]["continuations"]["identical"] == 3
    assert out["summary"]["bf16"]["divergences"]["diverged"] == 1
    assert json.loads((tmp_path / "mtp_e2e.progress.json").read_text())["runs"]


def test_mtp_checks_fail_on_a_confident_divergence_or_no_drafts(monkeypatch, tmp_path):
    exl3_spec = [[1, 9, 9, 9]] * 2 + [[1, 2, 3, 4]] * 2
    out = _mtp_run(
        monkeypatch,
        tmp_path,
        {
            ("exl3", False): PLAIN,
            ("exl3", True): exl3_spec,
            ("bf16", False): PLAIN,
            ("bf16", True): PLAIN,
        },
        drafts=0,
        gap=3.0,
    )
    assert {c["check"] for c in out["checks"] if not c["pass"]} == {
        "exl3: speculation drafted tokens",
        "bf16: speculation drafted tokens",
        "exl3: speculative output leaves plain only at near ties",
    }


def test_mtp_time_budget(monkeypatch, tmp_path):
    # Room for the plain engines (75 s each), not for the speculative ones (110 s).
    out = _mtp_run(
        monkeypatch,
        tmp_path,
        {("exl3", False): PLAIN, ("bf16", False): PLAIN},
        budget=100,
    )
    assert out["calls"] == [("exl3", False), ("bf16", False)]
    assert out["skipped"] == ["exl3 spec (time budget)", "bf16 spec (time budget)"]
    assert not out["checks"] and not out["summary"]


def test_qwen3_next_asks_for_triton_gdn_prefill_without_flashinfer(monkeypatch):
    """vLLM 0.26 takes FlashInfer's GDN prefill on Hopper without checking that the
    package is there; the Qwen3-Next layout's engines ask for Triton's when it is
    not, and leave vLLM's choice alone when it is."""
    have = {"flashinfer": False}
    real = mtp.importlib.util.find_spec

    def find_spec(name, *a, **k):
        if name == "flashinfer":
            return object() if have["flashinfer"] else None
        return real(name, *a, **k)

    monkeypatch.setattr(mtp.importlib.util, "find_spec", find_spec)
    assert mtp.gdn_prefill_config(mtp.QWEN3_NEXT) == {"gdn_prefill_backend": "triton"}
    assert mtp.gdn_prefill_config(mtp.DEEPSEEK) is None
    have["flashinfer"] = True
    assert mtp.gdn_prefill_config(mtp.QWEN3_NEXT) is None


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


# ---- sparse MLA (run_sparse_mla_e2e.py)


def test_sparse_mla_arguments():
    r = subprocess.run(
        [sys.executable, str(E2E / "run_sparse_mla_e2e.py"), "--runs", "flashinfer"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "unknown ['flashinfer']" in r.stderr
    assert dsa.parse_args([]).runs == list(dsa.RUNS)
    assert dsa.parse_args(["--runs", "triton-dense"]).runs == ["triton-dense"]


def test_sparse_mla_checkpoints_validate_and_repeat(tmp_path):
    """The DeepSeek-V3.2 checkpoint (indexer on every layer, index_topk 2048, the MLA
    dims of vLLM's Hopper kernels) and its dense twin pass the loader's validation; a
    second write is the same checkpoint, so runs of an earlier call compare."""
    from safetensors.torch import load_file
    from vllm.model_executor.layers.quantization.exl3.checkpoint import (
        validate_checkpoint,
    )

    sparse, dense, digest = dsa.write_checkpoints(tmp_path / "a")
    cfg = json.loads((sparse / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV32ForCausalLM"]
    assert cfg["index_topk"] == 2048 and cfg["num_attention_heads"] == dsa.HEADS
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    twin = json.loads((dense / "config.json").read_text())
    assert twin["architectures"] == ["DeepseekV3ForCausalLM"]
    assert not set(dsa.DSA) & set(twin)
    assert {k: v for k, v in cfg.items() if k not in dsa.DSA} == {
        **twin,
        "architectures": cfg["architectures"],
        "model_type": "deepseek_v32",
    }
    for ckpt in (sparse, dense):
        assert validate_checkpoint(ckpt).modules
    named = load_file(sparse / "model.safetensors")
    for i in range(dsa.LAYERS):
        assert f"model.layers.{i}.self_attn.indexer.wq_b.trellis" in named
        norm = named[f"model.layers.{i}.self_attn.kv_a_layernorm.weight"].float()
        assert abs(norm.mean().item() - dsa.ATTENTION_SHARPEN) < 0.1
    assert len(dsa.prompts()) == dsa.PROMPTS
    assert {len(p) for p in dsa.prompts()} == {dsa.PROMPT_TOKENS}
    assert cfg["index_topk"] < dsa.PROMPT_TOKENS
    assert dsa.write_checkpoints(tmp_path / "b")[2] == digest


POSITIONS = 2100  # past index_topk (2048), so both sides of it are measured


def _fake_dsa_run(shift: float, beyond: float = 0.0, tokens=(1, 2, 3, 4)) -> dict:
    prompt = [
        [-1.0 + shift + (beyond if j >= 2048 else 0.0) for j in range(POSITIONS)]
    ] * 2
    return {
        "prompt_logprobs": prompt,
        "greedy_tokens": [list(tokens)] * 2,
        "greedy_logprobs": [[-0.5 + shift] * len(tokens)] * 2,
    }


def _dsa_run(
    monkeypatch,
    tmp_path,
    results: dict,
    missing=(),
    argv=(),
    budget: float = 3600,
    warm: dict | None = None,
) -> dict:
    calls, reports = [], []

    def engine_process(args, name, compiler, timeout_s):
        calls.append(name)
        assert timeout_s <= budget and compiler == "nvrtc"
        got = results[name]
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(dsa, "engine_process", engine_process)
    monkeypatch.setattr(
        dsa,
        "warm_stage",
        lambda args, b: warm
        or {"status": "ready", "cached": True, "compiler": "nvrtc"},
    )
    monkeypatch.setattr(
        dsa,
        "backend_missing",
        lambda b: f"attention backend {b} is not registered" if b in missing else None,
    )
    args = dsa.parse_args(["--out", str(tmp_path), "--work", str(tmp_path), *argv])

    def report(partial):
        reports.append(json.loads(json.dumps(partial)))
        dsa.write_report(tmp_path, partial)

    out = dsa.run(args, "digest", dsa.Budget(budget), report)
    out["calls"], out["reports"] = calls, reports
    return out


AGREEING = {
    "exl3-sparse-bf16": _fake_dsa_run(0.002, beyond=0.3),
    "flashmla-sparse-bf16": _fake_dsa_run(0.0, beyond=0.3),
    "exl3-sparse-fp8": _fake_dsa_run(0.003, beyond=0.3),
    "flashmla-sparse-fp8": _fake_dsa_run(0.001, beyond=0.3),
    "flashmla-dense": _fake_dsa_run(0.0),
    "triton-dense": _fake_dsa_run(0.0015),
    # Nearer EXL3_MLA_SPARSE (0.0008 away) than FLASHMLA_SPARSE (0.0012).
    "exl3-sparse-reference-bf16": _fake_dsa_run(0.0012, beyond=0.3),
}


def test_sparse_mla_checks_pass_when_the_pairs_agree_like_the_dense_pair(
    monkeypatch, tmp_path
):
    out = _dsa_run(monkeypatch, tmp_path, AGREEING)
    assert out["calls"] == list(dsa.RUNS)
    assert len(out["checks"]) == 9, out["checks"]
    assert all(c["pass"] for c in out["checks"]), out["checks"]
    topk = out["summary"][dsa.TOPK_PAIR[0]]
    assert (
        topk["prompt_beyond_topk"]["mean_abs"] > topk["prompt_within_topk"]["mean_abs"]
    )
    table = dsa.markdown(out)
    assert "| EXL3_MLA_SPARSE vs FLASHMLA_SPARSE, bf16 cache |" in table
    assert "| EXL3_MLA_SPARSE vs reference |" in table
    assert "| FLASHMLA_SPARSE vs reference |" in table
    stored = sorted(p.stem for p in (tmp_path / dsa.RUNS_DIR).iterdir())
    assert stored == sorted(dsa.RUNS)


def test_sparse_mla_checks_fail_on_disagreement_and_no_topk_effect(
    monkeypatch, tmp_path
):
    results = {
        **AGREEING,
        "exl3-sparse-bf16": _fake_dsa_run(0.2, beyond=0.3, tokens=(1, 9, 9, 9)),
        "flashmla-sparse-bf16": _fake_dsa_run(0.0),
    }
    out = _dsa_run(monkeypatch, tmp_path, results)
    failed = {c["check"] for c in out["checks"] if not c["pass"]}
    label = dsa.JUDGED[0][0]
    assert failed == {
        f"{label}: mean |dlogprob| (prompt) vs the dense pair's",
        f"{label}: mean |dlogprob| (decode) vs the dense pair's",
        f"{label}: greedy matched fraction vs the dense pair's",
        f"{dsa.TOPK_PAIR[0]}: mean |dlogprob| past index_topk vs before it",
        *_reference_checks(),
    }


def _reference_checks() -> list[str]:
    ours, theirs = (label for label, _, _ in dsa.REFERENCE_PAIRS)
    return [
        f"{ours}: mean |dlogprob| ({kind}) vs {theirs} x {dsa.REFERENCE_SLACK}"
        for kind in ("prompt", "decode")
    ]


def test_sparse_mla_reference_check_fails_when_ours_is_the_farther_one(
    monkeypatch, tmp_path
):
    """The pairs agree as the dense pair does, but the fp32-reference run sits on
    FLASHMLA_SPARSE (0.0 away) and 0.002 from EXL3_MLA_SPARSE: only the reference
    checks fail. Within REFERENCE_SLACK of FlashMLA-sparse's distance they pass."""
    results = {**AGREEING, "exl3-sparse-reference-bf16": _fake_dsa_run(0.0)}
    out = _dsa_run(monkeypatch, tmp_path, results)
    failed = {c["check"] for c in out["checks"] if not c["pass"]}
    assert failed == set(_reference_checks())
    assert not dsa.passed(out)
    # 0.00105 from ours, 0.001 from theirs: within the slack.
    results["exl3-sparse-reference-bf16"] = _fake_dsa_run(0.00095, beyond=0.3)
    results["flashmla-sparse-bf16"] = _fake_dsa_run(-0.00005, beyond=0.3)
    out = _dsa_run(monkeypatch, tmp_path, results, argv=("--fresh",))
    assert all(c["pass"] for c in out["checks"]), out["checks"]
    summary = out["summary"]
    ours, theirs = (summary[label] for label, _, _ in dsa.REFERENCE_PAIRS)
    assert ours["prompt"]["mean_abs"] > theirs["prompt"]["mean_abs"]


def test_sparse_mla_reference_run_switches_only_the_attention(monkeypatch):
    """The reference engine's process: EXL3_MLA_SPARSE layers built after the switch
    take the reference path (the one VLLM_EXL3_FORCE_REFERENCE selects), the op
    raises if called, and the setting itself stays off (the EXL3 linears and MoE keep
    their kernels). Refused when the engine would run in another process."""
    from vllm.v1.attention.backends.mla import exl3_mla_sparse
    from vllm.v1.attention.ops import exl3_sparse_mla

    assert dsa.RUNS[dsa.REFERENCE_RUN].reference
    assert dsa.RUNS[dsa.REFERENCE_RUN].backend == "EXL3_MLA_SPARSE"
    assert list(dsa.RUNS)[:2] == [a for _, a, _ in dsa.REFERENCE_PAIRS]
    monkeypatch.setattr(exl3_mla_sparse, "reference_forced", lambda: False)
    monkeypatch.setattr(exl3_sparse_mla, "sparse_mla_decode", lambda *a, **k: None)
    monkeypatch.delenv("VLLM_EXL3_FORCE_REFERENCE", raising=False)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(RuntimeError, match="needs the engine in this process"):
        dsa.force_reference_attention()
    assert not exl3_mla_sparse.reference_forced()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    dsa.force_reference_attention()
    assert exl3_mla_sparse.reference_forced()
    with pytest.raises(RuntimeError, match="op was called in the reference run"):
        exl3_sparse_mla.sparse_mla_decode()
    assert "VLLM_EXL3_FORCE_REFERENCE" not in os.environ


def test_sparse_mla_missing_backend_is_a_failed_row(monkeypatch, tmp_path):
    out = _dsa_run(monkeypatch, tmp_path, AGREEING, missing=("EXL3_MLA_SPARSE",))
    assert "exl3-sparse-bf16" not in out["calls"] and "triton-dense" in out["calls"]
    assert "not registered" in out["errors"]["exl3-sparse-fp8"]
    assert not any(c["check"].startswith("EXL3_MLA") for c in out["checks"])
    table = dsa.markdown(out)
    assert "| exl3-sparse-bf16 | FAILED: attention backend EXL3_MLA_SPARSE" in table


def test_sparse_mla_reuses_earlier_runs_of_the_same_checkpoint(monkeypatch, tmp_path):
    _dsa_run(monkeypatch, tmp_path, AGREEING, argv=("--runs", "flashmla-dense"))
    out = _dsa_run(monkeypatch, tmp_path, AGREEING, argv=("--runs", "triton-dense"))
    assert out["calls"] == ["triton-dense"] and out["reused"] == ["flashmla-dense"]
    assert dsa.INFORMATIONAL[0][0] in out["summary"]
    other = dsa.load_previous(tmp_path, "another checkpoint")
    assert other == {}


def test_sparse_mla_capture_sizes_follow_vllms_rule():
    """The warm-up compiles the scheduling kernel for the batches vLLM's decode graph
    capture uses: its own default sizes for MAX_NUM_SEQS, rounded up to DeepGEMM's
    SCHEDULE_ROWS."""
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode, VllmConfig

    cc = SimpleNamespace(
        cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE,
        max_cudagraph_capture_size=None,
        cudagraph_capture_sizes=None,
        pass_config=SimpleNamespace(enable_sp=False),
        post_init_cudagraph_sizes=lambda: None,
    )
    config = SimpleNamespace(
        model_config=SimpleNamespace(enforce_eager=False),
        compilation_config=cc,
        scheduler_config=SimpleNamespace(
            max_num_seqs=dsa.MAX_NUM_SEQS, max_num_batched_tokens=8192
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        performance_mode="balanced",
        num_speculative_tokens=0,
    )
    VllmConfig._set_cudagraph_sizes(config)
    assert cc.cudagraph_capture_sizes == dsa.capture_sizes()
    assert dsa.schedule_batches() == [dsa.SCHEDULE_ROWS]
    assert dsa.PROMPTS <= dsa.MAX_NUM_SEQS


HUNG_CHILD = """
import faulthandler, signal, subprocess, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
grandchild = subprocess.Popen(["sleep", "300"])
open(sys.argv[1], "w").write(str(grandchild.pid))
print("[e2e 00:00:00] compiling kernel one", flush=True)
print("engine noise", flush=True)
def stuck_in_capture():
    time.sleep(300)
stuck_in_capture()
"""


def _gone(pid: int) -> bool:
    import os
    import time

    for _ in range(50):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True
            os.kill(pid, 0)
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.1)
    return False


def test_sparse_mla_supervise_stops_a_hung_child_with_its_stack(
    monkeypatch, tmp_path, capsys
):
    """A child past its time is asked for its stack, then killed with everything it
    started; its whole output is in the log, its progress lines were echoed."""
    monkeypatch.setattr(dsa, "STACK_DUMP_WAIT_S", 1.0)
    monkeypatch.setattr(dsa, "PROGRESS_EVERY_S", 1.0)
    pid_file, log = tmp_path / "pid", tmp_path / "logs" / "hung.log"
    got = dsa.supervise(
        [sys.executable, "-c", HUNG_CHILD, str(pid_file)],
        dsa.child_env({}),
        log,
        3.0,
        "hung",
    )
    assert got["timed_out"] and got["rc"] != 0 and 3.0 <= got["seconds"] < 30
    text = log.read_text()
    assert "compiling kernel one" in text and "engine noise" in text
    assert "stuck_in_capture" in text  # the stack dump
    assert _gone(int(pid_file.read_text()))
    printed = capsys.readouterr().out
    assert "[e2e 00:00:00] compiling kernel one" in printed
    assert "engine noise" not in printed.splitlines()  # not echoed on its own
    assert "hung: running" in printed and "past 3 s" in printed
    reason = dsa.failure("hung", got, log)
    assert reason.startswith("hung stopped at the time budget") and str(log) in reason
    assert "stuck_in_capture" in reason  # the dump is among its last lines


def test_sparse_mla_engine_process_reads_the_childs_run(monkeypatch, tmp_path):
    """An engine child's run comes back through its result file; a child that fails
    is an error naming its exit and its log."""
    args = dsa.parse_args(["--out", str(tmp_path / "out"), "--work", str(tmp_path)])

    def fake_child(rc: int):
        script = (
            "import json, pathlib, sys\n"
            f"pathlib.Path({str(tmp_path)!r}, 'triton-dense.result.json')"
            ".write_text(json.dumps({'total_s': 1.5}))\n"
            f"print('child says bye'); sys.exit({rc})\n"
        )
        return lambda a, child: [sys.executable, "-c", script]

    monkeypatch.setattr(dsa, "child_command", fake_child(0))
    assert dsa.engine_process(args, "triton-dense", "nvrtc", 60) == {"total_s": 1.5}
    monkeypatch.setattr(dsa, "child_command", fake_child(3))
    with pytest.raises(RuntimeError, match="triton-dense exit 3 after") as e:
        dsa.engine_process(args, "triton-dense", "nvrtc", 60)
    assert "child says bye" in str(e.value)
    assert (tmp_path / "out" / dsa.LOGS_DIR / "triton-dense.log").is_file()


def test_sparse_mla_reports_after_every_engine(monkeypatch, tmp_path):
    """The JSON and the table are rewritten after each engine, so a call stopped from
    outside keeps what finished; an engine stopped at the budget is a failed row."""
    seen = []

    results = {
        **AGREEING,
        "exl3-sparse-fp8": RuntimeError(
            "exl3-sparse-fp8 stopped at the time budget after 99 s; log x\nlast line"
        ),
    }

    def engine_process(args, name, compiler, timeout_s):
        seen.append(json.loads((tmp_path / f"{dsa.RESULT}.json").read_text()))
        got = results[name]
        if isinstance(got, Exception):
            raise got
        return got

    monkeypatch.setattr(dsa, "engine_process", engine_process)
    monkeypatch.setattr(
        dsa,
        "warm_stage",
        lambda args, b: {"status": "ready", "cached": False, "compiler": "nvrtc"}
        | {"seconds": 12.0},
    )
    monkeypatch.setattr(dsa, "backend_missing", lambda b: None)
    args = dsa.parse_args(["--out", str(tmp_path), "--work", str(tmp_path)])
    out = dsa.run(
        args, "digest", dsa.Budget(3600), lambda r: dsa.write_report(tmp_path, r)
    )
    # Before each engine the report holds every engine before it.
    assert [sorted(s["runs"]) for s in seen[:3]] == [
        [],
        ["exl3-sparse-bf16"],
        ["exl3-sparse-bf16", "flashmla-sparse-bf16"],
    ]
    assert "exl3-sparse-fp8" in seen[3]["errors"]
    table = (tmp_path / f"{dsa.RESULT}.md").read_text()
    assert "| exl3-sparse-fp8 | FAILED: exl3-sparse-fp8 stopped at the time budget" in (
        table
    )
    assert "DeepGEMM indexer kernels ready (nvrtc, in 12.0 s)" in table
    assert not dsa.passed(out)


def test_sparse_mla_budget_skips_say_why(monkeypatch, tmp_path):
    """An engine that does not fit is skipped with its estimate and the time left:
    the first-run guess until a run of the same model was measured, then that run."""
    runs = {k: {**v, "total_s": 20.0} for k, v in AGREEING.items()}
    out = _dsa_run(monkeypatch, tmp_path, runs, budget=100)
    assert out["calls"] == []
    assert out["skipped"][0].startswith(
        "exl3-sparse-bf16 (time budget: needs about 300 s (first-run guess), "
    )
    assert "of --budget-s" in out["skipped"][0]
    assert "SKIPPED exl3-sparse-bf16 (time budget" in dsa.markdown(out)
    _dsa_run(monkeypatch, tmp_path, runs, argv=("--runs", "flashmla-dense"))
    out = _dsa_run(
        monkeypatch, tmp_path, runs, argv=("--runs", "triton-dense"), budget=100
    )
    assert out["calls"] == ["triton-dense"] and not out["skipped"]
    assert dsa.estimate("dense", runs) == (25.0, "20 s measured")


def test_sparse_mla_failed_warm_up_skips_the_sparse_engines(monkeypatch, tmp_path):
    warm = {"status": "failed", "reasons": ["DeepGEMM warm-up (nvrtc) exit 1\nlog"]}
    out = _dsa_run(monkeypatch, tmp_path, AGREEING, warm=warm)
    assert out["calls"] == ["flashmla-dense", "triton-dense"]
    assert all("DeepGEMM warm-up did not finish" in s for s in out["skipped"])
    assert len(out["skipped"]) == 5
    assert "DeepGEMM warm-up FAILED: DeepGEMM warm-up (nvrtc) exit 1" in dsa.markdown(
        out
    )
    only = _dsa_run(
        monkeypatch, tmp_path, AGREEING, argv=("--runs", "", "--warm-deepgemm", "only")
    )
    assert only["calls"] == [] and only["deepgemm"]["status"] == "ready"
    dense = _dsa_run(
        monkeypatch, tmp_path, AGREEING, argv=("--runs", "triton-dense"), warm=warm
    )
    assert dense["deepgemm"] is None and dense["calls"] == ["triton-dense"]


def test_sparse_mla_warm_stage_falls_back_and_reuses_its_cache(monkeypatch, tmp_path):
    """NVRTC first, nvcc when NVRTC fails; a cache whose record matches these shapes is
    used without a child; the engines get the compiler the cache was built with."""
    tried = []

    def warm_process(args, compiler, timeout_s):
        tried.append(compiler)
        if compiler == "nvrtc":
            raise RuntimeError("DeepGEMM warm-up (nvrtc) exit 1 after 4 s")
        record = {"key": dsa.warm_key(), "compiler": compiler, "seconds": 50.0}
        (args.work / dsa.JIT_CACHE).mkdir(parents=True, exist_ok=True)
        (args.work / dsa.JIT_CACHE / dsa.WARM_RECORD).write_text(json.dumps(record))
        return record

    monkeypatch.setattr(dsa, "warm_process", warm_process)
    args = dsa.parse_args(["--out", str(tmp_path), "--work", str(tmp_path)])
    got = dsa.warm_stage(args, dsa.Budget(3600))
    assert tried == ["nvrtc", "nvcc"] and got["compiler"] == "nvcc"
    assert got["status"] == "ready" and not got["cached"]
    again = dsa.warm_stage(args, dsa.Budget(3600))
    assert tried == ["nvrtc", "nvcc"] and again["cached"]
    env = dsa.jit_env(tmp_path, again["compiler"])
    assert env["DG_JIT_USE_NVRTC"] == "0"
    assert env["DG_JIT_CACHE_DIR"] == str(tmp_path / dsa.JIT_CACHE)
    assert dsa.warm_stage(args, dsa.Budget(10))["status"] == "ready"  # cached
    (tmp_path / dsa.JIT_CACHE / dsa.WARM_RECORD).unlink()
    short = dsa.warm_stage(args, dsa.Budget(10))
    assert short["status"] == "failed" and "not started" in short["reasons"][0]


def test_sparse_mla_resume_runs_only_what_is_missing(monkeypatch, tmp_path):
    """--resume: the same command, repeated, runs each engine once; a run stored for
    another checkpoint does not count."""
    runs = {k: {**v, "total_s": 20.0} for k, v in AGREEING.items()}
    first = ("--runs", "exl3-sparse-bf16,flashmla-dense", "--resume")
    assert _dsa_run(monkeypatch, tmp_path, runs, argv=first)["calls"] == [
        "exl3-sparse-bf16",
        "flashmla-dense",
    ]
    every = ("--runs", ",".join(dsa.RUNS), "--resume")
    out = _dsa_run(monkeypatch, tmp_path, runs, argv=every)
    assert out["calls"] == [n for n in dsa.RUNS if n not in first[1].split(",")]
    assert out["reused"] == ["exl3-sparse-bf16", "flashmla-dense"]
    assert sorted(out["runs"]) == sorted(dsa.RUNS) and dsa.passed(out)
    assert _dsa_run(monkeypatch, tmp_path, runs, argv=every)["calls"] == []
    assert len(_dsa_run(monkeypatch, tmp_path, runs)["calls"]) == len(dsa.RUNS)
    doc = json.loads((tmp_path / dsa.RUNS_DIR / "triton-dense.json").read_text())
    doc["checkpoint"] = "another"
    (tmp_path / dsa.RUNS_DIR / "triton-dense.json").write_text(json.dumps(doc))
    assert _dsa_run(monkeypatch, tmp_path, runs, argv=every)["calls"] == [
        "triton-dense"
    ]


def test_qwen3_next_layout_checkpoints(tmp_path):
    """--layout qwen3-next: the EXL3 checkpoint has the mtp. layers at mtp_bits, the
    twin every tensor dequantized (fc at its real 2 x hidden -> hidden) and nothing
    added (Qwen3NextMTP loads the model's own embedding and head); the default layout
    keeps its JSON name."""
    from safetensors.torch import load_file

    assert mtp.parse_args([]).layout == mtp.DEEPSEEK
    assert mtp.parse_args(["--layout", "qwen3-next"]).layout == mtp.QWEN3_NEXT
    assert mtp.result_name(mtp.DEEPSEEK) == "mtp_e2e"
    assert mtp.result_name(mtp.QWEN3_NEXT) == "mtp_e2e-qwen3-next"
    exl3, bf16 = mtp.write_checkpoints(tmp_path, mtp.QWEN3_NEXT)
    cfg = json.loads((exl3 / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_next" and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["quantization_config"]["mtp_bits"] == mtp.MTP_BITS
    q = load_file(exl3 / "model.safetensors")
    for module in (
        "mtp.fc",
        "mtp.layers.0.self_attn.q_proj",
        "mtp.layers.0.mlp.experts.7.down_proj",
        "mtp.layers.0.mlp.shared_expert.up_proj",
    ):
        assert f"{module}.trellis" in q, module
    for norm in ("mtp.pre_fc_norm_hidden", "mtp.pre_fc_norm_embedding", "mtp.norm"):
        assert q[f"{norm}.weight"].shape == (cfg["hidden_size"],), norm
    w = load_file(bf16 / "model.safetensors")
    assert not any(k.endswith((".trellis", ".suh", ".svh")) for k in w)
    assert w["mtp.fc.weight"].shape == (cfg["hidden_size"], 2 * cfg["hidden_size"])
    assert {k for k in w if k.startswith("mtp.")} == {
        k.rpartition(".")[0] + ".weight" if k.endswith(".trellis") else k
        for k in q
        if k.startswith("mtp.") and not k.endswith((".suh", ".svh", ".mcg"))
    }
    assert not (bf16 / "model-mtp-shared.safetensors").exists()
