# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plan tuner's host side (scripts/bench/): the real models' shapes per
tensor-parallel rank (model_shapes.py), tune_plans.py's arguments, its count of the
work, and a long run split over calls (time budget, then --merge)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from vllm_exl3.bench import model_shapes as ms
from vllm_exl3.bench import tune_plans as tp
from vllm_exl3.codec import plan_table


def _layer(model: str, tp_size: int, name: str) -> list[ms.RankShape]:
    (lin,) = [x for x in ms.model_linears(ms.BY_NAME[model]) if x.name == name]
    return ms.rank_shapes(lin, tp_size)


def test_qwen3_8b_layers_per_rank_are_what_vllm_builds():
    # QKVParallelLinear(4096, head_size 128, 32 heads, 8 kv heads) at TP 2 holds
    # 32/2 * 128 q and 8/2 * 128 k and v columns per rank; the others split n or k.
    assert (
        _layer("qwen3-8b", 2, "self_attn.qkv_proj")
        == [ms.RankShape(4096, (2048, 512, 512))] * 2
    )
    assert (
        _layer("qwen3-8b", 2, "self_attn.o_proj") == [ms.RankShape(2048, (4096,))] * 2
    )
    assert (
        _layer("qwen3-8b", 2, "mlp.gate_up_proj")
        == [ms.RankShape(4096, (6144, 6144))] * 2
    )
    assert _layer("qwen3-8b", 2, "mlp.down_proj") == [ms.RankShape(6144, (4096,))] * 2
    assert [x.name for x in ms.model_linears(ms.BY_NAME["qwen3-8b"])] == [
        "self_attn.qkv_proj",
        "self_attn.o_proj",
        "mlp.gate_up_proj",
        "mlp.down_proj",
        "lm_head",
    ]


def test_kv_heads_fewer_than_ranks_are_replicated():
    # Qwen3-30B-A3B: 4 kv heads over 8 ranks, one head (128 columns) per rank, each
    # head on two ranks; q: 32 heads / 8.
    assert (
        _layer("qwen3-30b-a3b", 8, "self_attn.qkv_proj")
        == [ms.RankShape(2048, (512, 128, 128))] * 8
    )


def test_vocab_parallel_head_computes_the_128_window_of_its_range():
    # Qwen3's vocab 151936 over 4 ranks: 37984 each, not 128-aligned, so the inner
    # ranks' windows cover one more block (tp_rules.column_window).
    shapes = _layer("qwen3-8b", 4, "lm_head")
    assert [s.widths for s in shapes] == [(38016,), (38144,), (38144,), (38016,)]
    assert all(s.k == 4096 for s in shapes)


def test_fused_shards_of_mla_and_gated_delta_net():
    # DeepSeek-V3's fused_qkv_a_proj is replicated: q_lora_rank 1536 and kv_lora_rank
    # + rope 576, stored padded to 640; q_b_proj splits 128 heads x 192.
    for size in (1, 8):
        assert _layer("deepseek-v3", size, "self_attn.fused_qkv_a_proj") == [
            ms.RankShape(7168, (1536, 640))
        ]
    assert _layer("deepseek-v3", 8, "self_attn.q_b_proj")[0] == ms.RankShape(
        1536, (3072,)
    )
    # Qwen3.5-27B: the q shard carries the output gate (2 x 24 heads x 256); the
    # Gated DeltaNet's in_proj_qkvz is q, k, v, z (16 x 128 keys, 48 x 128 values)
    # from the two stored modules in_proj_qkv and in_proj_z.
    assert _layer("qwen3.5-27b", 1, "self_attn.qkv_proj") == [
        ms.RankShape(5120, (12288, 1024, 1024))
    ]
    assert _layer("qwen3.5-27b", 1, "linear_attn.in_proj_qkvz") == [
        ms.RankShape(5120, (2048, 2048, 6144, 6144))
    ]
    assert _layer("qwen3.5-27b", 8, "self_attn.qkv_proj")[0] == ms.RankShape(
        5120, (1536, 256, 256)
    )


def test_a_tp_the_loader_refuses_is_skipped_with_the_reason():
    shapes, skipped = ms.collect([ms.BY_NAME["qwen3-4b"], ms.BY_NAME["glm-4.5-air"]])
    # Qwen3-4B's down_proj k = 9728 / 8 = 1216 is not a multiple of 128; GLM-4.5-Air's
    # dense MLP (10944) splits into 128-blocks at no TP size above 1.
    assert len(skipped) == 4
    assert skipped[0].startswith("qwen3-4b tp=8: ") and "1216" in skipped[0]
    assert all(s.startswith("glm-4.5-air tp=") for s in skipped[1:])
    assert not any("qwen3-4b tp=8" in src for s in shapes for src in s.sources)
    with pytest.raises(ms.ShapeError, match="not a multiple of 128"):
        ms.model_rank_shapes(ms.BY_NAME["qwen3-4b"], 8)


def test_shapes_are_deduplicated_by_table_key():
    shapes, _ = ms.collect(ms.MODELS)
    keys = [(s.k, s.n, s.shards) for s in shapes]
    assert len(keys) == len(set(keys))
    # Qwen3-8B's and Llama-3.1-8B's attention are one shape at every TP size.
    (qkv,) = [s for s in shapes if (s.k, s.widths) == (4096, (4096, 1024, 1024))]
    assert "llama-3.1-8b tp=1 self_attn.qkv_proj" in qkv.sources
    assert "qwen3-8b tp=1 self_attn.qkv_proj" in qkv.sources
    heads = [s for s in shapes if s.lm_head_only]
    assert heads and all(all("lm_head" in x for x in s.sources) for s in heads)
    assert all(s.k % 128 == 0 and all(w % 128 == 0 for w in s.widths) for s in shapes)


def test_held_out_shapes_are_in_no_tuned_model():
    tuned, _ = ms.collect(ms.MODELS)
    seen = {(s.k, s.n, s.shards) for s in tuned}
    held = ms.held_out_shapes((1, 2))
    assert held and not any((s.k, s.n, s.shards) in seen for s in held)
    assert {m.name for m in ms.resolve(["all"])} == {m.name for m in ms.MODELS}
    with pytest.raises(ms.ShapeError, match="unknown model nope"):
        ms.resolve(["nope"])


def test_arguments_and_their_defaults():
    args = tp.parse_args(["--models", "all"])
    assert args.tp == [1, 2, 4, 8] and args.bits == [2, 3, 4, 5, 6, 8]
    assert args.codebooks == [2] and args.dtype == ["bfloat16"]
    assert args.budget_s is None and args.merge is None
    assert tp.parse_args(["--check-gap"]).tp == [1]
    # The half rates exist only with MUL1: alone with another codebook it is an error,
    # beside MUL1 it is skipped for the other.
    with pytest.raises(SystemExit):
        tp.parse_args(["--models", "all", "--bits", "2.5", "--codebooks", "0"])
    args = tp.parse_args(["--models", "all", "--bits", "2.5", "--codebooks", "0", "2"])
    assert args.bits == [2.5]
    for bad in (["--models", "nope"], ["--tp", "0"], ["--gap-buckets", "3"]):
        with pytest.raises(SystemExit):
            tp.parse_args(bad)
    # No shapes asked for: the 4.0bpw fixture, as before.
    assert tp.parse_args([]).checkpoints == [tp.FIXTURE]


def test_dry_run_counts_the_work(capsys):
    assert (
        tp.main(["--models", "qwen3-8b", "--tp", "2", "--bits", "4", "--dry-run"]) == 0
    )
    out = capsys.readouterr().out.splitlines()
    # qkv, o, gate/up, down at 14 buckets (1..8192) and the lm_head at 11 (1..1024).
    assert out[0] == (
        "tune_plans: 5 layer keys to time (5 layers), 67 (key, bucket) timings"
    )
    key = plan_table.layer_key(4096, 3072, 4, 2, 3, torch.bfloat16)
    assert f"{key} m<=8192 (14 buckets)" in out
    head = plan_table.layer_key(4096, 76032, 4, 2, 1, torch.bfloat16)
    assert f"{head} m<=1024 (11 buckets)" in out


def _plan(m: int) -> dict:
    return {
        "path": "fused",
        "bm": 16,
        "split_k": m,
        "wgmma": 0,
        "stream_blocks": 0,
        "early_release": 1,
        "spread": 0,
    }


def _fake_timer(job: tp.Job):
    for dtype, buckets in job.missing.items():
        for m in buckets:
            yield dtype, m, _plan(m), f"{job.key(dtype)} m<={m}"


def test_a_run_split_by_its_budget_resumes_with_merge(tmp_path, capsys):
    argv = ["--models", "qwen3-8b", "--tp", "2", "--bits", "4", "--max-tokens", "4"]
    args = tp.parse_args(argv)
    jobs = tp.plan_jobs(args, {})
    assert [j.timings for j in jobs] == [3, 3, 3, 3, 3]
    path = tmp_path / "device_name=TEST.json"
    # A clock at 10 s per reading and a 45 s budget: two layers start, then it stops.
    ticks = iter(range(0, 10_000, 10))
    table: dict = {}
    done, left = tp.run_jobs(jobs, table, path, _fake_timer, 45, lambda: next(ticks))
    assert (done, left) == (6, 3)
    first = json.loads(path.read_text())
    assert list(first) == sorted(jobs[i].key("bfloat16") for i in range(2))
    # The next call merges that table and times only what it lacks.
    merged = tp.read_table(path)
    rest = tp.plan_jobs(tp.parse_args(argv + ["--merge", str(path)]), merged)
    assert [j.key("bfloat16") for j in rest] == [j.key("bfloat16") for j in jobs[2:]]
    assert tp.run_jobs(rest, merged, path, _fake_timer, None) == (9, 0)
    final = json.loads(path.read_text())
    assert set(final) == {j.key("bfloat16") for j in jobs}
    assert all(list(b) == ["1", "2", "4"] for b in final.values())
    # A key holding only some buckets is completed, not skipped or redone.
    partial = {jobs[0].key("bfloat16"): {"1": _plan(1)}}
    again = tp.plan_jobs(args, partial)
    assert again[0].missing == {"bfloat16": [2, 4]} and len(again) == 5


def test_merge_refuses_what_is_not_a_plan_table(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"k=1": [1, 2]}))
    with pytest.raises(SystemExit, match="not a plan table"):
        tp.read_table(bad)
    bad.write_text("{")
    with pytest.raises(SystemExit, match="bad.json"):
        tp.read_table(bad)
    # The first of several calls that all name one file finds none yet.
    assert tp.read_table(tmp_path / "missing.json") == {}


def test_written_table_is_sorted_by_key_and_bucket(tmp_path):
    path = tmp_path / "t.json"
    tp.write_table(path, {"b": {"16": _plan(2), "2": _plan(1)}, "a": {"1": _plan(1)}})
    data = json.loads(path.read_text())
    assert list(data) == ["a", "b"] and list(data["b"]) == ["2", "16"]
    assert not (tmp_path / "t.json.tmp").exists()


def test_a_key_shared_with_an_lm_head_gets_every_bucket():
    args = tp.parse_args(["--max-tokens", "4096", "--bench-shapes"])
    head = (4096, (151936,), 4.0, 2, True, ["qwen3-8b tp=1 lm_head"])
    other = (4096, (151936,), 4.0, 2, False, ["some other layer"])
    (alone,) = tp.plan_jobs(args, {}, [head])
    assert alone.missing["bfloat16"][-1] == tp.LM_HEAD_MAX_TOKENS
    (shared,) = tp.plan_jobs(args, {}, [head, other])
    assert shared.missing["bfloat16"][-1] == 4096
    assert shared.sources == ["qwen3-8b tp=1 lm_head", "some other layer"]


def test_check_gap_defaults_to_the_held_out_layers():
    args = tp.parse_args(["--check-gap", "--bits", "4"])
    jobs = tp.gap_jobs(args)
    held = {(s.k, s.widths) for s in ms.held_out_shapes((1,))}
    assert jobs and {(j.k, j.widths) for j in jobs} == held
    assert all((j.bits, j.codebook) == (4, 2) for j in jobs)
    # Every bucket of --gap-buckets, but an lm_head's only up to its cap.
    for j in jobs:
        got = tp.gap_buckets(args, j, "bfloat16")
        head = all("lm_head" in s for s in j.sources)
        top = tp.LM_HEAD_MAX_TOKENS if head else max(tp.GAP_BUCKETS)
        assert got == [m for m in tp.GAP_BUCKETS if m <= top]
    # Chosen shapes instead: the models asked for.
    chosen = tp.gap_jobs(tp.parse_args(["--check-gap", "--models", "qwen3-8b"]))
    assert all(any(s.startswith("qwen3-8b tp=1") for s in j.sources) for j in chosen)


def test_codebook_transfer_runs_the_other_codebooks_table_plans():
    with pytest.raises(SystemExit):
        tp.parse_args(["--codebook-transfer"])  # a measurement of --check-gap only
    args = tp.parse_args(
        ["--check-gap", "--codebook-transfer", "--models", "qwen3-8b", "--bits", "4"]
    )
    job = tp.gap_jobs(args)[0]
    assert job.codebook == tp.MUL1
    split = [16, 0, 16, 4, 0, 0, 1, 0]
    whole = [64, 0, 64, 1, 1, 0, 1, 0]
    mcg = replace(job, codebook=1).key("bfloat16")
    table = {mcg: [split, whole], job.key("bfloat16"): [whole]}
    header = [1, 0, 0, 0]

    def every(entry, header):
        return True

    # Only mcg is tabled besides mul1 (the layer's own is no transfer); its entries
    # follow the header as layer_plans lays them out.
    got = tp.other_codebook_plans(job, "bfloat16", header, table, every)
    assert got == {1: [*header, *split, *whole]}

    # Entries the header's mode does not allow are left out, as layer_plans does.
    def one_pass(entry, header):
        return entry[3] == 1

    assert tp.other_codebook_plans(job, "bfloat16", header, table, one_pass) == {
        1: [*header, *whole]
    }
    assert tp.other_codebook_plans(job, "float16", header, table, every) == {}


def test_codebook_transfer_summary_counts_points_within_the_limit():
    rows = [
        {
            "codebook": "mul1",
            "ratio": 1.0,
            "transfer_ratio": {"mcg": 1.02, "3inst": 1.3},
        },
        {"codebook": "mul1", "ratio": 1.2, "transfer_ratio": {"mcg": 1.08}},
        {"codebook": "mcg", "ratio": 1.0, "transfer_ratio": {"mul1": 1.0}},
        {"codebook": "mcg", "ratio": 1.0},  # a point without --codebook-transfer
    ]
    assert tp.transfer_summary(rows) == [
        "  3inst plans on mul1 layers: 0 of 1 points within 1.10x of the best "
        "(the layer's own: 1), worst x1.300",
        "  mcg plans on mul1 layers: 2 of 2 points within 1.10x of the best "
        "(the layer's own: 1), worst x1.080",
        "  mul1 plans on mcg layers: 1 of 1 points within 1.10x of the best "
        "(the layer's own: 1), worst x1.000",
    ]
