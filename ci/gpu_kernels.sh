#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU CI for the EXL3 kernels, on a CUDA host: build the standalone extension for one arch, run
# the GPU kernel tests (oracle, batch invariance, workspace, plan reproducibility, sparse MLA), a
# compute-sanitizer memcheck of the oracle's sample and of sparse-MLA cases (with racecheck and
# synccheck), and the plan tuner, writing everything
# under $OUT (default ./gpu-kernels-out).
#
#   PY=python ARCH=9.0 OUT=/tmp/out bash ci/gpu_kernels.sh
#   VLLM_EXL3_EXT=path/_exl3_C.abi3.so ... bash ci/gpu_kernels.sh   (skips the build)
#
# PY: a Python with torch 2.11 and vLLM 0.26 with this overlay applied (scripts/vllm-exl3 apply).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
ARCH=${ARCH:-9.0}
OUT=${OUT:-$PWD/gpu-kernels-out}
JOBS=${JOBS:-$(nproc)}
mkdir -p "$OUT"
status=0
step() {
  local name=$1; shift
  echo "== $name"
  if "$@" >"$OUT/$name.log" 2>&1; then echo "   ok"; else echo "   FAILED (rc $?, $OUT/$name.log)"; status=1; fi
  tail -3 "$OUT/$name.log"
}

# VLLM_EXL3_EXT names an extension built beforehand (e.g. in the background while the host was
# being prepared); otherwise build one now.
if [ -n "${VLLM_EXL3_EXT:-}" ] && [ -f "$VLLM_EXL3_EXT" ]; then
  echo "== build: using $VLLM_EXL3_EXT"
else
  step build bash -c "cd scripts && $PY -m vllm_exl3.kernels_build --arch $ARCH --jobs $JOBS --out ../build/exl3"
  export VLLM_EXL3_EXT=$PWD/build/exl3/_exl3_C.abi3.so
fi
step gpu_tests $PY -m pytest -q -m gpu tests/gpu --junitxml "$OUT/gpu_tests.xml"
step plan_log_a $PY tests/gpu/plan_log.py
step plan_log_b $PY tests/gpu/plan_log.py
if cmp -s "$OUT/plan_log_a.log" "$OUT/plan_log_b.log"; then echo "   plans identical across processes"; else echo "   plans DIFFER"; status=1; fi
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
step memcheck "$SAN" --tool memcheck --error-exitcode 1 $PY tests/gpu/exl3_oracle.py --sample
# Sparse-MLA decode: small cases covering partial head groups of 16 and 32 heads, fp8_ds_mla,
# split-k with the combine, short lists, a strided cache; shared-memory races and barriers too.
MLA_CASES="T4-H17-D576-bf16 or T3-H17-D576-fp8 or T4-H20-D576 or T1-H16-D576-bf16-k2048-ctx65536 \
or T8-H16-D576-fp8-k2048-ctx4096-bs256-strided or T5-H16-D512 or T4-H100-D576 or T3-H64-D576-fp8"
for tool in memcheck racecheck synccheck; do
  step "sparse_mla_$tool" "$SAN" --tool $tool --error-exitcode 1 $PY -m pytest -q -m gpu \
    tests/gpu/test_sparse_mla.py -k "test_matches_reference and ($MLA_CASES)"
done
step tune_plans $PY scripts/bench/tune_plans.py tests/fixtures/qwen3-tiny/exl3-4.0bpw \
  tests/fixtures/qwen3-tiny/exl3-3.0bpw-mcg --bench-shapes --dtype bfloat16 --dtype float16 \
  --out "$OUT/configs"
echo "results in $OUT (exit $status)"
exit $status
