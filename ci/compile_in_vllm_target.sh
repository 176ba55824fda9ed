#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI (no GPU, no network but PyPI): our kernels compiled by vLLM's own CMake as objects of its
# `_C_stable_libtorch` target, with that target's flags, for the architectures `build` ships
# (9.0 as sm_90a; 12.0 and 12.1 as the sm_120f family image patch 0003 gives both).
#
#   `scripts/vllm-exl3 build --from-source --only objects` (scripts/vllm_exl3/vllm_cmake.py):
#   the pinned sdist's build files with the series applied, configured as vLLM's setup.py does
#   (cmake + ninja, the pinned venv's torch, the local nvcc; offline: CUTLASS v4.4.2 from its
#   pinned PyPI wheel, empty stand-ins for the seven repositories only other targets use),
#   then ninja on exactly our objects, then three checks that name the source file at fault:
#   the same flags as vLLM's own sources of the target, exactly the EXL3 block's -gencode and
#   SASS images (cuobjdump), and no global symbol outside namespace vllm_exl3 (nm). A compile
#   failure names the source file and the architecture it fails for.
#
# Downloads (the cmake wheel where the machine's is older than 3.26.1, the CUTLASS wheel) are
# cached under ~/.cache/vllm-exl3/; objects under build/vllm-cmake/ are reused by the next run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup-env.sh >/dev/null
VENV=$(bash ci/setup-env.sh --path)
exec "$VENV/bin/python" scripts/vllm-exl3 build --from-source --only objects \
  --archs "9.0;12.0;12.1" --jobs "$(nproc)" --python "$VENV/bin/python"
