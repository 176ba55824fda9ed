# Session 8, call 8 (main 4f788b0, .s8/final.so): each kernel's time inside the benchmark's own
# graphs at small m, tuned and with pinned BM 16 / 32 x splits 4, 8, 16, 32 (graph_kernels.py).
set -u; export PYTHONUNBUFFERED=1; timeout 200 python3 scripts/bench/graph_kernels.py --ext .s8/final.so --case 4096x4096:4:1:1 --case 4096x4096:4:1:16 --case 5120x12288:4:1:1 --case 5120x17408:3:2:1 --splits 4 8 16 32 --json $OUT/gk.json 2>&1 | grep -v Warn | tail -80
