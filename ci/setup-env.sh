#!/usr/bin/env bash
# Creates (or reuses) the CPU-only test environment: torch 2.11.0 and the official vLLM 0.26.0
# wheel installed without their dependency closure, plus exactly what vLLM's config, layers and
# distributed code import. Installing vLLM "normally" would pull ~3 GB of CUDA pins and triton.
# Idempotent: a venv whose marker matches this file's hash is reused as it is.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
VENV=${VLLM_EXL3_VENV:-$HOME/.cache/vllm-exl3/venv}
WHEELS=${VLLM_EXL3_WHEELS:-$HOME/.cache/vllm-exl3/wheels}
# torch 2.11.0 and vLLM 0.26.0 publish wheels for CPython 3.10-3.13; take the first present.
PY=${VLLM_EXL3_PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3.13 python3.10; do
    if command -v "$candidate" >/dev/null; then PY=$candidate; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup-env: no python3.10-3.13 found (set VLLM_EXL3_PYTHON)" >&2; exit 1; }
stamp=$(sha256sum "$0" | cut -c1-16)
if [ -f "$VENV/.exl3-env-$stamp" ]; then
  echo "setup-env: reusing $VENV"; exit 0
fi
pyver=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
mkdir -p "$WHEELS"
rm -rf "$VENV"
t0=$(date +%s)
$PY -m venv "$VENV"
P="$VENV/bin/pip"
"$P" install -q --upgrade "pip>=24"
torch_whl=$(ls "$WHEELS"/torch-2.11.0-$pyver-*.whl 2>/dev/null | head -1 || true)
if [ -z "$torch_whl" ]; then
  echo "setup-env: downloading torch 2.11.0 ($pyver, ~530 MB)"
  "$P" download -q --no-deps torch==2.11.0 -d "$WHEELS"
  torch_whl=$(ls "$WHEELS"/torch-2.11.0-$pyver-*.whl | head -1)
fi
vllm_whl=$(ls "$WHEELS"/vllm-0.26.0-*.whl 2>/dev/null | head -1 || true)
if [ -z "$vllm_whl" ]; then
  echo "setup-env: downloading vllm 0.26.0 wheel (~300 MB)"
  "$P" download -q --no-deps vllm==0.26.0 -d "$WHEELS"
  vllm_whl=$(ls "$WHEELS"/vllm-0.26.0-*.whl | head -1)
fi
"$P" install -q --no-deps "$torch_whl" "$vllm_whl"
# The CUDA-13 shared libraries libtorch_cuda.so links against; import torch fails without them.
"$P" install -q --no-deps \
  nvidia-cuda-runtime nvidia-cuda-cupti nvidia-cublas nvidia-cufft nvidia-cufile nvidia-curand \
  nvidia-cusparse nvidia-cusparselt-cu13 nvidia-nccl-cu13 nvidia-cudnn-cu13 nvidia-nvshmem-cu13 \
  nvidia-nvjitlink
# cuobjdump and the nvdisasm its -sass runs, for the SASS tools' tests
# (scripts/bench/sass_loop.py): the local nvcc has neither.
"$P" install -q --no-deps nvidia-cuda-cuobjdump==13.2.51 nvidia-cuda-nvdisasm==13.2.51
# What vllm.config / layers / fused_moe / distributed / the quant registry import, plus the
# tools our tests and scripts use.
"$P" install -q filelock typing-extensions sympy networkx jinja2 fsspec \
  numpy packaging regex psutil pyzmq pydantic cbor2 "transformers>=5.5.3,<6" aiohttp requests \
  openai openai-harmony msgspec pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo \
  prometheus_client einops pytest safetensors tokenizers loguru wheel "setuptools<81" ninja
"$P" install -q --no-deps compressed-tensors==0.17.0
# The Python lint test (tests/tooling/test_python_lint.py): scripts the CPU suite cannot run (the
# GPU benchmarks) still get their names checked.
"$P" install -q --no-deps pyflakes==4.1.0
touch "$VENV/.exl3-env-$stamp"
echo "setup-env: ready in $(( $(date +%s) - t0 ))s at $VENV"
