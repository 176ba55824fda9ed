# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plan settings and tables without a GPU (exl3/plans.py, env_compat.py, ops.py):
the VLLM_EXL3_PLAN parser and its errors, the op's header, the per-device JSON table's
loader and lookup, the deprecated per-knob variables, and the fake implementation of the
new schema."""

from __future__ import annotations

import json

import pytest
import torch
from vllm.model_executor.layers.quantization.exl3 import ops, plans
from vllm.model_executor.layers.quantization.exl3.env_compat import (
    adopt_deprecated_env_names,
)
from vllm.model_executor.layers.quantization.exl3.plans import (
    Exl3PlanError,
    PlanPins,
    parse_plan_setting,
)


def test_parser_accepts_every_key():
    pins = parse_plan_setting("bm=128, split_k=4,wgmma=1,spread=1,split_k_traffic=0.5")
    assert pins == PlanPins(
        bm=128, split_k=4, wgmma=1, spread=1, reconstruct_m=0, split_k_traffic=0.5
    )
    assert parse_plan_setting("stream_k=1,bm=256") == PlanPins(
        bm=256, stream_k=1, reconstruct_m=0
    )
    assert parse_plan_setting("path=fused") == PlanPins(reconstruct_m=0)
    assert parse_plan_setting("path=original") == PlanPins(
        basis=ops.PATH_ORIGINAL, reconstruct_m=1
    )
    assert parse_plan_setting("path=rotated,reconstruct_m=512,bm=64") == PlanPins(
        bm=64, basis=ops.PATH_ROTATED, reconstruct_m=512
    )
    assert parse_plan_setting("reconstruct_m=0") == PlanPins(reconstruct_m=0)
    assert parse_plan_setting("") == PlanPins() and not PlanPins().pinned
    assert PlanPins(split_k_traffic=0.5).pinned


@pytest.mark.parametrize(
    "text, message",
    [
        ("bm=48", "bm=48 must be one of"),
        ("bm=x", "not an integer"),
        ("split_k=0", "split_k=0 must be >= 1"),
        ("wgmma=2", "wgmma=2 must be one of 0, 1"),
        ("blocks=4", "unknown key 'blocks'"),
        ("bm", "is not key=value"),
        ("bm=64,bm=128", "bm is given twice"),
        ("path=cublas", "must be fused, rotated or original"),
        ("split_k_traffic=-1", "split_k_traffic"),
        ("split_k_traffic=nan", "split_k_traffic"),
        ("stream_k=1,split_k=4", "exclude each other"),
        ("stream_k=1,wgmma=0", "only for the wgmma engine"),
        ("stream_k=1,bm=64", "BM 128 and 256 only"),
        ("bm=256,wgmma=0", "bm=256 exists only for the wgmma engine"),
        ("bm=16,wgmma=1", "mma.sync tier"),
        ("path=fused,reconstruct_m=512", "contradicts"),
        ("path=original,bm=64", "runs no fused GEMM"),
        ("path=rotated,reconstruct_m=0", "never takes it"),
    ],
)
def test_parser_errors_name_the_rule(text, message):
    with pytest.raises(Exl3PlanError, match="VLLM_EXL3_PLAN") as e:
        parse_plan_setting(text)
    assert message in str(e.value)


def test_header_layout():
    header = plans.plan_header(True, True, parse_plan_setting("bm=64,split_k=2"))
    assert len(header) == ops.PLAN_HEADER_LEN
    assert header == [
        ops.PLAN_VERSION,
        ops.FLAG_DETERMINISTIC | ops.FLAG_BATCH_INVARIANT,
        -1,
        64,
        2,
        -1,
        -1,
        -1,
        0,
        250,
    ]


def test_header_follows_the_settings(monkeypatch):
    monkeypatch.delenv("VLLM_EXL3_PLAN", raising=False)
    monkeypatch.setenv("VLLM_EXL3_DETERMINISTIC", "1")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert (
        plans.current_header()[1] == ops.FLAG_DETERMINISTIC | ops.FLAG_BATCH_INVARIANT
    )
    monkeypatch.setenv("VLLM_EXL3_PLAN", "bm=999")
    with pytest.raises(Exl3PlanError, match="bm=999"):
        plans.current_header()


PLAN = {
    "path": "fused",
    "bm": 16,
    "split_k": 8,
    "wgmma": 0,
    "stream_blocks": 0,
    "early_release": 1,
    "spread": 1,
}
KEY = plans.layer_key(4096, 12288, 4.0, 1, 3, torch.bfloat16)


def test_layer_key_and_file_name():
    assert KEY == "k=4096,n=12288,bits=4,codebook=1,shards=3,dtype=bfloat16"
    assert plans.layer_key(256, 512, 2.5, 2, 1, torch.float16).endswith(
        "bits=2.5,codebook=2,shards=1,dtype=float16"
    )
    assert plans.config_file_name("NVIDIA_H200") == "device_name=NVIDIA_H200.json"


def write_table(tmp_path, data) -> object:
    path = tmp_path / "device_name=TEST.json"
    path.write_text(json.dumps(data))
    plans.load_table.cache_clear()
    return path


def test_table_loads_sorted_entries(tmp_path):
    path = write_table(
        tmp_path,
        {
            KEY: {
                "64": {**PLAN, "bm": 64, "split_k": 2, "spread": 0},
                "1": PLAN,
                "4096": {**PLAN, "path": "rotated", "split_k": 1},
            }
        },
    )
    table = plans.load_table(path)
    assert table[KEY] == [
        [1, 0, 16, 8, 0, 0, 1, 1],
        [64, 0, 64, 2, 0, 0, 1, 0],
        [4096, ops.PATH_ROTATED, 16, 1, 0, 0, 1, 1],
    ]
    assert plans.entry_to_json(table[KEY][0]) == PLAN
    assert plans.load_table(tmp_path / "absent.json") == {}


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "JSON object"),
        ({KEY: []}, "keyed by bucket"),
        ({KEY: {"3": PLAN}}, "not a power of two"),
        ({KEY: {"one": PLAN}}, "not a power of two"),
        ({KEY: {"1": {**PLAN, "path": "cublas"}}}, "unknown path"),
        (
            {KEY: {"1": {**PLAN, "split_k": -1}}},
            "split_k must be a non-negative integer",
        ),
        ({KEY: {"1": {**PLAN, "wgmma": True}}}, "wgmma must be a non-negative integer"),
        (
            {KEY: {"1": {k: v for k, v in PLAN.items() if k != "spread"}}},
            "exactly the keys",
        ),
    ],
)
def test_table_errors(tmp_path, data, message):
    with pytest.raises(Exl3PlanError, match=message):
        plans.load_table(write_table(tmp_path, data))


def test_bad_json(tmp_path):
    path = tmp_path / "device_name=BAD.json"
    path.write_text("{")
    with pytest.raises(Exl3PlanError, match="not valid JSON"):
        plans.load_table(path)


def test_layer_plans_from_the_table(tmp_path, monkeypatch):
    table = plans.load_table(
        write_table(
            tmp_path,
            {
                KEY: {
                    "1": PLAN,
                    "2048": {**PLAN, "path": "original", "split_k": 1, "spread": 0},
                }
            },
        )
    )
    monkeypatch.setattr(plans, "device_table", lambda device: table)
    monkeypatch.setattr(plans, "_tuned", {})
    for name in ("VLLM_EXL3_PLAN", "VLLM_EXL3_DETERMINISTIC", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)
    cuda = torch.device("cuda", 0)
    flat = plans.layer_plans(KEY, cuda)
    header = flat[: ops.PLAN_HEADER_LEN]
    assert header == plans.current_header() and header[1] == 0
    assert flat[ops.PLAN_HEADER_LEN :] == [*table[KEY][0], *table[KEY][1]]
    assert plans.table_entries(KEY, cuda)[1] == "table"
    assert plans.table_entries("k=1", cuda) == ([], "cost-model")
    # Deterministic mode drops the split-k entry (the op would refuse it): the cost
    # model, which then plans without split-k, serves that bucket.
    monkeypatch.setenv("VLLM_EXL3_DETERMINISTIC", "1")
    assert plans.layer_plans(KEY, cuda)[ops.PLAN_HEADER_LEN :] == table[KEY][1]
    # Batch invariance admits neither: every bucket goes to the cost model's invariant
    # plan.
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert len(plans.layer_plans(KEY, cuda)) == ops.PLAN_HEADER_LEN
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    monkeypatch.delenv("VLLM_EXL3_DETERMINISTIC")
    # Forced plans: only the header, whose pins the cost model applies to every bucket.
    monkeypatch.setenv("VLLM_EXL3_PLAN", "bm=64")
    assert plans.layer_plans(KEY, cuda)[3] == 64
    assert len(plans.layer_plans(KEY, cuda)) == ops.PLAN_HEADER_LEN
    # Tuned entries (VLLM_EXL3_TUNE=1) take precedence over the table.
    monkeypatch.delenv("VLLM_EXL3_PLAN")
    plans.record_tuned(KEY, [[8, 0, 16, 1, 0, 0, 0, 0]])
    assert plans.table_entries(KEY, cuda) == ([[8, 0, 16, 1, 0, 0, 0, 0]], "tuned")


def test_no_table_off_cuda():
    assert plans.device_table(torch.device("cpu")) == {}


def test_checked_in_tables_parse():
    for path in plans.CONFIG_DIR.glob("device_name=*.json"):
        plans.load_table.cache_clear()
        for key, entries in plans.load_table(path).items():
            assert key.startswith("k=") and entries, path


def test_deprecated_plan_knobs_become_the_plan_setting():
    env = {
        "VLLM_EXL3_BM": "128",
        "CUDA_EXL3_SPLIT_K": "4",
        "VLLM_EXL3_RECONSTRUCT_M": "-1",
        "CUDA_EXL3_DETERMINISTIC": "1",
    }
    assert adopt_deprecated_env_names(env) == [
        "VLLM_EXL3_DETERMINISTIC",
        "VLLM_EXL3_SPLIT_K",
        "VLLM_EXL3_PLAN",
    ]
    assert env == {
        "CUDA_EXL3_SPLIT_K": "4",
        "CUDA_EXL3_DETERMINISTIC": "1",
        "VLLM_EXL3_DETERMINISTIC": "1",
        "VLLM_EXL3_PLAN": "bm=128,split_k=4,reconstruct_m=0",
    }
    assert parse_plan_setting(env["VLLM_EXL3_PLAN"]) == PlanPins(
        bm=128, split_k=4, reconstruct_m=0
    )
    # An explicit VLLM_EXL3_PLAN wins over the old knobs.
    env = {"VLLM_EXL3_WGMMA": "0", "VLLM_EXL3_PLAN": "bm=64"}
    assert adopt_deprecated_env_names(env) == []
    assert env == {"VLLM_EXL3_PLAN": "bm=64"}
    env = {"CUDA_EXL3_RECONSTRUCT_BASIS": "rotated"}
    adopt_deprecated_env_names(env)
    assert env["VLLM_EXL3_PLAN"] == "path=rotated"


def test_fake_has_the_new_schema():
    x = torch.empty(7, 256, dtype=torch.bfloat16, device="meta")
    trellis = torch.empty(16, 48, 64, dtype=torch.int16, device="meta")
    suh = torch.empty(2, 256, dtype=torch.float16, device="meta")
    svh = torch.empty(768, dtype=torch.float16, device="meta")
    ws = torch.empty(0, dtype=torch.float32, device="meta")
    y = ops.exl3_linear_fake(
        x,
        trellis,
        suh,
        svh,
        None,
        [384, 384],
        1,
        plans.plan_header(False, False, PlanPins()),
        ws,
    )
    assert y.shape == (7, 768) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    w = ops.exl3_reconstruct_fake(trellis, 1)
    assert w.shape == (256, 768) and w.dtype == torch.float16
