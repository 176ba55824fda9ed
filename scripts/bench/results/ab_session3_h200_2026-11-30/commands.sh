#!/usr/bin/env bash
# Session-3 single-H200 A/B: persistent prefetching original-basis reconstruct (3 or 2 blocks/SM)
# vs the 6f02da0 one, and the streamk branch (verify + bench with VLLM_EXL3_STREAM_K 0/1/unset).
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
exec > >(tee -a "$OUT/run.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
SK=$PWD/.sk/streamk
SHAPES="5120x12288 5120x17408 17408x5120 4096x4096 4096x11008"
log "verify recon3 (full)"
timeout 150 python3 scripts/bench/verify_kernels.py --ext .sk/recon3.so --json $OUT/verify_recon3.json 2>&1 | tail -12
log "verify recon2 (quick)"
timeout 90 python3 scripts/bench/verify_kernels.py --ext .sk/recon2.so --quick --json $OUT/verify_recon2.json 2>&1 | tail -4
for v in old recon3 recon2; do
  so=.sk/$v.so; [ $v = old ] && so=$SK/_exl3_C.abi3.so
  log "profile recon_original m=1024,4096: $v"
  timeout 80 python3 scripts/bench/profile_paths.py --ext $so --shapes $SHAPES --m 1024 4096 \
    --paths recon_original --json $OUT/pp_recon_$v.json 2>&1 | grep -E "recon_original|bf16 matmul|Error|error" | grep -v "exl3 plan"
done
log "verify streamk branch (full)"
(cd $SK && timeout 150 python3 scripts/bench/verify_kernels.py --ext $SK/_exl3_C.abi3.so --json $OUT/verify_sk.json 2>&1 | tail -14)
for sk in 0 1 unset; do
  log "bench streamk=$sk"
  (cd $SK; export VLLM_EXL3_LOG_PLANS=1; if [ $sk != unset ]; then export VLLM_EXL3_STREAM_K=$sk; fi
   timeout 110 python3 scripts/bench/bench_linear.py --ext $SK/_exl3_C.abi3.so --no-exl3 --out $OUT \
     --tag sk_$sk --bits 4 --codebooks 1 --m 32 64 128 256 512 --budget-s 75 2> $OUT/plans_sk_$sk.log | grep -v '^{"k"' | tail -28)
done
log "racecheck control: torch's own kernels, no exl3"
timeout 90 compute-sanitizer --tool racecheck --racecheck-report hazard python3 -c \
  "import torch; x=torch.randn(2048,2048,device='cuda'); y=torch.softmax(x,-1); z=x.sum(0); torch.cuda.synchronize(); print('control ok', float(z[0]))" \
  > $OUT/racecheck_control.log 2>&1
echo "racecheck control exit $?"; tail -5 $OUT/racecheck_control.log
log done
# --- call 2
set -u
export PYTHONUNBUFFERED=1
T0=$(date +%s); log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
exec > >(tee -a "$OUT/run.log") 2>&1
SK=$PWD/.sk/streamk; E=$SK/_exl3_C.abi3.so
for w in recon linear; do
  log "racecheck probe $w"
  timeout 60 compute-sanitizer --tool racecheck --racecheck-report hazard python3 .sk/race.py $w $E > $OUT/race_$w.log 2>&1
  echo "exit $?"; grep -v "^=========     \|^$" $OUT/race_$w.log | tail -6
done
log "verify streamk branch (full)"
(cd $SK && timeout 150 python3 scripts/bench/verify_kernels.py --ext $E --json $OUT/verify_sk.json 2>&1 | tail -16)
for sk in 0 1 unset; do
  log "bench streamk=$sk"
  (cd $SK; export VLLM_EXL3_LOG_PLANS=1; if [ $sk != unset ]; then export VLLM_EXL3_STREAM_K=$sk; fi
   timeout 110 python3 scripts/bench/bench_linear.py --ext $E --no-exl3 --out $OUT \
     --tag sk_$sk --bits 4 --codebooks 1 --m 32 64 128 256 512 --budget-s 75 2> $OUT/plans_sk_$sk.log | grep -v '^{"k"' | tail -28)
done
log done
# --- call 3
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
E=$PWD/.sk/streamk/_exl3_C.abi3.so
echo "== verify --sample under racecheck, no kernel filter"
timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 python3 scripts/bench/verify_kernels.py --ext $E --sample > $OUT/race_sample_nofilter.log 2>&1
echo "exit $?"; grep -E "Internal|RACECHECK SUMMARY|ALL PASS|FAIL|Error" $OUT/race_sample_nofilter.log | head -5
for p in 16x1 16x2 32x2 64x1 128x1 128x3 recon_rotated recon_original; do
  timeout 40 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 python3 .sk/race.py $p $E > $OUT/race_$p.log 2>&1
  echo "probe $p exit $?: $(grep -E 'Internal|RACECHECK SUMMARY' $OUT/race_$p.log | head -2 | tr '\n' ' ')"
done
echo "== the same 16x2 probe with the kernel filter kns=exl3"
timeout 40 compute-sanitizer --tool racecheck --racecheck-report hazard --kernel-name kns=exl3 --error-exitcode 9 python3 .sk/race.py 16x2 $E > $OUT/race_filter.log 2>&1
echo "exit $?: $(grep -E 'Internal|RACECHECK SUMMARY' $OUT/race_filter.log | head -2 | tr '\n' ' ')"
# --- .sk/race.py (call 3)
# # racecheck probe: one op per plan, eager, pinned plan (no tuner), no graphs
# import os, sys
# sys.path.insert(0, "scripts/bench")
# import torch
# from verify_kernels import load_extension, random_layer
# plan = sys.argv[1]
# load_extension(sys.argv[2] if len(sys.argv) > 2 else None)
# gen = torch.Generator(device="cuda").manual_seed(0)
# layer = random_layer(gen, 256, [128, 256], 4.0, 1)
# x = torch.randn(17, 256, generator=gen, device="cuda").bfloat16()
# if plan.startswith("recon_"):
#     os.environ.update(VLLM_EXL3_RECONSTRUCT_M="1", VLLM_EXL3_RECONSTRUCT_BASIS=plan[6:])
# else:
#     bm, split = plan.split("x")
#     os.environ.update(VLLM_EXL3_BM=bm, VLLM_EXL3_SPLIT_K=split, VLLM_EXL3_RECONSTRUCT_M="0")
# y = torch.ops._C.exl3_linear(x, layer.trellis, layer.suh, layer.svh, None, layer.widths, layer.codebook)
# torch.cuda.synchronize()
# print(plan, float(y.float().abs().sum()))
# --- call 4
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
for v in base cold; do
  echo "== bench $v"
  VLLM_EXL3_LOG_PLANS=1 timeout 200 python3 scripts/bench/bench_linear.py --ext .sk/$v.so --no-exl3 --out $OUT \
     --tag tuner_$v --bits 4 6 --codebooks 1 --budget-s 150 2> $OUT/plans_$v.log | grep -v '^{"k"' | tail -132
done
# --- run5.sh
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
for cfg in "6 2" "4 1"; do set -- $cfg
  timeout 100 python3 scripts/bench/profile_paths.py --ext .sk/base.so --shapes 5120x12288 --m 1 2 16 --bits $1 --codebook $2 --paths auto fused_bm16 --json $OUT/pp_m1_$1_$2.json 2>&1 | grep -v "^exl3 plan"
done
for m in 1 16; do
  timeout 60 ncu --clock-control none -k regex:exl3_ -c 3 --metrics gpu__time_duration.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__sass_thread_inst_executed.sum,sm__cycles_active.avg,sm__cycles_active.max,dram__bytes_read.sum \
    python3 scripts/bench/ncu_probe.py 6 2 $m --k 5120 --n 12288 --split 6 --ext .sk/base.so 2>&1 | grep -E "exl3_|duration|issue|inst_exec|cycles|dram|ERR" | sed "s/^/[m=$m] /"
done
# --- run6.sh
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
run() { echo "== $*"; env "$@" timeout 60 python3 scripts/bench/bench_linear.py --ext .sk/base.so --no-exl3 --out $OUT --tag t --shapes 5120x12288 4096x11008 --bits 6 --codebooks 2 --m 1 2 16 2>/dev/null | grep -E "^ *[0-9]+x" ; }
run A=auto
run VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=6 VLLM_EXL3_RECONSTRUCT_M=0
run VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=1 VLLM_EXL3_RECONSTRUCT_M=0
run VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=12 VLLM_EXL3_RECONSTRUCT_M=0
# --- run7.sh
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
echo "== tuner picks in fresh processes (LOG_PLANS), 6-bit MUL1 m=1"
for i in 1 2 3 4 5 6; do
  VLLM_EXL3_LOG_PLANS=1 timeout 60 python3 scripts/bench/bench_linear.py --ext .sk/base.so --no-exl3 --out $OUT --tag p$i --shapes 5120x12288 4096x11008 --bits 6 --codebooks 2 --m 1 2>&1 | grep -E "exl3 plan|^ *[0-9]+x" | sed "s/^/[$i] /"
done
echo "== pinned split 3, 2"
for s in 3 2; do
VLLM_EXL3_BM=16 VLLM_EXL3_SPLIT_K=$s VLLM_EXL3_RECONSTRUCT_M=0 timeout 60 python3 scripts/bench/bench_linear.py --ext .sk/base.so --no-exl3 --out $OUT --tag s$s --shapes 5120x12288 4096x11008 --bits 6 --codebooks 2 --m 1 2>/dev/null | grep -E "^ *[0-9]+x" | sed "s/^/[split $s] /"
done
# --- run8.sh
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
for order in "4096 1 2 16" "1 2 16 4096"; do
  echo "== m order: $order"
  timeout 90 python3 scripts/bench/bench_linear.py --ext .sk/base.so --no-exl3 --out $OUT --tag o --shapes 5120x12288 --bits 6 4 --codebooks 2 --m $order 2>/dev/null | grep -E "^ *[0-9]+x"
  nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader
done
# --- run9.sh
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
for v in base rr base rr; do
  echo "== $v, m order 4096 1 2 16"
  VLLM_EXL3_LOG_PLANS=1 timeout 90 python3 scripts/bench/bench_linear.py --ext .sk/$v.so --no-exl3 --out $OUT --tag o --shapes 5120x12288 --bits 6 4 --codebooks 2 --m 4096 1 2 16 2> $OUT/plans.log | grep -E "^ *[0-9]+x"
  grep -E "m=1 " $OUT/plans.log
done
rm -f $OUT/o_*
# --- run10.sh
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv,noheader -lms 250 > $OUT/smi.csv 2>&1 &
SMI=$!
timeout 120 python3 .sk/state.py .sk/base.so 2>&1 | grep -v Warning | tee $OUT/state.log
kill $SMI
awk -F, '{print $2,$3,$4,$5,$6}' $OUT/smi.csv | sort | uniq -c | sort -rn | head -12
# --- .sk/state.py
# # Is a small-m call slower after large-m work in the same process, and why (power vs our state)?
# import os, sys, time
# sys.path.insert(0, "scripts/bench")
# import torch
# import bench_linear as B
# from verify_kernels import load_extension, random_layer
# load_extension(sys.argv[1])
# gen = torch.Generator(device="cuda").manual_seed(0)
# k, n, bits, cb = 5120, 12288, 6.0, 2
# layers = [random_layer(gen, k, [n], bits, cb) for _ in range(B.copies_for(int(k * n * bits / 8)))]
# PIN = dict(VLLM_EXL3_BM="16", VLLM_EXL3_SPLIT_K="14", VLLM_EXL3_RECONSTRUCT_M="0")
# T0 = time.monotonic()
# def ours(m):
#     x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
#     return B.graph_time_us([lambda L=L: torch.ops._C.exl3_linear(x, L.trellis, L.suh, L.svh, None, L.widths, L.codebook) for L in layers])[0]
# def rec(tag, us):
#     print(f"{time.monotonic() - T0:7.2f} s  {tag:40s} {us:8.1f} us", flush=True)
# def pinned(on):
#     for key, v in PIN.items():
#         if on: os.environ[key] = v
#         else: os.environ.pop(key, None)
# pinned(True)
# rec("ours m=1 pinned, fresh", ours(1))
# rec("ours m=1 pinned, again", ours(1))
# w = torch.randn(k, n, device="cuda").bfloat16(); xb = torch.randn(4096, k, device="cuda").bfloat16()
# rec("bf16 matmul m=4096 (heavy, not ours)", B.graph_time_us([lambda: torch.matmul(xb, w)] * 20)[0])
# rec("ours m=1 pinned, after bf16 heavy", ours(1))
# pinned(False)
# rec("ours m=4096 (tuned: reconstruct path)", ours(4096))
# pinned(True)
# rec("ours m=1 pinned, after ours m=4096", ours(1))
# time.sleep(3)
# rec("ours m=1 pinned, after 3 s idle", ours(1))
# torch.cuda.empty_cache()
# rec("ours m=1 pinned, after empty_cache", ours(1))
# --- .sk/settle.py
# # How long after heavy tensor work does a light call run slow? m=1 (pinned plan) at delays.
# import os, sys, time
# sys.path.insert(0, "scripts/bench")
# import torch
# import bench_linear as B
# from verify_kernels import load_extension, random_layer
# load_extension(sys.argv[1])
# gen = torch.Generator(device="cuda").manual_seed(0)
# k, n, bits, cb = 5120, 12288, 6.0, 2
# layers = [random_layer(gen, k, [n], bits, cb) for _ in range(B.copies_for(int(k * n * bits / 8)))]
# os.environ.update(VLLM_EXL3_BM="16", VLLM_EXL3_SPLIT_K="14", VLLM_EXL3_RECONSTRUCT_M="0")
# x = torch.randn(1, k, generator=gen, device="cuda").bfloat16()
# calls = [lambda L=L: torch.ops._C.exl3_linear(x, L.trellis, L.suh, L.svh, None, L.widths, L.codebook) for L in layers]
# w = torch.randn(k, n, device="cuda").bfloat16(); xb = torch.randn(4096, k, device="cuda").bfloat16()
# heavy = [lambda: torch.matmul(xb, w)] * 20
# print("fresh", round(B.graph_time_us(calls)[0], 1))
# for delay in (0.0, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0):
#     B.graph_time_us(heavy)
#     torch.cuda.synchronize(); time.sleep(delay)
#     print(f"after heavy + {delay:4.2f} s idle: {B.graph_time_us(calls)[0]:6.1f} us", flush=True)
# --- run11.sh (branch xchg 67075bd vs the 8796f4f wheel's kernels)
set -u
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/run.log") 2>&1
echo "== verify xchg (full)"
timeout 120 python3 scripts/bench/verify_kernels.py --ext .sk/xchg.so --json $OUT/verify_xchg.json 2>&1 | tail -11
for v in base xchg; do
  echo "== $v pinned BM 128, 4-bit MCG"
  VLLM_EXL3_BM=128 VLLM_EXL3_RECONSTRUCT_M=0 timeout 80 python3 scripts/bench/bench_linear.py --ext .sk/$v.so --no-exl3 --out $OUT --tag bm128_$v --bits 4 --codebooks 1 --m 128 256 512 1024 2>/dev/null | grep -E "^ *[0-9]+x"
done
for v in base xchg; do
  echo "== $v tuner, 4-bit MCG"
  timeout 80 python3 scripts/bench/bench_linear.py --ext .sk/$v.so --no-exl3 --out $OUT --tag auto_$v --bits 4 --codebooks 1 --m 64 128 256 512 2>/dev/null | grep -E "^ *[0-9]+x"
done
rm -f $OUT/*.json
