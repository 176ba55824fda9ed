# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm-exl3 inspect <checkpoint>`: what an EXL3 checkpoint holds, from headers only.

Reads the safetensors headers, config.json and quantization_config.json; the only tensor
data read are the 4-byte codebook marker scalars (their values are checked), and with
--values every suh/svh vector. Per module: bitrate and codebook (from the module's own
trellis width and marker, docs/design/exl3_format.md §1.5), shapes, the vLLM module it
loads into, EXL3 or unquantized; totals; the tensor-parallel degrees the 128-wide
Hadamard blocks allow (the loader's own rules, tp_rules.py), which modules then run with
partial-block ownership and the redundant work that costs; every place where the JSON
files disagree with the tensors; and the verdict vLLM's loader and `dequantize` give
(checkpoint.py), saying what it did not read.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from pathlib import Path

from . import ToolError
from .architecture import (
    COLUMN,
    MTP_PREFIX,
    PAD,
    ROW,
    VOCAB,
    LinearSlot,
    PlanError,
    linear_role,
    plan_model,
)
from .codec import checkpoint, tp_rules
from .codec import exl3_format as fmt

TP_DEGREES = (1, 2, 4, 8)
# vLLM pads the vocab to a multiple of this before splitting it
# (DEFAULT_VOCAB_PADDING_SIZE).
VOCAB_PADDING = 64
# config.json's `bits` is written with 2 decimals; a larger gap than the rounding is a
# mismatch.
BITS_TOLERANCE = 0.0051
# Text mode names at most this many modules per disagreement/blocker before summarising.
MAX_NAMED = 3
CODEBOOK_NAMES = {
    fmt.Codebook.THREE_INST: "3inst",
    fmt.Codebook.MCG: "mcg",
    fmt.Codebook.MUL1: "mul1",
}
MULTIPLIER_KEYS = {
    "mcg_multiplier": fmt.Codebook.MCG,
    "mul1_multiplier": fmt.Codebook.MUL1,
}
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_TORCH_DTYPES = {
    "I16": "torch.int16",
    "I32": "torch.int32",
    "F16": "torch.float16",
    "BF16": "torch.bfloat16",
    "F32": "torch.float32",
    "I64": "torch.int64",
    "F64": "torch.float64",
    "I8": "torch.int8",
    "U8": "torch.uint8",
    "BOOL": "torch.bool",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="describe an EXL3 checkpoint (headers only)",
        description=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("checkpoint", help="directory with config.json and *.safetensors")
    p.add_argument(
        "--json", action="store_true", help="print one JSON object instead of text"
    )
    p.add_argument(
        "--values",
        action="store_true",
        help="also read every suh/svh vector and check its values (finite; zeros "
        "only on padding)",
    )
    p.set_defaults(func=run)


def _nbytes(entry: fmt.TensorEntry) -> int:
    n = _DTYPE_BYTES.get(entry.dtype, 0)
    for d in entry.shape:
        n *= d
    return n


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMED])
    return shown + (
        f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    )


# One rank's share of a linear: (input features, columns it returns, columns it
# computes).
RankShare = tuple[int, int, int]


def _tp_split(
    role: str, fused: str, k: int, n: int, tp: int, slot: LinearSlot | None
) -> tuple[str | None, list[RankShare]]:
    """(why `tp` cannot split this linear or None, each rank's share) as vLLM and the
    EXL3 loader divide it (tp_rules.py): column-parallel ranks compute the 128-aligned
    window covering their columns, row-parallel ranks need whole 128-blocks of k."""
    if role == ROW:
        if k % tp:
            return f"row-parallel k = {k} not divisible by tp={tp}", []
        return tp_rules.row_split_error(k // tp, tp), [(k // tp, n, n)] * tp
    if role == VOCAB:
        padded = tp_rules.round_up(n, VOCAB_PADDING)
        if padded % tp:
            return f"vocab {n} padded to {padded} not divisible by tp={tp}", []
        per = padded // tp
        windows = [tp_rules.column_window(r * per, per) for r in range(tp)]
        return None, [(k, w.width, w.alloc) for w in windows]
    if role != COLUMN:
        return None, [(k, n, n)] * tp
    heads = slot.heads if slot is not None else None
    kv = slot.kv_heads if slot is not None else None
    replicas = 1
    if kv is not None and tp > kv:
        if tp % kv:
            return f"{kv} kv heads cannot be replicated evenly over tp={tp}", []
        replicas = tp // kv
    elif heads is not None and heads % tp:
        return f"{heads} heads not divisible by tp={tp}", []
    if n % (tp // replicas):
        return f"column-parallel n = {n} not divisible by tp={tp}", []
    width = n // (tp // replicas)
    if fused.endswith(".experts") and width % PAD:
        # Routed experts go through vLLM's fused MoE, which has no EXL3 method with
        # windows.
        return (
            f"column-parallel n/tp = {n}/{tp} = {width} is not a multiple of {PAD} "
            "(Hadamard block); partial-block ownership is implemented for dense "
            "linears, "
            f"not fused-MoE experts"
        ), []
    windows = [tp_rules.rank_column_window(width, r, replicas) for r in range(tp)]
    return None, [(k, w.width, w.alloc) for w in windows]


def _tensor_parallel(
    tp: int, modules: list[dict], plan_slots: dict[str, LinearSlot], cfg: dict
) -> dict:
    """Blockers of one TP degree, the modules with partial-block ownership, and the
    extra weights the busiest rank decodes for columns it drops (relative to the columns
    it returns)."""
    blockers: list[dict] = []
    partial: list[dict] = []
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    if tp > 1 and heads and heads % tp:
        blockers.append(
            {
                "module": "config.json",
                "rule": f"num_attention_heads = {heads} not divisible by tp={tp}",
            }
        )
    if (
        tp > 1
        and kv_heads
        and not cfg.get("kv_lora_rank")
        and kv_heads % tp
        and tp % kv_heads
    ):
        blockers.append(
            {
                "module": "config.json",
                "rule": f"num_key_value_heads = {kv_heads} and tp={tp}: neither "
                f"divides the other",
            }
        )
    computed, returned = [0] * tp, [0] * tp
    for m in modules:
        slot = plan_slots.get(m["name"])
        k = slot.in_features if slot else m["in_features"]
        n = slot.out_features if slot else m["out_features"]
        rule, shares = _tp_split(m["tp_role"], m["fused_group"], k, n, tp, slot)
        if rule:
            blockers.append({"module": m["name"], "rule": rule})
            continue
        for r, (k_r, kept, cols) in enumerate(shares):
            computed[r] += k_r * cols
            returned[r] += k_r * kept
        if any(kept != cols for _, kept, cols in shares):
            partial.append(
                {
                    "module": m["name"],
                    "returned_columns": max(kept for _, kept, _ in shares),
                    "computed_columns": max(cols for _, _, cols in shares),
                }
            )
    overhead = max((c / r - 1 for c, r in zip(computed, returned) if r), default=0.0)
    return {
        "ok": not blockers,
        "blockers": blockers,
        "partial_blocks": partial,
        "redundant_compute": overhead,
    }


def inspect_checkpoint(ckpt_dir: str | os.PathLike, values: bool = False) -> dict:
    """The whole report as a JSON-able dict (what --json prints). Files that cannot be
    read as what they claim to be (checkpoint_files.py) raise; every problem of the
    verdict vLLM's loader and `dequantize` give (checkpoint.assess_checkpoint, then the
    codebook markers and, with `values`, every suh/svh) is listed under errors, the
    first of them the one vLLM's loader would name."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise ToolError(f"{root}: not a directory")
    try:
        description = checkpoint.assess_checkpoint(root)
    except fmt.Exl3FormatError as e:
        raise ToolError(str(e)) from e
    index, config = description.tensors, description.config
    qjson, specs = description.quant_document, description.modules
    errors = list(description.problems)
    # What config.json declares about the method, as the verdict words it (its
    # problems are among the errors already).
    disagreements = checkpoint.method_declaration(config, qjson, specs)[1]
    notes: list[str] = []

    plan_slots: dict[str, LinearSlot] = {}
    plan = None
    if config is None:
        disagreements.append(
            "config.json: missing (no architecture, no real dims, no head counts)"
        )
    else:
        try:
            plan = plan_model(config)
            plan_slots = {s.name: s for s in plan.linears}
        except PlanError as e:
            notes.append(f"{e}; module roles come from names only")
    cfg = config or {}

    modules: list[dict] = []
    unquantized: list[dict] = []
    for prefix, members in fmt.group_tensors(index).items():
        names = [f"{prefix}.{s}" for s in members]
        nbytes = sum(_nbytes(index[n]) for n in names)
        tensors = {
            s: {"shape": list(sh), "dtype": dt} for s, (sh, dt) in members.items()
        }
        slot = plan_slots.get(prefix)
        spec = specs.get(prefix)
        if spec is None:
            embedding = description.embeddings.get(prefix)
            if embedding is not None:
                notes.append(
                    f"{prefix}: quantized token embedding (--embed_bits "
                    f"{embedding.bits}): {embedding.rows} rows of {embedding.groups} "
                    f"groups of {fmt.EMBED_GROUP}, {nbytes} bytes; vLLM decodes "
                    "the looked-up rows, `dequantize` does not decode it yet"
                )
                continue
            if any(s in fmt.EXL3_ONLY_SUFFIXES for s in members):
                continue  # an EXL3 module that breaks a rule: under errors
            unquantized.append(
                {
                    "name": prefix,
                    "format": "unquantized",
                    "bytes": nbytes,
                    "tensors": tensors,
                    "fused_group": slot.fused if slot else prefix,
                }
            )
            continue
        role, fused = (slot.tp, slot.fused) if slot else linear_role(prefix, cfg)
        if prefix == "lm_head" or (slot and slot.bits_key == "head_bits"):
            group = "head"
        else:
            group = "mtp" if slot and slot.bits_key == "mtp_bits" else "decoder"
        entry = {
            "name": prefix,
            "format": "exl3",
            "bits": spec.bits,
            "codebook": CODEBOOK_NAMES[spec.codebook],
            "in_features": spec.in_features,
            "out_features": spec.out_features,
            "trellis_shape": list(members["trellis"][0]),
            "bytes": nbytes,
            "fused_group": fused,
            "tp_role": role,
            "has_bias": spec.has_bias,
            "legacy_signs": spec.legacy_signs,
            "group": group,
            "tensors": tensors,
        }
        if slot is not None:
            entry["real_in_features"], entry["real_out_features"] = (
                slot.in_features,
                slot.out_features,
            )
            k_pad, n_pad = slot.padded
            if (spec.in_features, spec.out_features) != (k_pad, n_pad):
                disagreements.append(
                    f"{prefix}: stored k x n = {spec.in_features} x "
                    f"{spec.out_features}, "
                    f"config.json implies {slot.in_features} x {slot.out_features} "
                    f"(padded {k_pad} x {n_pad})"
                )
        if "scale" in members:
            notes.append(
                f"{prefix}.scale: present, not applied (ExLlamaV3 1.6.5 ignores it)"
            )
        modules.append(entry)

    # The data vLLM's loader and `dequantize` check: every codebook marker (4 bytes
    # each), and with --values every suh/svh.
    real = {
        prefix: (slot.in_features, slot.out_features)
        for prefix in specs
        if (slot := plan_slots.get(prefix)) is not None
    }
    found, value_notes = checkpoint.value_problems(description, real, scales=values)
    errors += found
    notes += value_notes

    # Totals.
    def bpw(mods: list[dict]) -> tuple[float | None, float | None]:
        weights = sum(m["in_features"] * m["out_features"] for m in mods)
        if not weights:
            return None, None
        trellis = (
            sum(m["bits"] * m["in_features"] * m["out_features"] for m in mods)
            / weights
        )
        return trellis, sum(m["bytes"] for m in mods) * 8 / weights

    by_group = {}
    for g in ("decoder", "head", "mtp"):
        mods = [m for m in modules if m["group"] == g]
        if mods:
            t, s = bpw(mods)
            by_group[g] = {
                "modules": len(mods),
                "bits_per_weight": t,
                "storage_bits_per_weight": s,
                "bits": dict(Counter(str(m["bits"]) for m in mods)),
                "codebooks": dict(Counter(m["codebook"] for m in mods)),
            }
    exl3_bytes = sum(m["bytes"] for m in modules)
    plain_bytes = sum(u["bytes"] for u in unquantized)
    t_all, s_all = bpw(modules)
    totals = {
        "exl3_modules": len(modules),
        "unquantized_modules": len(unquantized),
        "exl3_bytes": exl3_bytes,
        "unquantized_bytes": plain_bytes,
        "total_bytes": exl3_bytes + plain_bytes,
        "exl3_weights": sum(m["in_features"] * m["out_features"] for m in modules),
        "bits_per_weight": t_all,
        "storage_bits_per_weight": s_all,
        "by_group": by_group,
    }

    # Tensor parallelism under the 128-column Hadamard rules.
    tensor_parallel = {
        str(tp): _tensor_parallel(tp, modules, plan_slots, cfg) for tp in TP_DEGREES
    }

    _compare_config(cfg, config is not None, modules, by_group, index, disagreements)
    _compare_storage(qjson, cfg, modules, unquantized, index, disagreements)
    if plan is not None:
        present = {m["name"] for m in modules} | {u["name"] for u in unquantized}
        missing = [s.name for s in plan.linears if s.name not in present]
        missing += [p.name for p in plan.plain if p.name not in index]
        if not any(name.startswith(MTP_PREFIX) for name in index):
            # A conversion keeps `mtp.` layers only where the converter has an MTP
            # model for the architecture; config.json still declares them.
            missing = [name for name in missing if not name.startswith(MTP_PREFIX)]
        if missing:
            disagreements.append(
                f"config.json implies modules missing from the checkpoint: "
                f"{_named(missing)}"
            )
        unplanned = [m["name"] for m in modules if m["name"] not in plan_slots]
        if unplanned:
            disagreements.append(
                f"EXL3 modules the config does not imply: {_named(unplanned)}"
            )

    return {
        "checkpoint": str(root),
        "architecture": (cfg.get("architectures") or [None])[0],
        "model_type": cfg.get("model_type"),
        "modules": modules,
        "unquantized": unquantized,
        "totals": totals,
        "tensor_parallel": tensor_parallel,
        "disagreements": disagreements,
        "notes": notes,
        "errors": errors,
        # Whether every suh/svh was read; without --values they were not, and the
        # verdict says so.
        "values_checked": values,
    }


def _compare_config(
    cfg: dict,
    have_config: bool,
    modules: list[dict],
    by_group: dict,
    index: dict,
    out: list[str],
) -> None:
    if not have_config:
        return
    # A missing block or another quant_method is the verdict's
    # (checkpoint.method_declaration).
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return
    codebook = q.get("codebook")
    if codebook is not None:
        other = [m["name"] for m in modules if m["codebook"] != codebook]
        if other:
            out.append(
                f"config.json: codebook = {codebook!r} but {len(other)} modules use "
                f"another codebook: {_named(other)}"
            )
    decoder = by_group.get("decoder")
    if (
        decoder
        and "bits" in q
        and abs(float(q["bits"]) - decoder["bits_per_weight"]) > BITS_TOLERANCE
    ):
        out.append(
            f"config.json: bits = {q['bits']} but the decoder linears average "
            f"{decoder['bits_per_weight']:.4f} bits per weight"
        )
    head = next((m for m in modules if m["name"] == "lm_head"), None)
    if "head_bits" in q:
        hb = float(q["head_bits"])
        if head is not None and float(head["bits"]) != hb:
            out.append(
                f"config.json: head_bits = {q['head_bits']} but lm_head.trellis holds "
                f"{head['bits']} bits"
            )
        if head is None and hb != 16 and "lm_head.weight" in index:
            out.append(
                f"config.json: head_bits = {q['head_bits']} but lm_head is unquantized"
            )
    mtp_rates = sorted({float(m["bits"]) for m in modules if m["group"] == "mtp"})
    if "mtp_bits" in q and mtp_rates:
        if mtp_rates != [float(q["mtp_bits"])]:
            out.append(
                f"config.json: mtp_bits = {q['mtp_bits']} but the MTP linears hold "
                f"{mtp_rates} bits"
            )
    elif "mtp_bits" in q and "mtp" not in by_group:
        out.append(
            f"config.json: mtp_bits = {q['mtp_bits']} but no quantized MTP linears "
            "found"
        )


def _compare_storage(
    qjson: dict | None,
    cfg: dict,
    modules: list[dict],
    unquantized: list[dict],
    index: dict,
    out: list[str],
) -> None:
    if qjson is None:
        out.append(
            "quantization_config.json: missing (informational file; tensors decide)"
        )
        return
    storage = qjson.get("tensor_storage")
    if not isinstance(storage, dict):
        out.append("quantization_config.json: no tensor_storage map")
        return
    q = cfg.get("quantization_config")
    if isinstance(q, dict):
        differing = sorted(k for k in q if k in qjson and qjson[k] != q[k])
        if differing:
            out.append(
                f"quantization_config.json and config.json disagree on {differing}"
            )
    by_name = {m["name"]: m for m in modules}
    not_on_disk, wrong_bits, wrong_cb, wrong_tensors = [], [], [], []
    for key, entry in storage.items():
        if not isinstance(entry, dict):
            continue
        for tname, meta in (entry.get("stored_tensors") or {}).items():
            disk = index.get(tname)
            if disk is None:
                wrong_tensors.append(f"{tname} (listed, not stored)")
            elif list(disk.shape) != list(meta.get("shape", [])) or _TORCH_DTYPES.get(
                disk.dtype
            ) != meta.get("dtype"):
                wrong_tensors.append(
                    f"{tname} (listed {meta.get('dtype')} {meta.get('shape')}, stored "
                    f"{disk.dtype} {list(disk.shape)})"
                )
        if entry.get("quant_format") != "exl3":
            if key in by_name:
                wrong_cb.append(f"{key} (EXL3 on disk, not listed as exl3)")
            continue
        m = by_name.get(key)
        if m is None:
            not_on_disk.append(key)
            continue
        if float(entry.get("bits_per_weight", -1)) != float(m["bits"]):
            wrong_bits.append(
                f"{key} ({entry.get('bits_per_weight')} listed, {m['bits']} stored)"
            )
        listed = [MULTIPLIER_KEYS[k] for k in MULTIPLIER_KEYS if k in entry]
        listed_cb = (
            CODEBOOK_NAMES[listed[0]]
            if len(listed) == 1
            else ("3inst" if not listed else "both")
        )
        if listed_cb != m["codebook"]:
            wrong_cb.append(f"{key} ({listed_cb} listed, {m['codebook']} stored)")
    unlisted = [m["name"] for m in modules if m["name"] not in storage]
    for label, items in (
        ("EXL3 modules listed but not stored", not_on_disk),
        ("bits_per_weight differs from the trellis", wrong_bits),
        ("codebook differs from the marker tensors", wrong_cb),
        ("stored_tensors differ from the safetensors headers", wrong_tensors),
        ("EXL3 modules missing from tensor_storage", unlisted),
    ):
        if items:
            out.append(f"quantization_config.json: {label}: {_named(items)}")


def _fmt_bits(b: float | None) -> str:
    return "-" if b is None else f"{b:.4f}"


def _aggregate(modules: list[dict]) -> list[tuple[str, list[dict]]]:
    """Experts of one MoE layer and projection collapse into one row in text mode."""
    rows: dict[str, list[dict]] = {}
    for m in modules:
        parts = m["name"].split(".")
        if "experts" in parts:
            i = parts.index("experts")
            if i + 1 < len(parts) and parts[i + 1].isdigit():
                parts[i + 1] = "*"
        rows.setdefault(".".join(parts), []).append(m)
    return list(rows.items())


def format_text(report: dict) -> str:
    lines = [
        f"checkpoint: {report['checkpoint']}",
        f"architecture: {report['architecture']} ({report['model_type']})",
        "",
    ]
    header = (
        f"{'module':<58} {'bits':>4} {'codebook':<8} {'k x n':>13}  "
        f"{'vLLM module':<40} format"
    )
    lines.append(header)
    for name, group in _aggregate(report["modules"]):
        m = group[0]
        bits = sorted({str(g["bits"]) for g in group})
        cbs = sorted({g["codebook"] for g in group})
        count = f" ({len(group)}x)" if len(group) > 1 else ""
        lines.append(
            f"{name + count:<58} {'/'.join(bits):>4} {'/'.join(cbs):<8} "
            f"{str(m['in_features']) + 'x' + str(m['out_features']):>13}  "
            f"{m['fused_group']:<40} EXL3"
        )
    for u in report["unquantized"]:
        shapes = ", ".join(
            f"{s} {t['dtype']} {t['shape']}" for s, t in u["tensors"].items()
        )
        lines.append(
            f"{u['name']:<58} {'':>4} {'':<8} {'':>13}  {u['fused_group']:<40} "
            f"unquantized (falls through): {shapes}"
        )
    t = report["totals"]
    lines += [
        "",
        f"totals: {t['exl3_modules']} EXL3 modules, {t['unquantized_modules']} "
        f"unquantized; {t['total_bytes']:,} bytes ({t['exl3_bytes']:,} EXL3, "
        f"{t['unquantized_bytes']:,} unquantized)",
        f"  EXL3 bits per weight: {_fmt_bits(t['bits_per_weight'])} trellis, "
        f"{_fmt_bits(t['storage_bits_per_weight'])} with suh/svh",
    ]
    for g, v in t["by_group"].items():
        lines.append(
            f"  {g}: {v['modules']} modules, {_fmt_bits(v['bits_per_weight'])} bpw "
            f"({_fmt_bits(v['storage_bits_per_weight'])} with scales), bits "
            f"{v['bits']}, codebooks {v['codebooks']}"
        )
    lines += ["", "tensor parallel (128-column Hadamard rules):"]
    for tp, v in report["tensor_parallel"].items():
        if v["ok"]:
            line = f"  tp={tp}: ok"
            partial = [p["module"] for p in v["partial_blocks"]]
            if partial:
                line += (
                    f"; partial 128-blocks in {len(partial)} modules "
                    f"({_named(partial)}): "
                    f"+{100 * v['redundant_compute']:.1f}% weights decoded on the "
                    "busiest "
                    f"rank"
                )
            lines.append(line)
        else:
            b = v["blockers"]
            more = f" (and {len(b) - 1} more)" if len(b) > 1 else ""
            lines.append(
                f"  tp={tp}: blocked by {b[0]['module']}: {b[0]['rule']}{more}"
            )
    for title, key in (
        ("disagreements", "disagreements"),
        ("notes", "notes"),
        ("errors (format rules broken)", "errors"),
    ):
        if report[key]:
            lines += ["", f"{title}:"] + [f"  - {x}" for x in report[key]]
    if not report["disagreements"]:
        lines += [
            "",
            "config.json and quantization_config.json agree with the tensors.",
        ]
    read = "headers, JSON files and codebook markers" + (
        " and every suh/svh value" if report["values_checked"] else ""
    )
    if report["errors"]:
        n = len(report["errors"])
        verdict = f"{n} format rule{'s' if n > 1 else ''} broken (checked: {read})"
    else:
        verdict = f"no problems found in the {read}"
    if not report["values_checked"]:
        verdict += (
            "; suh/svh values NOT read (--values reads and checks them, as vLLM's "
            "loader and dequantize do)"
        )
    lines += ["", f"verdict: {verdict}."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(args.checkpoint, values=args.values)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_text(report))
    errors = report["errors"]
    if errors:
        more = (
            f" (and {checkpoint.more_problems(len(errors) - 1)}; see the report)"
            if len(errors) > 1
            else ""
        )
        raise ToolError(errors[0] + more)
    return 0
