#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Instructions per decoded weight in the k loop of the trellis GEMMs, from their SASS.

Both GEMMs (the dense `exl3_gemm_kernel<K2, CB, MT, WG, SK>` and the grouped MoE
`exl3_moe_gemm_kernel` / `exl3_moe_wgmma_kernel<K2, CB, MT, STAGE>`) run one k loop of
64-deep stages in which a block of kGemmThreads threads decodes 32 trellis tiles (4 k16
rows x 8 column tiles) = 8192 weights: 32 weights per thread and stage. The k loop is
the first backward branch whose body holds the tensor instructions (HMMA, or HGMMA for
the wgmma engine), the largest one starting there (a steady-state loop before a guarded
tail counts, not the tail); its instruction count per stage (kLoopStages stages an
iteration, read from exl3_gemm.cuh) over 32 is the per-thread issue cost of one weight
of the matrix: the decode plus the stage's share of loads, MMAs and loop overhead. Each
opcode is also put on its Hopper pipe (`by_pipe`), since a loop whose integer-ALU share
passes half its instructions is bound by that pipe rather than by issue.

This is a static count, no timing: what the bench README's issue floors use, and a
measure of a decode change that needs no GPU. Two sources:

    python -m vllm_exl3.bench.sass_loop FILE... [--json out.json]
    python -m vllm_exl3.bench.sass_loop --compile [--arch 9.0] [--bits 4] [--json F]

FILE: anything cuobjdump reads (the quick build's `_exl3_C.abi3.so` or its objects,
the objects `build --from-source --only objects` leaves under build/vllm-cmake). With
--compile the per-rate units are generated and compiled here with the quick build's
own flags for one architecture (about 20 s of nvcc per rate). --kernels,
--bits, --codebooks, --mt pick the rows. JSON keys: `bits:codebook` for the dense
mma.sync kernel at BM = 16 (what `bench_linear.py --sass-json` reads), then
`:mt<MT>`, `:wgmma`, `:sk` where they differ; MoE rows start with `moe:` and end with
`:gate_up` or `:down`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_exl3 import kernels_build

GEMM_HEADER = kernels_build.SOURCES / "exl3_gemm.cuh"
# 2 * bits of the rates the kernels are built for -> bits.
RATES = {2: 1, 3: 1.5, 4: 2, 5: 2.5, 6: 3, 7: 3.5, 8: 4, 10: 5, 12: 6, 14: 7, 16: 8}
CODEBOOKS = {0: "3inst", 1: "mcg", 2: "mul1"}
MOE_STAGES = {0: "gate_up", 1: "down"}

# cuobjdump -sass: a function's header, then one instruction a line,
# `/*0a30*/  @!P0 LOP3.LUT R4, R5, 0xff, RZ, 0xc0, !PT ;`.
FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$", re.M)
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
# The kernels' mangled names (namespace vllm_exl3).
DENSE = re.compile(
    r"_ZN9vllm_exl316exl3_gemm_kernelILi(\d+)ELi(\d+)ELi(\d+)ELb([01])ELb([01])E"
)
MOE = re.compile(
    r"_ZN9vllm_exl3\d+exl3_moe_(gemm|wgmma)_kernelILi(\d+)ELi(\d+)ELi(\d+)"
    r"ELNS_8MoeStageE(\d)E"
)

# Execution pipe of each opcode on Hopper, per SM sub-partition: 16 INT32 lanes for the
# ALU pipe, 16 for the FMA-heavy pipe that also runs IMAD, the tensor pipe, the
# load/store unit. A warp instruction on a 16-lane pipe holds it two cycles. A static
# split for balancing the decode; ncu's sm__inst_executed_pipe_* is the measurement.
PIPES = {
    "alu": (
        "LOP3", "SHF", "PRMT", "IADD3", "ISETP", "SEL", "LEA", "FSEL", "PLOP3", "IMNMX",
        "VIMNMX", "SGXT", "BMSK", "FLO", "POPC", "IABS", "LOP", "R2P", "P2R", "VIADD",
    ),
    "fma": ("IMAD", "IDP", "HADD2", "HFMA2", "HMUL2", "FFMA", "FADD", "FMUL", "MOV"),
    "tensor": ("HMMA", "HGMMA"),
    "lsu": (
        "LDS", "LDSM", "LDGSTS", "STS", "LDG", "STG", "LDGDEPBAR", "DEPBAR", "SHFL",
        "UTMALDG", "SYNCS",
    ),
}  # fmt: skip


def header_constant(name: str, text: str) -> int:
    """An integer constexpr of exl3_gemm.cuh, following one level of naming."""
    m = re.search(rf"constexpr int {name}\s*=\s*(\w+)\s*;", text)
    if not m:
        raise SystemExit(f"{GEMM_HEADER.name} defines no constexpr int {name}")
    value = m.group(1)
    return int(value) if value.isdigit() else header_constant(value, text)


def weights_per_thread_per_stage(text: str) -> int:
    """Weights of the matrix one thread decodes per 64-deep stage: a stage's k times
    the block's columns (one Hadamard block, 128) over the block's threads."""
    stage_k = header_constant("kStageK", text)
    threads = header_constant("kGemmThreads", text)
    columns = 128  # kBlockN = kHadamard, exl3_hadamard.cuh
    return stage_k * columns // threads


def pipe_of(opcode: str) -> str:
    base = opcode.split(".")[0]
    if base.startswith("U"):
        return "uniform"
    return next((p for p, ops in PIPES.items() if base in ops), "control")


@dataclass(frozen=True)
class Kernel:
    """One instantiation of a trellis GEMM, from its mangled name."""

    moe: bool
    k2: int
    cb: int
    mt: int
    wgmma: bool
    stream_k: bool = False
    stage: int = 0

    @classmethod
    def parse(cls, symbol: str) -> Kernel | None:
        if m := DENSE.match(symbol):
            k2, cb, mt, wg, sk = map(int, m.groups())
            return cls(False, k2, cb, mt, bool(wg), bool(sk))
        if m := MOE.match(symbol):
            engine, k2, cb, mt, stage = m.groups()
            return cls(
                True, int(k2), int(cb), int(mt), engine == "wgmma", False, int(stage)
            )
        return None

    @property
    def key(self) -> str:
        key = f"{RATES[self.k2]:g}:{self.cb}"
        key += "" if self.mt == 1 else f":mt{self.mt}"
        key += ":wgmma" if self.wgmma else ""
        key += ":sk" if self.stream_k else ""
        return f"moe:{key}:{MOE_STAGES[self.stage]}" if self.moe else key


def functions(sass: str) -> dict[str, str]:
    """mangled name -> that function's SASS, from one cuobjdump listing."""
    heads = list(FUNCTION.finditer(sass))
    return {
        h.group(1): sass[h.end() : heads[i + 1].start() if i + 1 < len(heads) else None]
        for i, h in enumerate(heads)
    }


def loop_profile(text: str, stages: int, weights_per_stage: int) -> dict:
    """The k loop's counts (module docstring); an empty dict where none is found."""
    instrs = [
        (int(m.group(1), 16), m.group(3), m.group(4)) for m in LINE.finditer(text)
    ]
    best: list[str] | None = None
    best_start = -1
    for addr, op, rest in instrs:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if not target or int(target.group(1), 16) >= addr:
            continue
        start = int(target.group(1), 16)
        body = [o for a, o, _ in instrs if start <= a <= addr]
        if not any(o.startswith(("HMMA", "HGMMA")) for o in body):
            continue
        if (
            best is None
            or start < best_start
            or (start == best_start and len(body) > len(best))
        ):
            best, best_start = body, start
    if not best:
        return {}
    per_stage = len(best) / stages
    kinds = collections.Counter(o.split(".")[0] for o in best)
    pipes = collections.Counter(pipe_of(o) for o in best)
    return {
        "loop_instructions": len(best),
        "stages_per_iteration": stages,
        "per_stage": per_stage,
        "per_weight": per_stage / weights_per_stage,
        "by_pipe": {k: v / stages for k, v in pipes.most_common()},
        "by_opcode": {k: v / stages for k, v in kinds.most_common()},
    }


def cuobjdump_sass(path: Path) -> str:
    tool = kernels_build.find_cuobjdump()
    proc = subprocess.run(
        [str(tool), "-sass", str(path)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"cuobjdump -sass {path} failed: {proc.stderr.strip()}")
    return proc.stdout


def compile_rates(k2s: list[int], arch: str, work: Path) -> list[Path]:
    """The per-rate units of `k2s`, generated and compiled for `arch` with the quick
    build's flags; their objects."""
    return kernels_build.compile_units(
        work, [arch], [f"exl3_rate_k{k2}.cu" for k2 in k2s], jobs=os.cpu_count() or 1
    )


def profile(files: list[Path], wanted) -> dict[str, dict]:
    text = GEMM_HEADER.read_text()
    stages = header_constant("kLoopStages", text)
    per_stage = weights_per_thread_per_stage(text)
    out: dict[str, dict] = {}
    for path in files:
        for symbol, body in functions(cuobjdump_sass(path)).items():
            kernel = Kernel.parse(symbol)
            if kernel is None or not wanted(kernel) or kernel.key in out:
                continue
            prof = loop_profile(body, stages, per_stage)
            if not prof:
                # A changed loop must not pass as a free decode.
                raise SystemExit(f"no k loop found in {symbol} ({path})")
            out[kernel.key] = prof
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="*", help="built code to read")
    ap.add_argument("--compile", action="store_true", help="compile the rates here")
    ap.add_argument(
        "--arch", default="9.0", help="with --compile: 9.0 (as sm_90a), 12.0, 12.1"
    )
    ap.add_argument("--kernels", nargs="+", choices=("dense", "moe"),
                    default=["dense", "moe"])  # fmt: skip
    ap.add_argument("--bits", type=float, nargs="+", default=[4.0])
    ap.add_argument("--codebooks", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--mt", type=int, nargs="+", default=None, help="BM / 16")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if bool(args.files) == args.compile:
        ap.error("give the files to read, or --compile")
    k2s = [k2 for k2, b in RATES.items() if b in args.bits]
    if not k2s:
        ap.error(f"--bits: none of the built rates {sorted(set(RATES.values()))}")

    def wanted(k: Kernel) -> bool:
        return (
            k.k2 in k2s
            and k.cb in args.codebooks
            and (args.mt is None or k.mt in args.mt)
            and ("moe" if k.moe else "dense") in args.kernels
        )

    with tempfile.TemporaryDirectory(prefix="exl3_sass_") as tmp:
        files = compile_rates(k2s, args.arch, Path(tmp)) if args.compile else args.files
        out = profile(files, wanted)
    if not out:
        raise SystemExit("no trellis GEMM kernel of the asked rates in those files")
    print("| kernel | instr / weight | per stage | alu | fma | tensor | lsu |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key in sorted(out):
        p = out[key]
        pipes = p["by_pipe"]
        print(
            f"| {key} | {p['per_weight']:.2f} | {p['per_stage']:.1f} | "
            + " | ".join(
                f"{pipes.get(k, 0):g}" for k in ("alu", "fma", "tensor", "lsu")
            )
            + " |"
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
