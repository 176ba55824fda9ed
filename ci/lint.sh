#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The linters, in check mode (nothing is rewritten); exit status 1 on any finding:
#   ruff check and ruff format --check (pyproject.toml: vLLM 0.26's settings),
#   clang-format --dry-run on csrc/ (.clang-format: vLLM 0.26's),
#   the two-line SPDX header on the Python files of overlay/, scripts/, ci/ and tests/,
#   the checked-in generated source (csrc/libtorch_stable/exl3_wgmma_ops.h) against its
#   generator (csrc/libtorch_stable/quantization/exl3/generate_kernels.py --wgmma).
# ruff and clang-format are the versions vLLM 0.26's .pre-commit-config.yaml pins, installed
# from PyPI into the pinned environment when missing. To fix findings: ruff check --fix,
# ruff format, clang-format -i (or `pre-commit run --all-files`).
set -uo pipefail
cd "$(dirname "$0")/.."

RUFF_VERSION=0.14.0
CLANG_FORMAT_VERSION=21.1.2

bash ci/setup-env.sh >/dev/null || exit 1
VENV=$(bash ci/setup-env.sh --path)
BIN="$VENV/bin"

ensure() {  # package version executable
  if ! "$BIN/$3" --version 2>/dev/null | grep -q "$2"; then
    "$BIN/pip" install -q --no-deps "$1==$2" || { echo "lint: cannot install $1 $2" >&2; exit 1; }
  fi
}
ensure ruff "$RUFF_VERSION" ruff
ensure clang-format "$CLANG_FORMAT_VERSION" clang-format

status=0
step() {  # name command...
  local name=$1; shift
  if "$@"; then echo "lint: $name clean"; else echo "lint: $name FAILED"; status=1; fi
}

step "ruff check" "$BIN/ruff" check --no-fix .
step "ruff format" "$BIN/ruff" format --check .
mapfile -t cxx < <(git ls-files 'csrc/*.cu' 'csrc/*.cuh' 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.hpp')
step "clang-format" "$BIN/clang-format" --dry-run --Werror --style=file "${cxx[@]}"
mapfile -t py < <(git ls-files 'overlay/*' 'scripts/*' 'ci/*' 'tests/*' ':!tests/fixtures/*')
step "SPDX headers" "$BIN/python" ci/check_spdx.py "${py[@]}"

generated_sources_match() {
  # Each generator rewrites its output in place; the checkout must already hold that output.
  "$BIN/python" csrc/libtorch_stable/quantization/exl3/generate_kernels.py --wgmma >/dev/null &&
    git diff --exit-code --stat -- csrc/libtorch_stable/exl3_wgmma_ops.h
}
step "generated sources" generated_sources_match

exit $status
