# Session 6, call 5: what bounds the wgmma engine - L2 traffic of the activation tiles, tensor pipe?
set -u
export PYTHONUNBUFFERED=1
PY=python3
T0=$(date +%s)
exec > >(tee -a "$OUT/call5.log") 2>&1
log() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
ncu --query-metrics 2>/dev/null | grep -iE "tensor|gmma|lts__t_bytes |lts__throughput|l1tex__m_xbar2l1tex" | cut -c1-110 | head -30
M=gpu__time_duration.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,lts__t_sectors_srcunit_tex.sum,dram__bytes_read.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_tensor_op_gmma.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second
for a in "256 --bm 128 --split 2" "4096 --bm 256 --split 1" "1024 --bm 256 --split 1"; do
  log "ncu wg3 m=$a"
  VLLM_EXL3_WGMMA=1 timeout 120 ncu --clock-control none -k regex:exl3_gemm_kernel -c 1 --metrics $M \
    $PY scripts/bench/ncu_probe.py 4 1 $a --k 5120 --n 12288 --ext .s6/wg3.so 2>&1 | grep -E "^\s+(gpu__|sm__|smsp__|lts__|dram__|l1tex__)|==ERR|rror" | head -20
done
log "ncu cublas bf16 m=1024 5120x12288 (reference for L2 and tensor numbers)"
timeout 60 ncu --clock-control none -k regex:"nvjet|gemm|sm90" -c 1 --metrics $M $PY -c "
import torch
a=torch.randn(1024,5120,device='cuda',dtype=torch.bfloat16); b=torch.randn(5120,12288,device='cuda',dtype=torch.bfloat16)
for _ in range(3): c=a@b
torch.cuda.synchronize()" 2>&1 | grep -E "^\s+(gpu__|sm__|smsp__|lts__|dram__|l1tex__)|==ERR|rror|nvjet" | head -20
log "call5 done"
