# SPDX-License-Identifier: Apache-2.0
"""Recompute the speed-of-light columns (sol_us, pct_sol) of a bench_linear.py result from its
own measured ceilings and a sass_loop.py instruction count, and rewrite its JSON and CSV.

For a run whose decode term was missing: bench_linear.py drops that term when it has no loop
counts (no --sass-json, or sass_loop.py found no k loop, as for every run between the wgmma
engine's template parameter and the sass_loop.py fix of session 7). The counts must come from
the SASS of the kernels that ran (sass_loop.py on the same build, or a build with the same
SASS for the mma.sync kernels, whose k loop the term uses).

    python scripts/bench/resol.py RESULT.json --sass-json SASS.json --note "where the counts come from"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import bench_linear

CB = {name: cb for cb, name in bench_linear.CB_NAMES.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("result", type=Path, help="a bench_linear.py JSON (its CSV is beside it)")
    ap.add_argument("--sass-json", type=Path, required=True)
    ap.add_argument("--note", required=True)
    args = ap.parse_args(argv)
    data = json.loads(args.result.read_text())
    loops = json.loads(args.sass_json.read_text())
    ceil = data["meta"]["ceilings"]
    missing = set()
    for r in data["rows"]:
        key = f"{r['bits']:g}:{CB[r['codebook']]}"
        if key not in loops:
            missing.add(key)
            continue
        sol = bench_linear.sol_us(r["k"], r["n"], r["m"], r["bits"], ceil, loops[key])
        r["sol_us"] = round(sol, 2)
        r["pct_sol"] = round(100 * sol / r["ours_us"], 1)
    if missing:
        raise SystemExit(f"no loop counts for {sorted(missing)} in {args.sass_json}")
    data["meta"]["sol_recomputed"] = args.note
    args.result.write_text(json.dumps(data, indent=1, default=str))
    bench_linear.write_csv(args.result.with_suffix(".csv"), data["rows"])
    print(f"recomputed {len(data['rows'])} rows of {args.result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
