# SPDX-License-Identifier: Apache-2.0
"""Instructions per decoded weight of the trellis GEMM's k loop, from its SASS (cuobjdump).

The k loop of exl3_gemm_kernel<K2, CB, MT, WG> consumes 64-k stages: a block's stage holds
32 trellis tiles (4 k16 rows x 8 tiles) = 8192 weights, 32 per thread of its 256. The loop body
is the first backward branch whose body holds the tensor instructions (HMMA, or HGMMA for the
wgmma engine); its instruction count per stage / 32 is the per-thread issue cost of one weight
of the matrix (decode + the stage's share of loads, ldmatrix, mma and loop overhead; at BM = 128
with a 2 x 4 warp grid each tile is decoded twice, which this per-weight figure includes). A loop
unrolled over several stages is divided by its stage count. Each opcode is also assigned its
Hopper execution pipe (by_pipe).

Two sources of SASS:
    python scripts/bench/sass_loop.py build/exl3/_exl3_C.abi3.so [--json out.json]
    python scripts/bench/sass_loop.py --compile [--arch 90] [--mt 1 8] [--json out.json]
The second needs no GPU and no full build: it compiles one small translation unit with explicit
instantiations of the GEMM kernel (same nvcc flags as the quick build) into a cubin per rate.
cuobjdump comes from PATH, the CUDA toolkit, or the pip package nvidia-cuda-cuobjdump (any
13.x reads sm_90/sm_120 cubins), found through CUOBJDUMP, nvidia/cu13/bin of this Python, or
/usr/local/cuda/bin.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "csrc" / "quantization" / "exl3"
# Weights of the matrix per thread and 64-k stage: 32 tiles of 256 per block / 256 threads.
WEIGHTS_PER_THREAD_PER_STAGE = 32 * 256 // 256
RATES = {2: 1, 3: 1.5, 4: 2, 5: 2.5, 6: 3, 7: 3.5, 8: 4, 10: 5, 12: 6, 14: 7, 16: 8}
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
# The kernel marks its k loop's stage count in a named constant (see exl3_gemm.cuh); without the
# marker (older kernels) the loop body is one stage.
STAGES_MARK = re.compile(r"kLoopStages\s*=\s*(\w+)")


# Execution pipe of each opcode on Hopper (per SM sub-partition: 16 INT32 lanes for the ALU
# pipe, 16 for the FMA-heavy pipe that runs IMAD, 32 FP32 lanes for FFMA/HADD2-class ops, the
# tensor pipe, the load/store unit). A warp instruction on a 16-lane pipe holds it two cycles,
# so a loop whose ALU share exceeds half its instructions is bound by that pipe, not by issue.
# The split is a static count for balancing; ncu's sm__inst_executed_pipe_* is the measurement.
PIPES = {
    "alu": ("LOP3", "SHF", "PRMT", "IADD3", "ISETP", "SEL", "LEA", "FSEL", "PLOP3", "IMNMX",
            "VIMNMX", "SGXT", "BMSK", "FLO", "POPC", "IABS", "LOP", "R2P", "P2R", "VIADD"),
    "fma": ("IMAD", "IDP", "HADD2", "HFMA2", "HMUL2", "FFMA", "FADD", "FMUL", "MOV"),
    "tensor": ("HMMA", "HGMMA"),
    "lsu": ("LDS", "LDSM", "LDGSTS", "STS", "LDG", "STG", "LDGDEPBAR", "DEPBAR", "SHFL"),
}


def pipe_of(opcode: str) -> str:
    base = opcode.split(".")[0]
    if base.startswith("U") and base not in ("UNKNOWN",):
        return "uniform"
    for pipe, ops in PIPES.items():
        if base in ops:
            return pipe
    return "control"


def kernel_name(k2: int, cb: int, mt: int, wg: bool = False, sk: bool = False) -> str:
    """exl3_gemm_kernel<K2, CB, MT, WG, SK>'s symbol (WG: the Hopper wgmma engine; SK: its
    stream-k grid)."""
    return (f"_ZN9vllm_exl316exl3_gemm_kernelILi{k2}ELi{cb}ELi{mt}ELb{int(wg)}ELb{int(sk)}E"
            "EEvNS_10GemmParamsE")


def cuobjdump() -> str:
    """Path of cuobjdump: $CUOBJDUMP, PATH, the pip wheel's nvidia/cu13/bin, the CUDA toolkit."""
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(str(Path(root) / "cu13" / "bin" / "cuobjdump"))
    candidates.append("/usr/local/cuda/bin/cuobjdump")
    for c in candidates:
        if c and Path(c).is_file():
            return c
    raise SystemExit("cuobjdump not found: set CUOBJDUMP, or pip install nvidia-cuda-cuobjdump")


def sass(lib: Path, name: str | None = None) -> str:
    cmd = [cuobjdump(), "-sass", str(lib)]
    if name:
        cmd[2:2] = ["-fun", name]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def loop_stages() -> int:
    """Stages per iteration of the GEMM's k loop (exl3_gemm.cuh's kLoopStages)."""
    text = (SOURCES / "exl3_gemm.cuh").read_text()
    m = STAGES_MARK.search(text)
    if not m:
        return 1
    value = m.group(1)
    if value.isdigit():
        return int(value)
    # A named constant: look its value up in the same header.
    d = re.search(rf"\b{value}\s*=\s*(\d+)", text)
    return int(d.group(1)) if d else 1


def loop_profile(text: str, stages: int = 1) -> dict:
    instrs = []  # (address, opcode, operands)
    for m in LINE.finditer(text):
        instrs.append((int(m.group(1), 16), m.group(3), m.group(4)))
    # The k loop: the first loop holding tensor instructions (the largest one starting there).
    # A kernel whose steady-state loop is followed by a guarded tail loop is counted by the
    # steady one, which runs all but the last iteration.
    best, best_start = None, None
    for addr, op, rest in instrs:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", rest)
            if t and int(t.group(1), 16) < addr:
                start = int(t.group(1), 16)
                body = [o for a, o, _ in instrs if start <= a <= addr]
                if not any(o.startswith(("HMMA", "HGMMA")) for o in body):
                    continue
                if (best is None or start < best_start
                        or (start == best_start and len(body) > len(best))):
                    best, best_start = body, start
    if not best:
        return {"loop_instructions": 0}
    kinds = collections.Counter(o.split(".")[0] for o in best)
    pipes = collections.Counter(pipe_of(o) for o in best)
    per_stage = len(best) / stages
    return {"loop_instructions": len(best), "stages_per_iteration": stages,
            "per_stage": per_stage, "per_weight": per_stage / WEIGHTS_PER_THREAD_PER_STAGE,
            "by_pipe": {k: v / stages for k, v in pipes.most_common()},
            "by_opcode": {k: v / stages for k, v in kinds.most_common()}}


def compile_cubins(k2s: list[int], mts: list[int], arch: str, work: Path,
                   wg: bool = False) -> dict[int, Path]:
    """One cubin per rate holding exl3_gemm_kernel<K2, CB, MT, WG> for every codebook and MT."""
    sys.path.insert(0, str(REPO / "scripts"))
    from vllm_exl3 import kernels_build  # noqa: E402 - the quick build's flags, one source of truth
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    out = {}
    for k2 in k2s:
        lines = ['#include "exl3_gemm.cuh"', "namespace vllm_exl3 {"]
        for cb in ((2,) if k2 % 2 else (0, 1, 2)):
            for mt in mts:
                lines.append(f"template __global__ void exl3_gemm_kernel<{k2}, {cb}, {mt}, "
                             f"{'true' if wg else 'false'}>(const __grid_constant__ GemmParams);")
        lines.append("}")
        src = work / f"gemm_k{k2}.cu"
        src.write_text("\n".join(lines) + "\n")
        cubin = work / f"gemm_k{k2}.cubin"
        cmd = [nvcc, *[f for f in kernels_build.NVCC_FLAGS if f not in ("-Xcompiler", "-fPIC")],
               "-cubin", f"-arch=sm_{arch}", f"-I{SOURCES}", str(src), "-o", str(cubin)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"nvcc failed for K2={k2}:\n{proc.stderr}")
        out[k2] = cubin
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib", type=Path, nargs="?", help="built extension (.so) to read")
    ap.add_argument("--compile", action="store_true", help="compile the kernels here instead")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--mt", type=int, nargs="+", default=[1], help="m-tiles (BM / 16)")
    ap.add_argument("--wgmma", action="store_true",
                    help="the wgmma engine's kernels (sm_90a; --mt 4 8 16) instead of mma.sync's")
    ap.add_argument("--bits", type=float, nargs="+", default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not args.compile and args.lib is None:
        ap.error("give the extension path or --compile")
    k2s = [k2 for k2, b in RATES.items() if args.bits is None or b in args.bits]
    stages = loop_stages()
    out = {}
    with tempfile.TemporaryDirectory(prefix="exl3_sass_") as tmp:
        arch = args.arch + ("a" if args.wgmma and not args.arch.endswith("a") else "")
        libs = (compile_cubins(k2s, args.mt, arch, Path(tmp), args.wgmma) if args.compile
                else {k2: args.lib for k2 in k2s})
        for k2 in k2s:
            bits = RATES[k2]
            for cb in ((2,) if k2 % 2 else (0, 1, 2)):
                for mt in args.mt:
                    name = kernel_name(k2, cb, mt, args.wgmma)
                    prof = loop_profile(sass(libs[k2], name), stages)
                    if not prof.get("per_stage"):
                        # A renamed kernel or a changed loop must not pass as a free decode.
                        raise SystemExit(f"no k loop found in {name}")
                    key = (f"{bits:g}:{cb}" + ("" if mt == 1 else f":mt{mt}")
                           + (":wgmma" if args.wgmma else ""))
                    out[key] = prof
                    top = ", ".join(f"{k} {v:g}" for k, v in prof.get("by_pipe", {}).items())
                    print(f"bits {bits:>3} cb {cb} mt {mt}: {prof.get('per_stage', 0):6.1f} "
                          f"instr/stage-thread, {prof.get('per_weight', 0):.2f} per weight  "
                          f"[{top}]", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
