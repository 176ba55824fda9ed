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
