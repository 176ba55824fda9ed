#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prepares the issue-4 GPU record on this (CPU) machine: the quick wheel with our kernels for
# sm_90, the offline bundle for the GPU host's Python 3.12 cut into parts that each fit one device
# call next to the working tree, the parts linked into .e2e/xfer/cN (the folders the calls
# carry), and the call sequence printed and written to .e2e/calls.md / calls.json.
#
#   scripts/e2e/prepare.sh                 build (kernels for 9.0) + bundle + plan
#   scripts/e2e/prepare.sh --no-kernels    Python-only wheel (sizing only: EXL3 runs the slow
#                                          reference path there)
#   scripts/e2e/prepare.sh --wheel W.whl   bundle an already built wheel
# Env: MARGIN_MIB (room for the tree to grow before the calls, default 2), JOBS (nvcc jobs, 1).
set -euo pipefail
cd "$(dirname "$0")/../.."
e2e=.e2e
py=${PYTHON:-python3}
margin=${MARGIN_MIB:-2}
jobs=${JOBS:-1}
arch=9.0  # the H200
mode=kernels
wheel=
while [ $# -gt 0 ]; do
  case "$1" in
    --no-kernels) mode=nokernels ;;
    --wheel) wheel=$2; shift ;;
    *) echo "prepare.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if ! git check-ignore -q "$e2e/x"; then
  echo "prepare.sh: $e2e/ is not ignored by git (.gitignore needs /.e2e/): it would travel" \
       "with every device call" >&2
  exit 1
fi
mkdir -p "$e2e"
kernels_note="EXL3 kernels for sm_${arch/./} built"
if [ -z "$wheel" ]; then
  rm -rf "$e2e/dist"
  if [ "$mode" = kernels ]; then
    if ! scripts/vllm-exl3 build --archs "$arch" --jobs "$jobs" --dist-dir "$e2e/dist" \
        --work-dir "$e2e/work" 2>&1 | tee "$e2e/build.log"; then
      echo "prepare.sh: ===== THE KERNEL BUILD FAILED (log: $e2e/build.log) =====" >&2
      echo "prepare.sh: continuing with --no-kernels FOR SIZING ONLY; this bundle cannot" \
           "produce the GPU record (EXL3 layers would run the reference path)" >&2
      mode=nokernels
    fi
  fi
  if [ "$mode" = nokernels ]; then
    scripts/vllm-exl3 build --no-kernels --dist-dir "$e2e/dist" --work-dir "$e2e/work" \
      2>&1 | tee -a "$e2e/build.log"
    kernels_note="NO EXL3 kernels (sizing only)"
  fi
  wheel=$(ls -t "$e2e"/dist/vllm-*.whl | head -1)
fi
"$py" -c "import sys, zipfile; n = zipfile.ZipFile(sys.argv[1]).namelist(); \
print('wheel has vllm/_exl3_C.abi3.so' if 'vllm/_exl3_C.abi3.so' in n else \
'WARNING: wheel has no vllm/_exl3_C.abi3.so')" "$wheel"

part=$("$py" scripts/e2e/device_calls.py budget --margin-mib "$margin")
echo "prepare.sh: bundle parts of $part bytes (64 MiB per call - working tree - ${margin} MiB)"
scripts/vllm-exl3 bundle --wheel "$wheel" --python-version 3.12 --part-size "$part" \
  --out "$e2e/bundle"
"$py" scripts/e2e/device_calls.py layout --bundle "$e2e/bundle" --margin-mib "$margin"
echo
echo "prepare.sh: $(basename "$wheel"): $kernels_note; plan in $e2e/calls.md"
