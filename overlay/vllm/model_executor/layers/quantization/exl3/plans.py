# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Kernel plans of `_C::exl3_linear`: which GEMM tier, split-k and path runs each token
count.

A layer's plans are an int list passed to the op (ops.py documents the layout): a header
with the mode flags (VLLM_EXL3_DETERMINISTIC, vLLM's VLLM_BATCH_INVARIANT) and the debug
pins of VLLM_EXL3_PLAN, then one entry per token-count bucket (m rounded up to a power
of two). The entries come, as fused_moe's tuned configs do, from a checked-in per-device
JSON table under `configs/` (`device_name=<GPU>.json`, written by
scripts/bench/tune_plans.py), keyed by the layer's shape (plan_table.py says by which
fields and why); a bucket without an entry is planned by the op's deterministic cost
model. With VLLM_EXL3_TUNE=1 the load-time
warm-up times the candidates instead (never during capture). So the same GPU model and
shapes give the same plans in every process. The load-time preparation (below) resolves
every layer's plans, sizes the workspace and warms the layer up.
"""

import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import vllm.envs as envs
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.utils.platform_utils import get_device_name_as_file_name

from . import ops
from .plan_table import warmup_m_values
from .workspace import MAX_WORKSPACE_FLOATS, workspace_for

logger = init_logger(__name__)

CONFIG_DIR = Path(__file__).parent / "configs"
SETTING = "VLLM_EXL3_PLAN"
# Per-mille resolution of split_k_traffic in the op's header.
PERMILLE = 1000
MMA_BMS = (16, 32, 64, 128)
WGMMA_BMS = (64, 128, 256)
PATHS = {
    "fused": ops.PATH_FUSED,
    "original": ops.PATH_ORIGINAL,
    "rotated": ops.PATH_ROTATED,
}
PATH_NAMES = {v: k for k, v in PATHS.items()}
# The JSON entry's fields in the op's entry order (after m_max).
ENTRY_KEYS = (
    "path",
    "bm",
    "split_k",
    "wgmma",
    "stream_blocks",
    "early_release",
    "spread",
)


class Exl3PlanError(ValueError):
    pass


class Exl3Run(NamedTuple):
    """One `_C::exl3_linear` call of a layer: a run of equal-bitrate shards
    (layout.KernelRun), its tensors viewed in the layer's parameters."""

    key: str  # layer_key: the plan table's key for this configuration
    trellis: torch.Tensor  # int16 [k/16, n/16, 16 * bits]
    suh: torch.Tensor  # fp16 [shards, k]
    svh: torch.Tensor  # fp16 [n]
    shard_widths: list[int]
    codebook: int


@dataclass(frozen=True)
class PlanPins:
    """VLLM_EXL3_PLAN's pins, as the op's header encodes them (-1 / 0 = free)."""

    bm: int = 0
    split_k: int = 0
    wgmma: int = -1
    stream_k: int = -1
    spread: int = -1
    basis: int = -1
    reconstruct_m: int = -1
    split_k_traffic: float = 0.25

    @property
    def pinned(self) -> bool:
        return self != PlanPins()


def _int(key: str, value: str, allowed=None, minimum=None) -> int:
    try:
        v = int(value)
    except ValueError:
        raise Exl3PlanError(f"{SETTING}: {key}={value!r} is not an integer") from None
    if allowed is not None and v not in allowed:
        raise Exl3PlanError(
            f"{SETTING}: {key}={v} must be one of {', '.join(map(str, allowed))}"
        )
    if minimum is not None and v < minimum:
        raise Exl3PlanError(f"{SETTING}: {key}={v} must be >= {minimum}")
    return v


def parse_plan_setting(text: str) -> PlanPins:
    """Parses VLLM_EXL3_PLAN ("bm=128,split_k=4,wgmma=1,stream_k=0,spread=0,
    path=fused|rotated|original,reconstruct_m=512,split_k_traffic=0.25")."""
    values: dict[str, str] = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise Exl3PlanError(f"{SETTING}: {item!r} is not key=value")
        if key not in (
            "bm",
            "split_k",
            "wgmma",
            "stream_k",
            "spread",
            "path",
            "reconstruct_m",
            "split_k_traffic",
        ):
            raise Exl3PlanError(
                f"{SETTING}: unknown key {key!r} (known: bm, split_k, wgmma, stream_k, "
                "spread, "
                f"path, reconstruct_m, split_k_traffic)"
            )
        if key in values:
            raise Exl3PlanError(f"{SETTING}: {key} is given twice")
        values[key] = value
    pins: dict = {}
    if "bm" in values:
        pins["bm"] = _int("bm", values["bm"], allowed=sorted(set(MMA_BMS + WGMMA_BMS)))
    if "split_k" in values:
        pins["split_k"] = _int("split_k", values["split_k"], minimum=1)
    for key in ("wgmma", "stream_k", "spread"):
        if key in values:
            pins[key] = _int(key, values[key], allowed=(0, 1))
    if "reconstruct_m" in values:
        pins["reconstruct_m"] = _int(
            "reconstruct_m", values["reconstruct_m"], minimum=0
        )
    if "split_k_traffic" in values:
        try:
            t = float(values["split_k_traffic"])
        except ValueError:
            t = float("nan")
        if not t > 0 or t * PERMILLE < 1 or t == float("inf"):
            raise Exl3PlanError(
                f"{SETTING}: split_k_traffic={values['split_k_traffic']!r} "
                f"must be a positive number (at least 0.001)"
            )
        pins["split_k_traffic"] = t
    fused_keys = [
        k for k in ("bm", "split_k", "wgmma", "stream_k", "spread") if k in values
    ]
    path = values.get("path")
    if path is not None and path not in PATHS:
        raise Exl3PlanError(
            f"{SETTING}: path={path!r} must be fused, rotated or original"
        )
    if pins.get("stream_k") == 1:
        if "split_k" in pins:
            raise Exl3PlanError(
                f"{SETTING}: stream_k=1 and split_k exclude each other "
                f"(stream-k sets its own k ranges)"
            )
        if pins.get("wgmma") == 0:
            raise Exl3PlanError(
                f"{SETTING}: stream_k=1 exists only for the wgmma engine, "
                f"which wgmma=0 turns off"
            )
        if pins.get("bm", 128) < 128:
            raise Exl3PlanError(
                f"{SETTING}: stream_k=1 is built for BM 128 and 256 only, "
                f"not bm={pins['bm']}"
            )
    if pins.get("bm") == 256 and pins.get("wgmma") == 0:
        raise Exl3PlanError(
            f"{SETTING}: bm=256 exists only for the wgmma engine, which "
            f"wgmma=0 turns off"
        )
    if pins.get("bm") in (16, 32) and pins.get("wgmma") == 1:
        raise Exl3PlanError(
            f"{SETTING}: bm={pins['bm']} is an mma.sync tier; the wgmma "
            f"engine's are 64, 128 and 256"
        )
    if path == "fused":
        if pins.get("reconstruct_m", 0) > 0:
            raise Exl3PlanError(
                f"{SETTING}: path=fused never reconstructs, so "
                f"reconstruct_m={pins['reconstruct_m']} contradicts it"
            )
        pins["reconstruct_m"] = 0
    elif path is not None:
        pins["basis"] = PATHS[path]
        if fused_keys and "reconstruct_m" not in pins:
            raise Exl3PlanError(
                f"{SETTING}: path={path} runs no fused GEMM, so "
                f"{', '.join(fused_keys)} would "
                "do nothing (give reconstruct_m to reconstruct only from that many "
                "rows)"
            )
        pins.setdefault("reconstruct_m", 1)
        if pins["reconstruct_m"] == 0:
            raise Exl3PlanError(
                f"{SETTING}: path={path} with reconstruct_m=0 never takes it"
            )
    elif fused_keys and "reconstruct_m" not in pins:
        # Forcing the fused GEMM's shape means running it at every m.
        pins["reconstruct_m"] = 0
    return PlanPins(**pins)


def batch_invariant() -> bool:
    return bool(getattr(envs, "VLLM_BATCH_INVARIANT", False))


def current_pins() -> PlanPins:
    text = envs.VLLM_EXL3_PLAN
    return parse_plan_setting(text) if text else PlanPins()


def plan_header(deterministic: bool, invariant: bool, pins: PlanPins) -> list[int]:
    flags = (ops.FLAG_DETERMINISTIC if deterministic else 0) | (
        ops.FLAG_BATCH_INVARIANT if invariant else 0
    )
    return [
        ops.PLAN_VERSION,
        flags,
        pins.basis,
        pins.bm,
        pins.split_k,
        pins.wgmma,
        pins.stream_k,
        pins.spread,
        pins.reconstruct_m,
        round(pins.split_k_traffic * PERMILLE),
    ]


def current_header() -> list[int]:
    return plan_header(
        bool(envs.VLLM_EXL3_DETERMINISTIC), batch_invariant(), current_pins()
    )


def uses_workspace(entry: list[int]) -> bool:
    """Whether a plan entry ([m_max, path, bm, split_k, wgmma, stream_blocks, ...]) sums
    partials in the split-k workspace."""
    return entry[1] == ops.PATH_FUSED and (entry[3] > 1 or entry[5] > 0)


def entry_allowed(entry: list[int], header: list[int]) -> bool:
    """Whether a table entry suits the header's modes (the op rejects the others)."""
    flags = header[1]
    if flags & ops.FLAG_DETERMINISTIC and uses_workspace(entry):
        return False
    return not (
        flags & ops.FLAG_BATCH_INVARIANT
        and (entry[1] != ops.PATH_FUSED or entry[3] != 1 or entry[4] or entry[5])
    )


# ---- the checked-in tables ----


def device_file_name(device: torch.device) -> str:
    """fused_moe's device naming: the H200 family shares the NVIDIA_H200 tables."""
    name = get_device_name_as_file_name(device.index or 0)
    if "H200" in name.split("_"):
        name = "NVIDIA_H200"
    return name


def config_file_name(device_name: str) -> str:
    return f"device_name={device_name}.json"


def entry_from_json(bucket: int, plan: dict, where: str) -> list[int]:
    if not isinstance(plan, dict) or set(plan) != set(ENTRY_KEYS):
        raise Exl3PlanError(
            f"{where}: a plan has exactly the keys {', '.join(ENTRY_KEYS)}"
        )
    if plan["path"] not in PATHS:
        raise Exl3PlanError(f"{where}: unknown path {plan['path']!r}")
    ints = [PATHS[plan["path"]]]
    for key in ENTRY_KEYS[1:]:
        v = plan[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise Exl3PlanError(
                f"{where}: {key} must be a non-negative integer, got {v!r}"
            )
        ints.append(v)
    return [bucket, *ints]


def entry_to_json(entry: list[int]) -> dict:
    plan = dict(zip(ENTRY_KEYS, entry[1 : 1 + len(ENTRY_KEYS)]))
    plan["path"] = PATH_NAMES[plan["path"]]
    return plan


def parse_table(data: object, where: str) -> dict[str, list[list[int]]]:
    """{layer key: {"<bucket>": plan}} -> {layer key: entries sorted by bucket}."""
    if not isinstance(data, dict):
        raise Exl3PlanError(f"{where}: the table is a JSON object keyed by layer shape")
    table = {}
    for key, buckets in data.items():
        if not isinstance(buckets, dict):
            raise Exl3PlanError(f"{where} [{key}]: plans are an object keyed by bucket")
        entries = []
        for bucket, plan in buckets.items():
            if (
                not bucket.isdigit()
                or int(bucket) < 1
                or int(bucket) & (int(bucket) - 1)
            ):
                raise Exl3PlanError(
                    f"{where} [{key}]: bucket {bucket!r} is not a power of two"
                )
            entries.append(
                entry_from_json(int(bucket), plan, f"{where} [{key}][{bucket}]")
            )
        table[key] = sorted(entries)
    return table


@functools.cache
def load_table(path: Path) -> dict[str, list[list[int]]]:
    """The table in `path` ({} when there is none for this device)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise Exl3PlanError(f"EXL3 plan table {path}: not valid JSON ({e})") from None
    return parse_table(data, f"EXL3 plan table {path.name}")


def device_table(device: torch.device) -> dict[str, list[list[int]]]:
    """The tables for `device`'s GPU model: vLLM's VLLM_TUNED_CONFIG_FOLDER first (as
    for fused_moe's configs), then the checked-in ones; {} off CUDA."""
    if device.type != "cuda":
        return {}
    name = config_file_name(device_file_name(device))
    folder = getattr(envs, "VLLM_TUNED_CONFIG_FOLDER", None)
    if folder and (Path(folder) / name).is_file():
        return load_table(Path(folder) / name)
    return load_table(CONFIG_DIR / name)


# Entries tuned in this process (VLLM_EXL3_TUNE=1), by layer key; they take precedence.
_tuned: dict[str, list[list[int]]] = {}


def table_entries(key: str, device: torch.device) -> tuple[list[list[int]], str]:
    if key in _tuned:
        return _tuned[key], "tuned"
    entries = device_table(device).get(key)
    return (entries, "table") if entries else ([], "cost-model")


def layer_plans(key: str, device: torch.device) -> list[int]:
    """The op's `plans` argument for a layer configuration under current settings."""
    header = current_header()
    if current_pins().pinned:
        return header  # forced plans: the cost model applies the pins to every bucket
    entries, _ = table_entries(key, device)
    flat = list(header)
    for e in entries:
        if entry_allowed(e, header):
            flat.extend(e)
    return flat


def record_tuned(key: str, entries: list[list[int]]) -> None:
    _tuned[key] = sorted(entries)


def describe(entry: list[int]) -> str:
    plan = entry_to_json(entry)
    return " ".join(f"{k}={v}" for k, v in plan.items())


# Load-time preparation of `_C::exl3_linear`: plans, workspace, first launches.
#
# For each distinct layer configuration, right after loading and before vLLM profiles
# memory or captures graphs:
#
# - with VLLM_EXL3_TUNE=1, the candidate plans of every token-count bucket (powers of
#   two up to the scheduler's token budget) are timed (`_C::exl3_time_plans`) and the
#   fastest recorded for this process (record_tuned);
# - each bucket's plan is resolved (`_C::exl3_plan`, no kernel runs): the split-k
#   workspace is sized to the largest partial sums any of them needs, and with
#   VLLM_EXL3_LOG_PLANS=1 each is logged, one line per configuration and bucket, so
#   two processes' logs can be compared;
# - with VLLM_EXL3_WARMUP=1 (default), the layer runs once per bucket on zeros, so the
#   first requests do not pay the kernels' first launches (module loading, cuBLAS
#   heuristics).

# Activations + output of one warm-up or timing call are capped at this many bytes: a
# bucket above it (an lm_head at a huge token budget) is left to the cost model and
# first use rather than risk the memory before vLLM has sized its KV cache.
MAX_WARMUP_BYTES = 1 << 30
# Used when no vLLM config is current (a layer built outside the engine, as in tests).
DEFAULT_MAX_TOKENS = 8192

_warmed: set[tuple] = set()
# Configurations already timed in this process (VLLM_EXL3_TUNE).
_timed: set[str] = set()
_logged: set[tuple] = set()


def max_tokens() -> int:
    config = get_current_vllm_config_or_none()
    if config is None or config.scheduler_config is None:
        return DEFAULT_MAX_TOKENS
    return int(config.scheduler_config.max_num_batched_tokens)


def _fits(m: int, k: int, n: int, dtype: torch.dtype) -> bool:
    return m * (k + n) * dtype.itemsize <= MAX_WARMUP_BYTES


def tune_run(run: Exl3Run, dtype: torch.dtype) -> None:
    """Time every bucket's candidates for run's configuration (once per process)."""
    if run.key in _timed:
        return
    _timed.add(run.key)
    k, n = run.trellis.shape[0] * 16, run.trellis.shape[1] * 16
    header = current_header()
    entries, start = [], time.perf_counter()
    for m in warmup_m_values(max_tokens()):
        if not _fits(m, k, n, dtype):
            break
        x = torch.zeros(m, k, dtype=dtype, device=run.trellis.device)
        ws = torch.zeros(
            min(m * n, MAX_WORKSPACE_FLOATS),
            dtype=torch.float32,
            device=run.trellis.device,
        )
        timed = ops.exl3_time_plans(
            ops.Exl3LinearArgs(
                x,
                run.trellis,
                run.suh,
                run.svh,
                None,
                run.shard_widths,
                run.codebook,
                header,
                ws,
            )
        )
        if timed:
            entries.append(min(timed, key=lambda t: t[1])[0])
    record_tuned(run.key, entries)
    torch.cuda.synchronize(run.trellis.device)
    logger.info(
        "EXL3: plans timed for %s at %d token counts in %.2f s",
        run.key,
        len(entries),
        time.perf_counter() - start,
    )


def resolve_runs(
    runs: list[Exl3Run], run_plans: list[list[int]], dtype: torch.dtype
) -> None:
    """Size the device's workspace for every bucket's plan; log the plans if asked."""
    if not runs:
        return
    need = 0
    bf16 = dtype == torch.bfloat16
    for run, table in zip(runs, run_plans):
        n = run.trellis.shape[1] * 16
        _, source = table_entries(run.key, run.trellis.device)
        log = envs.VLLM_EXL3_LOG_PLANS and (run.key, tuple(table)) not in _logged
        if log:
            _logged.add((run.key, tuple(table)))
        for m in warmup_m_values(max_tokens()):
            plan = ops.exl3_plan(
                run.trellis,
                len(run.shard_widths),
                run.codebook,
                bf16,
                m,
                table,
                MAX_WORKSPACE_FLOATS,
            )
            entry, src = plan[: ops.PLAN_FIELDS], plan[ops.PLAN_FIELDS]
            if uses_workspace(entry):
                need = max(need, m * n)
            if log:
                origin = (
                    source
                    if src == ops.SOURCE_TABLE
                    else ("pinned" if current_pins().pinned else "cost-model")
                )
                logger.info(
                    "EXL3 plan %s m<=%d: %s (%s)",
                    run.key,
                    m,
                    describe(entry),
                    origin,
                )
    workspace_for(runs[0].trellis.device).reserve(need)


def warm_up_layer(
    key: tuple,
    k: int,
    n: int,
    dtype: torch.dtype,
    device: torch.device,
    forward: Callable[[torch.Tensor], torch.Tensor],
) -> int:
    """Call forward(x) on zeros [m, k] for every bucket, once per distinct key; returns
    the number of calls made (0 when this configuration was already warmed)."""
    if key in _warmed or not envs.VLLM_EXL3_WARMUP:
        return 0
    _warmed.add(key)
    calls, start = 0, time.perf_counter()
    for m in warmup_m_values(max_tokens()):
        if not _fits(m, k, n, dtype):
            logger.debug(
                "EXL3 warm-up %s: m = %d and up left to first use (memory cap)", key, m
            )
            break
        forward(torch.zeros(m, k, dtype=dtype, device=device))
        calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        # The warm-up's activations must not look like model memory to vLLM's KV-cache
        # sizing.
        torch.cuda.empty_cache()
    logger.debug(
        "EXL3: warmed up k=%d n=%d %s at %d token counts in %.2f s",
        k,
        n,
        key,
        calls,
        time.perf_counter() - start,
    )
    return calls
