# Session 7, call 1: full checks of lds.so (= main 4f460cc + branch wgmma-lds-ahead rebased,
# ef4f9e0): verify (full), tests/gpu, memcheck and racecheck samples. Then a pinned cold sweep of
# k-splits for the wgmma tiers at m = 128-1024 (the split model gives 1 wherever the tiles
# outnumber the SMs or the partial sums pass its traffic cap; wave quantization is not in it),
# with the reconstruct + cuBLAS path (bm 0) for reference.
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call1.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
F=.s7/lds.so
log "verify lds (full)"
timeout 60 $PY scripts/bench/verify_kernels.py --ext $F --json $OUT/verify_lds.json 2>&1 | tail -10
log "pytest tests/gpu (lds)"
VLLM_EXL3_EXT=$F timeout 45 $PY -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tail -1
log "memcheck sample"
timeout 25 compute-sanitizer --tool memcheck --kernel-name kns=exl3 --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
log "racecheck sample"
timeout 50 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 9 \
  $PY scripts/bench/verify_kernels.py --ext $F --sample 2>&1 | tail -1; echo "exit ${PIPESTATUS[0]}"
log "split sweep"
A="5120 12288 4 1"
CFG=()
for s in 1 2 3 4 5 6 8; do CFG+=("$A 128 128 $s 1"); done
for s in 1 2 3 4 6; do CFG+=("$A 256 256 $s 1"); done
for s in 2 3 4 6; do CFG+=("$A 256 128 $s 1"); done
for s in 1 2 3 4; do CFG+=("$A 512 256 $s 1"); done
for s in 1 2; do CFG+=("$A 1024 256 $s 1"); done
for m in 128 256 512 1024; do CFG+=("$A $m 0 0 0"); done
timeout 150 $PY .s7/pin.py $F s1_$SECONDS "${CFG[@]}"
B="17408 5120 4 1"; C="4096 4096 4 1"
CFG=()
for s in 2 3 4 6 8; do CFG+=("$B 128 128 $s 1"); done
for s in 1 2 3 4 6; do CFG+=("$B 256 256 $s 1"); done
for s in 2 3 4; do CFG+=("$B 512 256 $s 1"); done
for m in 256 512; do CFG+=("$B $m 0 0 0"); done
for s in 2 4 6 8; do CFG+=("$C 128 128 $s 1"); done
for s in 2 4 6; do CFG+=("$C 256 256 $s 1"); done
CFG+=("$C 256 0 0 0")
timeout 150 $PY .s7/pin.py $F s2_$SECONDS "${CFG[@]}"
log "call1 done"
cd "$OUT" && tar czf call1_files.tgz --exclude=call1_files.tgz --exclude=call1.log ./*.json 2>/dev/null; \
  find . -maxdepth 1 -type f ! -name call1_files.tgz ! -name call1.log -delete; ls
