# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Write the per-GPU plan table of `_C::exl3_linear` (as fused_moe's benchmark_moe.py
--tune writes its configs): for each layer shape, bitrate, codebook, dtype and
token-count bucket, time the op's candidate plans on this GPU (`_C::exl3_time_plans`)
and keep the fastest. With --check-gap, measure instead how far the plans vLLM runs by
default are from the best the tuner finds.

Shapes (any combination):
  --models NAME... | all   the linears of real models as vLLM runs them, per rank at
                           each --tp size (model_shapes.py), at every --bits and
                           --codebooks;
  CHECKPOINT_DIR...        the layers of EXL3 checkpoints (each linear as one shard, and
                           the q/k/v and gate/up groups fused as vLLM runs them when
                           their bitrate and codebook match);
  --bench-shapes           the benchmark shapes (exl3_oracle.real_layers).
Without any, the 4.0bpw fixture. Table keys are plan_table.layer_key.

The output is `device_name=<GPU>.json` in --out, named as the overlay's plans.py looks
it up; commit it under overlay/vllm/model_executor/layers/quantization/exl3/configs/.
A long run is split over several calls: the table is rewritten after every layer,
--budget-s stops starting new layers after that many seconds, and --merge FILE starts
from an earlier table and times only the buckets it lacks (a FILE not written yet is an
empty table, so every call of a split run can name the same file). Before timing, the
counts of layer keys and (key, bucket) timings are printed; --dry-run prints them (and
each key) and exits, without a GPU.

    python -m vllm_exl3.bench.tune_plans --models all --tp 1 2 4 8 \
        --bits 2 3 4 5 6 8 --codebooks 2 --budget-s 540 [--merge FILE] [--out DIR]
    python -m vllm_exl3.bench.tune_plans [CHECKPOINT_DIR ...] [--bench-shapes] \
        [--max-tokens 8192] [--dtype bfloat16 --dtype float16]

--check-gap: for each layer (default: model_shapes.HELD_OUT's layers that no tuned
model has, at --tp; or the shapes chosen as above) and each bucket of --gap-buckets,
time cold, as bench_linear.py does (weight pools of >= 256 MB, every call of a pass in
one CUDA graph, medians of replays), the plan vLLM runs by default (plans.layer_plans:
this GPU's table, from VLLM_TUNED_CONFIG_FOLDER if set, else the cost model) and the
--gap-candidates fastest of the timer's candidates; prints default / best per (layer,
bucket) and writes plan_gap.json to --out. The acceptance "default within 10 % of the
best" is every ratio <= 1.10 (exit status 1 otherwise).

    python -m vllm_exl3.bench.tune_plans --check-gap --bits 4 --codebooks 2 [--tp 1]

--codebook-transfer (with --check-gap, on tabled shapes): also time at each point the
table's plans of the same layer at the other codebooks, which is what a table keyed
without the codebook would run, and count how many stay within 10 % of the best.

    python -m vllm_exl3.bench.tune_plans --check-gap --codebook-transfer \
        --models qwen3-8b --bits 4 --codebooks 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import safe_open
from vllm_exl3.bench import bench_linear, model_shapes
from vllm_exl3.codec import plan_table
from vllm_exl3.repo import ROOT as REPO
from vllm_exl3.testing import exl3_oracle as vk

FIXTURE = REPO / "tests" / "fixtures" / "qwen3-tiny" / "exl3-4.0bpw"
# Modules vLLM fuses into one linear, in shard order.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# Trellis bitrates the kernels are built for; the half rates only with MUL1 (exl3_oracle
# RATES / HALF_RATES).
RATES = (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
MUL1 = 2
CODEBOOK_NAMES = {0: "3inst", 1: "mcg", 2: "mul1"}
DEFAULT_BITS = (2, 3, 4, 5, 6, 8)
# MUL1: ExLlamaV3 1.6.5's default codebook, so the one most checkpoints carry.
DEFAULT_CODEBOOKS = (MUL1,)
# vLLM computes logits only for the sampled positions, at most one per running sequence
# in a step, and its default max_num_seqs on 80 GB-class GPUs is 1024: an lm_head is
# not tuned above that bucket (the cost model plans the rare larger call).
LM_HEAD_MAX_TOKENS = 1024
# --check-gap defaults: the fastest of the timer's candidates (warm) that are timed
# cold beside the default plan, and the buckets checked.
GAP_CANDIDATES = 3
GAP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
GAP_LIMIT = 1.10
DTYPES = ("bfloat16", "float16")


@dataclass
class Job:
    """One layer to time: a kernel run (k, shard widths) at a bitrate and codebook,
    and per dtype the buckets still missing from the table."""

    k: int
    widths: tuple[int, ...]
    bits: float
    codebook: int
    missing: dict[str, list[int]] = field(default_factory=dict)  # dtype -> buckets
    sources: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return sum(self.widths)

    def key(self, dtype: str) -> str:
        return plan_table.layer_key(
            self.k,
            self.n,
            self.bits,
            self.codebook,
            len(self.widths),
            getattr(torch, dtype),
        )

    @property
    def timings(self) -> int:
        return sum(len(b) for b in self.missing.values())


def codebook_of(names: set[str], prefix: str) -> int:
    return 2 if f"{prefix}.mul1" in names else 1 if f"{prefix}.mcg" in names else 0


def checkpoint_shapes(path: Path) -> set[tuple[int, tuple[int, ...], float, int]]:
    """(k, shard widths, bits, codebook) of every linear of an EXL3 checkpoint."""
    modules: dict[str, tuple[int, int, float, int]] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            names = set(st.keys())
            for name in names:
                if name.endswith(".trellis"):
                    prefix = name.removesuffix(".trellis")
                    shape = st.get_slice(name).get_shape()
                    modules[prefix] = (
                        shape[0] * 16,
                        shape[1] * 16,
                        shape[2] / 16,
                        codebook_of(names, prefix),
                    )
    shapes = set()
    for prefix, (k, n, bits, cb) in modules.items():
        shapes.add((k, (n,), bits, cb))
        parent, _, leaf = prefix.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf == group[0]:
                members = [modules.get(f"{parent}.{g}") for g in group]
                if all(
                    m is not None and m[0] == k and m[2:] == (bits, cb) for m in members
                ):
                    shapes.add((k, tuple(m[1] for m in members), bits, cb))
    return shapes


def bench_shapes() -> list[tuple[int, tuple[int, ...], float, int]]:
    return [(k, tuple(w), float(b), cb) for k, w, b, cb in vk.real_layers()]


def rate_error(bits: float, codebook: int) -> str | None:
    if bits not in RATES:
        return f"bitrate {bits:g} is not one the kernels are built for ({RATES})"
    if bits % 1 and codebook != MUL1:
        return f"the half rate {bits:g} exists only with the mul1 codebook (2)"
    return None


def buckets_for(max_tokens: int, lm_head_only: bool) -> list[int]:
    cap = min(max_tokens, LM_HEAD_MAX_TOKENS) if lm_head_only else max_tokens
    return plan_table.warmup_m_values(cap)


def layers(
    args: argparse.Namespace,
) -> list[tuple[int, tuple[int, ...], float, int, bool, list[str]]]:
    """Every (k, widths, bits, codebook, lm_head only, sources) the arguments ask for,
    in order: the models' shapes for each codebook and bitrate, then the checkpoints',
    then the benchmark shapes; the first of equal table keys wins."""
    out = []
    if args.models:
        shapes, skipped = model_shapes.collect(
            model_shapes.resolve(args.models), args.tp
        )
        for line in skipped:
            print(f"tune_plans: skipped {line}", flush=True)
        for cb in args.codebooks:
            for bits in args.bits:
                for s in shapes:
                    out.append((s.k, s.widths, bits, cb, s.lm_head_only, s.sources))
    for ckpt in args.checkpoints:
        for k, w, bits, cb in sorted(checkpoint_shapes(ckpt)):
            out.append((k, w, bits, cb, False, [str(ckpt)]))
    if args.bench_shapes:
        for k, w, bits, cb in bench_shapes():
            out.append((k, w, bits, cb, False, ["benchmark"]))
    return out


def plan_jobs(
    args: argparse.Namespace, table: dict, chosen: Iterable | None = None
) -> list[Job]:
    """The layers still to time against `table` (an existing table: buckets it holds
    are skipped), deduplicated by table key."""
    jobs: dict[tuple, Job] = {}
    heads_only: dict[tuple, bool] = {}
    for k, widths, bits, cb, lm_head, sources in (
        layers(args) if chosen is None else chosen
    ):
        ident = (k, sum(widths), len(widths), bits, cb)
        job = jobs.setdefault(ident, Job(k, tuple(widths), bits, cb))
        job.sources += [s for s in sources if s not in job.sources]
        # Tuned to the lm_head's cap only while every layer of this key is one.
        heads_only[ident] = heads_only.get(ident, True) and lm_head
    for ident, job in jobs.items():
        for dtype in args.dtype:
            have = table.get(job.key(dtype), {})
            buckets = buckets_for(args.max_tokens, heads_only[ident])
            missing = [m for m in buckets if str(m) not in have]
            if missing:
                job.missing[dtype] = missing
    return [j for j in jobs.values() if j.missing]


def read_table(path: Path | None) -> dict:
    """The table to extend: --merge's file; none yet (the first of several calls that
    all name the same file) is an empty table."""
    if path is None:
        return {}
    if not path.exists():
        print(f"tune_plans: --merge {path} does not exist yet: an empty table")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"tune_plans: --merge {path}: {e}") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, dict) for v in data.values()
    ):
        raise SystemExit(
            f"tune_plans: --merge {path}: not a plan table (an object of layer keys, "
            "each an object of buckets)"
        )
    return data


def write_table(path: Path, table: dict) -> None:
    """The table, keys and buckets sorted, written whole or not at all."""
    ordered = {
        key: dict(sorted(buckets.items(), key=lambda b: int(b[0])))
        for key, buckets in sorted(table.items())
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(ordered, indent=1) + "\n")
    tmp.replace(path)


def summary(jobs: Sequence[Job], table: dict, merge: Path | None) -> str:
    keys = sum(len(j.missing) for j in jobs)
    timings = sum(j.timings for j in jobs)
    held = f", {len(table)} keys already in {merge}" if merge else ""
    return (
        f"tune_plans: {keys} layer keys to time ({len(jobs)} layers), {timings} "
        f"(key, bucket) timings{held}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="*", type=Path)
    ap.add_argument(
        "--models",
        nargs="+",
        metavar="NAME",
        help="real models' linears (model_shapes.py): names, or all "
        f"({', '.join(m.name for m in model_shapes.MODELS)}; held out: "
        f"{', '.join(m.name for m in model_shapes.HELD_OUT)})",
    )
    ap.add_argument(
        "--tp",
        nargs="+",
        type=int,
        default=None,
        help="tensor-parallel sizes of --models (default 1 2 4 8; --check-gap: 1)",
    )
    ap.add_argument(
        "--bits", nargs="+", type=float, default=list(DEFAULT_BITS), help="bitrates"
    )
    ap.add_argument(
        "--codebooks",
        nargs="+",
        type=int,
        default=list(DEFAULT_CODEBOOKS),
        choices=sorted(CODEBOOK_NAMES),
        help="0 3inst, 1 mcg, 2 mul1 (default: mul1)",
    )
    ap.add_argument(
        "--bench-shapes",
        action="store_true",
        help="also the benchmark shapes (exl3_oracle.real_layers)",
    )
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--dtype", action="append", choices=DTYPES)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--merge", type=Path, help="an existing table to extend")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new layer after this many seconds (the table keeps what ran)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print the layer keys and timing counts, time nothing",
    )
    ap.add_argument(
        "--check-gap",
        action="store_true",
        help="time the default plans against the tuner's best instead of tuning",
    )
    ap.add_argument("--gap-candidates", type=int, default=GAP_CANDIDATES)
    ap.add_argument("--gap-buckets", nargs="+", type=int, default=list(GAP_BUCKETS))
    ap.add_argument(
        "--codebook-transfer",
        action="store_true",
        help="with --check-gap: also time the table's plans of each other codebook",
    )
    ap.add_argument("--ext")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ["bfloat16"]
    if args.tp is None:
        args.tp = [1] if args.check_gap else list(model_shapes.TP_SIZES)
    if any(t < 1 for t in args.tp):
        ap.error(f"--tp sizes must be positive, got {args.tp}")
    if args.max_tokens < 1:
        ap.error(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.codebook_transfer and not args.check_gap:
        ap.error("--codebook-transfer is a measurement of --check-gap")
    if args.gap_candidates < 1:
        ap.error(f"--gap-candidates must be at least 1, got {args.gap_candidates}")
    bad = [m for m in args.gap_buckets if m < 1 or m & (m - 1)]
    if bad:
        ap.error(f"--gap-buckets must be powers of two, got {bad}")
    if args.models:
        try:
            model_shapes.resolve(args.models)
        except model_shapes.ShapeError as e:
            ap.error(str(e))
    for bits in args.bits:
        # A half rate is skipped under the codebooks that lack it, as long as one of
        # those asked for has it.
        errors = [rate_error(bits, cb) for cb in args.codebooks]
        if all(errors):
            ap.error(f"--bits {bits:g}: {errors[0]}")
    if not (args.models or args.checkpoints or args.bench_shapes or args.check_gap):
        args.checkpoints = [FIXTURE]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.check_gap:
        return check_gap(args)
    table = read_table(args.merge)
    jobs = [j for j in plan_jobs(args, table) if not rate_error(j.bits, j.codebook)]
    print(summary(jobs, table, args.merge), flush=True)
    if args.dry_run:
        for j in jobs:
            for dtype, buckets in j.missing.items():
                print(f"{j.key(dtype)} m<={buckets[-1]} ({len(buckets)} buckets)")
        return 0
    return tune(args, jobs, table)


# ---- on the GPU (vLLM with the overlay, and the kernels) ----


# A layer's timings: (dtype, bucket, the plan as a table entry, the progress line).
Timings = Iterator[tuple[str, int, dict, str]]


def run_jobs(
    jobs: Sequence[Job],
    table: dict,
    path: Path,
    time_job: Callable[[Job], Timings],
    budget_s: float | None,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[int, int]:
    """Time `jobs` in order into `table`, rewriting `path` after every layer (a run
    stopped at its time limit keeps what it measured); no layer is started once
    `budget_s` seconds have passed. Returns (timings done, layers left)."""
    total = sum(j.timings for j in jobs)
    done, start = 0, clock()
    for i, job in enumerate(jobs):
        if budget_s is not None and clock() - start > budget_s:
            return done, len(jobs) - i
        for dtype, m, plan, line in time_job(job):
            table.setdefault(job.key(dtype), {})[str(m)] = plan
            done += 1
            print(line, flush=True)
        write_table(path, table)
        spent = clock() - start
        eta = spent / done * (total - done) if done else 0.0
        print(
            f"tune_plans: {i + 1}/{len(jobs)} layers, {done}/{total} timings, "
            f"{spent:.0f} s, ~{eta:.0f} s left",
            flush=True,
        )
    return done, 0


def tune(args: argparse.Namespace, jobs: list[Job], table: dict) -> int:
    # The kernels first: the overlay's modules expect the ops registered.
    vk.load_extension(args.ext)
    from vllm.model_executor.layers.quantization.exl3 import ops, plans
    from vllm.model_executor.layers.quantization.exl3.workspace import (
        MAX_WORKSPACE_FLOATS,
    )

    device = torch.device("cuda", torch.cuda.current_device())
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / plans.config_file_name(plans.device_file_name(device))
    gen = torch.Generator(device="cuda").manual_seed(0)
    # Modes and pins off: the table serves the default mode (the op drops entries that
    # a mode forbids, and VLLM_EXL3_PLAN bypasses the table).
    header = vk.header()

    def time_job(job: Job) -> Timings:
        layer = vk.random_layer(gen, job.k, job.widths, job.bits, job.codebook)
        for dtype, buckets in job.missing.items():
            key = job.key(dtype)
            for m in buckets:
                x = torch.randn(m, job.k, generator=gen, device="cuda")
                # As the layer runs in vLLM: partial sums that do not fit the capped
                # workspace are not an option (kernels.MAX_WORKSPACE_FLOATS).
                floats = min(m * job.n, MAX_WORKSPACE_FLOATS)
                timed = ops.exl3_time_plans(
                    ops.Exl3LinearArgs(
                        x.to(getattr(torch, dtype)),
                        layer.trellis,
                        layer.suh,
                        layer.svh,
                        None,
                        list(job.widths),
                        job.codebook,
                        header,
                        vk.workspace(floats)[:floats],
                    )
                )
                if not timed:
                    raise SystemExit(
                        f"tune_plans: {key} m<={m}: the op offered no candidate"
                    )
                best, ns = min(timed, key=lambda t: t[1])
                line = (
                    f"{key} m<={m}: {plans.describe(best)} {ns / 1e3:.1f} us "
                    f"({len(timed)} candidates)"
                )
                yield dtype, m, plans.entry_to_json(best), line

    start = time.perf_counter()
    done, left = run_jobs(jobs, table, path, time_job, args.budget_s)
    torch.cuda.empty_cache()
    write_table(path, table)
    plans.load_table.cache_clear()
    plans.load_table(path)  # the loader accepts what was written
    rest = f"; budget reached, {left} layers left (rerun with --merge {path})"
    print(
        f"wrote {path}: {len(table)} layer keys, {done} timings in "
        f"{time.perf_counter() - start:.0f} s" + (rest if left else ""),
        flush=True,
    )
    return 0


def gap_jobs(args: argparse.Namespace) -> list[Job]:
    """--check-gap's layers: the chosen shapes, else the held-out models' own."""
    if args.models or args.checkpoints or args.bench_shapes:
        chosen = layers(args)
    else:
        chosen = [
            (s.k, s.widths, bits, cb, s.lm_head_only, s.sources)
            for cb in args.codebooks
            for bits in args.bits
            for s in model_shapes.held_out_shapes(args.tp)
        ]
    chosen = [c for c in chosen if not rate_error(c[2], c[3])]
    return plan_jobs(args, {}, chosen)


def gap_buckets(args: argparse.Namespace, job: Job, dtype: str) -> list[int]:
    """--gap-buckets up to the last the layer is tuned for (an lm_head's cap)."""
    return [m for m in args.gap_buckets if m <= job.missing[dtype][-1]]


def cold_us(
    pool: list, x: torch.Tensor, plans_arg: list[int], ws: torch.Tensor
) -> float:
    """bench_linear's cold time of the op with `plans_arg` on x: every copy of the pool
    once per pass, the pass in one CUDA graph, the median over replays per call."""
    calls = [
        lambda L=L: torch.ops._C.exl3_linear(
            x, L.trellis, L.suh, L.svh, None, L.widths, L.codebook, plans_arg, ws
        )
        for L in pool
    ]
    us, _ = bench_linear.graph_time_us(calls, x.shape[0])
    return us


def other_codebook_plans(
    job: Job,
    dtype: str,
    header: list[int],
    table: dict[str, list[list[int]]],
    allowed: Callable[[list[int], list[int]], bool],
) -> dict[int, list[int]]:
    """Per other codebook the table holds this layer at, the op's `plans` argument built
    from those entries as plans.layer_plans builds it from the layer's own (`allowed`:
    its plans.entry_allowed): the plans a table keyed without the codebook would run."""
    out = {}
    for other in sorted(CODEBOOK_NAMES):
        entries = table.get(replace(job, codebook=other).key(dtype))
        if other != job.codebook and entries:
            kept = [e for e in entries if allowed(e, header)]
            out[other] = [*header, *(v for e in kept for v in e)]
    return out


def gap_point(
    args: argparse.Namespace, job: Job, dtype: str, pool: list, m: int, gen
) -> dict:
    """One (layer, bucket) of --check-gap: the default plan and the timer's fastest
    candidates, each timed cold."""
    from vllm.model_executor.layers.quantization.exl3 import ops, plans
    from vllm.model_executor.layers.quantization.exl3.workspace import (
        MAX_WORKSPACE_FLOATS,
    )

    key = job.key(dtype)
    device = torch.device("cuda", torch.cuda.current_device())
    default = plans.layer_plans(key, device)
    x = torch.randn(m, job.k, generator=gen, device="cuda").to(getattr(torch, dtype))
    # The workspace as vLLM sizes it: partial sums beyond the cap run split 1.
    floats = min(m * job.n, MAX_WORKSPACE_FLOATS)
    ws = torch.zeros(max(floats, 1), dtype=torch.float32, device="cuda")
    resolved = ops.exl3_plan(
        pool[0].trellis,
        len(job.widths),
        job.codebook,
        dtype == "bfloat16",
        m,
        default,
        floats,
    )
    entry = resolved[: ops.PLAN_FIELDS]
    source = "table" if resolved[ops.PLAN_FIELDS] == ops.SOURCE_TABLE else "model"
    # The timer's candidates, fastest first (timed warm, on one copy), without pins.
    timed = ops.exl3_time_plans(
        ops.Exl3LinearArgs(
            x,
            pool[0].trellis,
            pool[0].suh,
            pool[0].svh,
            None,
            list(job.widths),
            job.codebook,
            vk.header(),
            ws,
        )
    )
    warm = [e for e, _ in sorted(timed, key=lambda t: t[1])]
    cands = [e for e in warm[: args.gap_candidates] if e[1:] != entry[1:]]
    default_us = cold_us(pool, x, default, ws)
    header = default[: ops.PLAN_HEADER_LEN]
    cand_us = [cold_us(pool, x, header + [m, *c[1:]], ws) for c in cands]
    transfer_us = (
        {
            CODEBOOK_NAMES[cb]: cold_us(pool, x, flat, ws)
            for cb, flat in other_codebook_plans(
                job, dtype, header, plans.device_table(device), plans.entry_allowed
            ).items()
        }
        if args.codebook_transfer
        else {}
    )
    best_us = min([default_us, *cand_us, *transfer_us.values()])
    pick = warm[0] if warm else None
    # The timer's own pick is cands[0] unless it is the default plan.
    pick_us = default_us if pick is None or pick[1:] == entry[1:] else cand_us[0]
    return {
        "key": key,
        "m": m,
        "default": plans.describe(entry),
        "default_source": source,
        "default_us": round(default_us, 2),
        "tuner_pick": plans.describe(pick) if pick else None,
        "tuner_pick_us": round(pick_us, 2),
        "best_us": round(best_us, 2),
        "ratio": round(default_us / best_us, 3),
        "ratio_to_pick": round(default_us / pick_us, 3),
        "candidates": len(warm),
        "sources": job.sources,
        **(
            {
                "codebook": CODEBOOK_NAMES[job.codebook],
                "transfer_us": {c: round(us, 2) for c, us in transfer_us.items()},
                "transfer_ratio": {
                    c: round(us / best_us, 3) for c, us in transfer_us.items()
                },
            }
            if args.codebook_transfer
            else {}
        ),
    }


def transfer_summary(rows: list[dict]) -> list[str]:
    """--codebook-transfer's lines: per (table codebook -> layer codebook), how many
    points its plans run within GAP_LIMIT of the best, beside the layer's own table
    plans (the default) on the same points."""
    pairs: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in rows:
        for other, ratio in r.get("transfer_ratio", {}).items():
            pairs.setdefault((other, r["codebook"]), []).append((ratio, r["ratio"]))
    lines = []
    for (other, mine), got in sorted(pairs.items()):
        within = sum(1 for t, _ in got if t <= GAP_LIMIT)
        own = sum(1 for _, d in got if d <= GAP_LIMIT)
        lines.append(
            f"  {other} plans on {mine} layers: {within} of {len(got)} points within "
            f"{GAP_LIMIT:.2f}x of the best (the layer's own: {own}), worst "
            f"x{max(t for t, _ in got):.3f}"
        )
    return lines


def check_gap(args: argparse.Namespace) -> int:
    # The kernels first: the overlay's modules expect the ops registered.
    vk.load_extension(args.ext)
    jobs = gap_jobs(args)
    points = sum(len(gap_buckets(args, j, d)) for j in jobs for d in args.dtype)
    print(
        f"tune_plans --check-gap: {len(jobs)} layers x {len(args.dtype)} dtypes, "
        f"{points} (layer, bucket) points, each the default plan and up to "
        f"{args.gap_candidates} candidates timed cold",
        flush=True,
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, start = [], time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    for job in jobs:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print("tune_plans --check-gap: time budget reached, stopping", flush=True)
            break
        pool = bench_linear.cold_layers(
            gen, job.k, job.n, job.bits, job.codebook, widths=job.widths
        )
        for dtype in args.dtype:
            for m in gap_buckets(args, job, dtype):
                row = gap_point(args, job, dtype, pool, m, gen)
                rows.append(row)
                print(
                    f"{row['key']} m={m}: default ({row['default_source']}) "
                    f"{row['default_us']:.1f} us, best {row['best_us']:.1f} us, "
                    f"tuner's pick {row['tuner_pick_us']:.1f} us: x{row['ratio']:.3f}",
                    flush=True,
                )
        del pool
        torch.cuda.empty_cache()
        record = {
            "device": torch.cuda.get_device_name(),
            "command": " ".join(["tune_plans.py", *sys.argv[1:]]),
            "rows": rows,
        }
        (args.out / "plan_gap.json").write_text(json.dumps(record, indent=1))
    over = [r for r in rows if r["ratio"] > GAP_LIMIT]
    worst = max(rows, key=lambda r: r["ratio"]) if rows else None
    print(
        f"\ntune_plans --check-gap: {len(rows)} (layer, bucket) points, "
        f"{len(rows) - len(over)} within {GAP_LIMIT:.2f}x of the best"
        + (
            f"; worst x{worst['ratio']:.3f} ({worst['key']} m={worst['m']})"
            if worst
            else ""
        ),
        flush=True,
    )
    for r in over:
        print(
            f"  over: {r['key']} m={r['m']}: x{r['ratio']:.3f} (default {r['default']}"
            f", {r['default_source']})"
        )
    transfer = transfer_summary(rows)
    if transfer:
        print("codebook transfer:", *transfer, sep="\n", flush=True)
    return 0 if not over else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    sys.exit(main())
