# SPDX-License-Identifier: Apache-2.0
"""Instructions per decoded weight of the trellis GEMM's k loop, from its SASS (cuobjdump).

The k loop of exl3_gemm_kernel<K2, CB, MT> consumes one 64-k stage per iteration: each warp
decodes 4 trellis tiles = 1024 weights, i.e. 32 weights per thread. The loop body is the
largest backward branch whose body holds the HMMA instructions; its instruction count / 32 is
the per-thread issue cost of one weight (decode + the stage's share of loads, ldmatrix, mma and
loop overhead) at BM = 16.

    python scripts/bench/sass_loop.py build/exl3/_exl3_C.abi3.so [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

WEIGHTS_PER_THREAD_PER_STAGE = 4 * 256 // 32
RATES = {2: 1, 3: 1.5, 4: 2, 5: 2.5, 6: 3, 7: 3.5, 8: 4, 10: 5, 12: 6, 14: 7, 16: 8}
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def kernel_name(k2: int, cb: int, mt: int) -> str:
    return f"_ZN9vllm_exl316exl3_gemm_kernelILi{k2}ELi{cb}ELi{mt}EEEvNS_10GemmParamsE"


def sass(lib: Path, name: str) -> str:
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    return subprocess.run([tool, "-sass", "-fun", name, str(lib)], capture_output=True,
                          text=True, check=True).stdout


def loop_profile(text: str) -> dict:
    instrs = []  # (address, opcode, operands)
    for m in LINE.finditer(text):
        instrs.append((int(m.group(1), 16), m.group(3), m.group(4)))
    best = None
    for i, (addr, op, rest) in enumerate(instrs):
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", rest)
            if t and int(t.group(1), 16) < addr:
                body = [o for a, o, _ in instrs if int(t.group(1), 16) <= a <= addr]
                if not any(o.startswith("HMMA") for o in body):
                    continue
                if best is None or len(body) > len(best):
                    best = body
    if not best:
        return {"loop_instructions": 0}
    kinds = collections.Counter(o.split(".")[0] for o in best)
    return {"loop_instructions": len(best),
            "per_weight": len(best) / WEIGHTS_PER_THREAD_PER_STAGE,
            "by_opcode": dict(kinds.most_common())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    out = {}
    for k2, bits in RATES.items():
        for cb in ((2,) if k2 % 2 else (0, 1, 2)):
            prof = loop_profile(sass(args.lib, kernel_name(k2, cb, 1)))
            out[f"{bits}:{cb}"] = prof
            top = ", ".join(f"{k} {v}" for k, v in list(prof.get("by_opcode", {}).items())[:8])
            print(f"bits {bits:>3} cb {cb}: {prof['loop_instructions']:4d} instr/stage-thread, "
                  f"{prof.get('per_weight', 0):.2f} per weight  [{top}]")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
