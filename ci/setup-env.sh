#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Creates (or reuses) the pinned CPU environment: torch 2.11.0 and the official vLLM 0.26.0 wheel
# installed without their dependency closure, the CUDA libraries libtorch_cuda.so links against at
# torch's own pins, plus exactly what vLLM's config, layers and distributed code import and what
# the tests use. Installing vLLM "normally" would pull ~3 GB of CUDA packages and triton.
#
#   ci/setup-env.sh            create the environment, or reuse it when it is complete
#   ci/setup-env.sh --path     print the environment's path and exit
#   ci/setup-env.sh --clean    remove the environments of other versions of this script
#
# Everything lives under one cache folder, $VLLM_EXL3_CACHE (default ~/.cache/vllm-exl3): the
# release wheels in wheels/ (shared with `scripts/vllm-exl3 build`) and the environment in
# venv-<hash of this file>/, so that checkouts at different commits sharing the cache keep their
# own environments. VLLM_EXL3_VENV and VLLM_EXL3_WHEELS override single paths.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
CACHE=${VLLM_EXL3_CACHE:-$HOME/.cache/vllm-exl3}
WHEELS=${VLLM_EXL3_WHEELS:-$CACHE/wheels}
stamp=$(sha256sum "$here/setup-env.sh" | cut -c1-16)
VENV=${VLLM_EXL3_VENV:-$CACHE/venv-$stamp}
NAME=setup-env
P="$VENV/bin/pip"
# shellcheck source=ci/env-lib.sh
source "$here/env-lib.sh"

case "${1:-}" in
  --path) echo "$VENV"; exit 0 ;;
  --clean)
    for d in "$CACHE"/venv "$CACHE"/venv-*; do
      [ -d "$d" ] && [ "$d" != "$VENV" ] || continue
      echo "setup-env: removing $d"; rm -rf "$d"
    done
    rm -f "$CACHE"/venv-*.lock
    exit 0 ;;
  "") ;;
  *) echo "setup-env: unknown argument $1 (--path, --clean)" >&2; exit 2 ;;
esac

# torch 2.11.0 and vLLM 0.26.0 publish wheels for CPython 3.10-3.13; the tool needs 3.11+.
PY=$(env_python)
env_reuse_or_lock "$VENV/.exl3-env-$stamp"

pyver=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
rm -rf "$VENV"
t0=$(date +%s)
$PY -m venv "$VENV"
"$P" install -q --upgrade "pip>=24"
torch_whl=$(release_wheel torch 2.11.0 "torch-2.11.0-$pyver-*.whl" "$pyver, ~530 MB")
vllm_whl=$(release_wheel vllm 0.26.0 "vllm-0.26.0-*.whl" "~300 MB")
# What vllm.config / layers / fused_moe / distributed / the quant registry import, plus the
# tools our tests and scripts use. Installed with pip's resolver BEFORE torch and vLLM, so that
# the resolver never sees their (deliberately) missing dependencies and reports no conflict.
"$P" install -q filelock typing-extensions sympy networkx jinja2 fsspec \
  numpy packaging regex psutil pyzmq pydantic cbor2 "transformers>=5.5.3,<6" aiohttp requests \
  openai openai-harmony msgspec pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo \
  prometheus_client einops pytest safetensors tokenizers loguru wheel "setuptools<81" ninja
# The CUDA 13 libraries libtorch_cuda.so links against (import torch fails without them), at the
# versions torch 2.11.0's wheel pins: its Requires-Dist names cudnn, cusparselt, nccl and nvshmem
# directly and the rest through cuda-toolkit==13.0.2, whose extras pin the versions below
# (tests/tooling/test_environments.py compares them with both wheels' metadata). cusolver, nvrtc
# and nvtx, also in torch's list, are loaded only on use and are left out (~300 MB).
"$P" install -q --no-deps \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 nvidia-cublas==13.1.0.3 \
  nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 \
  nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.0.88 \
  nvidia-cudnn-cu13==9.19.0.56 nvidia-cusparselt-cu13==0.8.0 nvidia-nccl-cu13==2.28.9 \
  nvidia-nvshmem-cu13==3.4.5
"$P" install -q --no-deps "$torch_whl" "$vllm_whl"
# cuobjdump and the nvdisasm its -sass runs, for the SASS tools' tests: the local nvcc may have
# neither.
"$P" install -q --no-deps nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51
"$P" install -q --no-deps compressed-tensors==0.17.0
# vLLM 0.26's qwen3_5 model module imports torchvision (through its Qwen3-VL vision tower).
"$P" install -q --no-deps torchvision==0.26.0
# The Python lint test (tests/tooling/test_repo_lint.py): scripts the CPU suite cannot run (the
# GPU benchmarks) still get their names checked.
"$P" install -q --no-deps pyflakes==4.1.0
touch "$VENV/.exl3-env-$stamp"
echo "setup-env: ready in $(( $(date +%s) - t0 ))s at $VENV"
