#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Creates (or reuses) the second pinned CPU environment, the one the upstream series
# (`scripts/vllm-exl3 series`, patches/0.34.0/) is tested in: torch 2.14.0 and the official
# vLLM 0.34.0 wheel installed without their dependency closure, the CUDA libraries
# libtorch_cuda.so links against at torch's own pins, and what vLLM's config, layers and test
# harness import. The same recipe as ci/setup-env.sh (the vLLM 0.26 environment), which it leaves
# alone. PyPI offers no CPU-only torch 2.14.0 wheel for Linux x86_64 (those live on PyTorch's own
# index), so this is the default CUDA wheel, used without a GPU.
#
#   ci/setup-env-upstream.sh            create the environment, or reuse it when it is complete
#   ci/setup-env-upstream.sh --path     print the environment's path and exit
#
# Lives in $VLLM_EXL3_CACHE (default ~/.cache/vllm-exl3) as venv-0.34.0-<hash of this file>; the
# wheels go to the shared wheels/ folder. VLLM_EXL3_UPSTREAM_VENV overrides the path.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
VLLM=0.34.0
TORCH=2.14.0
CACHE=${VLLM_EXL3_CACHE:-$HOME/.cache/vllm-exl3}
WHEELS=${VLLM_EXL3_WHEELS:-$CACHE/wheels}
stamp=$(sha256sum "$here/setup-env-upstream.sh" | cut -c1-16)
VENV=${VLLM_EXL3_UPSTREAM_VENV:-$CACHE/venv-$VLLM-$stamp}

case "${1:-}" in
  --path) echo "$VENV"; exit 0 ;;
  "") ;;
  *) echo "setup-env-upstream: unknown argument $1 (--path)" >&2; exit 2 ;;
esac

# vLLM's mypy hook checks for the oldest Python it supports, 3.11; torch 2.14.0 and vLLM 0.34.0
# publish wheels for it.
PY=${VLLM_EXL3_PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3.13; do
    if command -v "$candidate" >/dev/null; then PY=$candidate; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup-env-upstream: no python3.11-3.13 found (set VLLM_EXL3_PYTHON)" >&2; exit 1; }

marker="$VENV/.exl3-env-$stamp"
[ -f "$marker" ] && { echo "setup-env-upstream: reusing $VENV"; exit 0; }
mkdir -p "$(dirname "$VENV")" "$WHEELS"
exec 9>"$VENV.lock"
flock 9
[ -f "$marker" ] && { echo "setup-env-upstream: reusing $VENV"; exit 0; }

pyver=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
rm -rf "$VENV"
t0=$(date +%s)
$PY -m venv "$VENV"
P="$VENV/bin/pip"
"$P" install -q --upgrade "pip>=24"
torch_whl=$(ls "$WHEELS"/torch-$TORCH-$pyver-*.whl 2>/dev/null | head -1 || true)
if [ -z "$torch_whl" ]; then
  echo "setup-env-upstream: downloading torch $TORCH ($pyver, ~555 MB)"
  "$P" download -q --no-deps torch==$TORCH -d "$WHEELS"
  torch_whl=$(ls "$WHEELS"/torch-$TORCH-$pyver-*.whl | head -1)
fi
vllm_whl=$(ls "$WHEELS"/vllm-$VLLM-*.whl 2>/dev/null | head -1 || true)
if [ -z "$vllm_whl" ]; then
  echo "setup-env-upstream: downloading vllm $VLLM wheel (~240 MB)"
  "$P" download -q --no-deps vllm==$VLLM -d "$WHEELS"
  vllm_whl=$(ls "$WHEELS"/vllm-$VLLM-*.whl | head -1)
fi
# What vllm.config / layers / fused_moe / distributed / the quant registry and vLLM's tests'
# conftest import, within vLLM 0.34.0's declared ranges (transformers <5.23). Installed with pip's
# resolver before torch and vLLM, so it never sees their deliberately missing dependencies.
"$P" install -q filelock typing-extensions sympy networkx jinja2 fsspec \
  numpy packaging regex psutil pyzmq pydantic cbor2 "transformers>=5.16.1,<5.23" aiohttp \
  "requests>=2.33" openai msgspec pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo \
  prometheus_client einops pytest safetensors tokenizers wheel "setuptools<81" ninja blake3 \
  ijson tqdm pyyaml huggingface_hub
# The CUDA 13 libraries libtorch_cuda.so links against, at torch 2.14.0's pins: its Requires-Dist
# names cudnn, cusparselt, nccl and nvshmem directly and the rest through cuda-toolkit==13.0.3,
# whose extras pin the versions below. cusolver, nvrtc and nvtx are loaded only on use.
"$P" install -q --no-deps \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 nvidia-cublas==13.1.1.3 \
  nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 \
  nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.0.88 \
  nvidia-cudnn-cu13==9.24.0.43 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7 \
  nvidia-nvshmem-cu13==3.4.5
"$P" install -q --no-deps "$torch_whl" "$vllm_whl"
"$P" install -q --no-deps compressed-tensors==0.17.0 torchvision==0.29.0
touch "$marker"
echo "setup-env-upstream: ready in $(( $(date +%s) - t0 ))s at $VENV"
