#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# vLLM's own test harness on the EXL3 paths: the test files under overlay/tests/, run inside a
# copy of the pinned vLLM sdist's tests/ tree with our series applied, under vLLM's own
# tests/conftest.py (vllm_runner, opcheck, ...), against an installed vLLM that carries the
# series. The tree holds no vllm/ package (as vLLM's own test image hides its sources), so the
# tests import the installed one. Parts that need CUDA skip themselves without it.
#
#   ci/test_vllm_harness.sh [PYTEST_ARGS...]      run (ci/test.sh calls this last)
#   ci/test_vllm_harness.sh --pack OUT.tar.gz [--python-version 3.12]
#       for a host without network: vLLM's pristine tests tree and pytest configuration, and
#       the wheels of ci/requirements-harness.txt for that host's CPython (~11 MB)
#   VLLM_EXL3_HARNESS_PACK=OUT.tar.gz ci/test_vllm_harness.sh [PYTEST_ARGS...]
#       run from such a pack: this checkout's test files and op registrations are placed into
#       its tree; vLLM is the one $PYTHON imports (the built wheel: nothing is applied);
#       requirements it lacks go to a temporary --target directory for the run
# Env: VLLM_EXL3_VENV (the venv of ci/setup-env.sh; its vLLM gets the series re-applied),
# PYTHON (pack modes; default python3). The fixture checkpoints reach the tests through
# EXL3_TEST_MODELS_DIR (default: this checkout's tests/fixtures/qwen3-tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
requirements=$repo/ci/requirements-harness.txt
# What the run needs of vLLM's sdist: its tests/ and its pytest configuration.
VLLM_PARTS=(tests pyproject.toml)
# Where the series puts the ops' registrations (the CPU op tests read their schemas there).
OPS_SOURCES=csrc/libtorch_stable/quantization/exl3
TEST_LIST=.exl3-harness-tests

work=$(mktemp -d "${TMPDIR:-/tmp}/vllm-exl3-harness.XXXXXX")
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)

# Moves the named parts of tree $1 into $2, then removes $1.
take() {
  local src=$1 dest=$2 p
  shift 2
  for p in "$@"; do
    mkdir -p "$dest/$(dirname "$p")"
    mv "$src/$p" "$dest/$p"
  done
  rm -rf "$src"
}

# The pinned sdist's unpacked tree (fetched into the cache once), via interpreter $1.
sdist_tree() {
  "$1" scripts/vllm-exl3 fetch | tail -1
}

list_tests() {
  (cd overlay && find tests -name 'test_*.py' | sort) > "$1/$TEST_LIST"
  [ -s "$1/$TEST_LIST" ] || { echo "test_vllm_harness: overlay/tests holds no tests" >&2; exit 1; }
}

# The patched tests tree at $1: the sdist copied, the series applied by the tool (interpreter
# $2), what the run needs kept.
make_tree() {
  cp -a "$(sdist_tree "$2")" "$work/sdist"
  rm -f "$work/sdist/.vllm-exl3-unpacked"
  "$2" scripts/vllm-exl3 apply "$work/sdist" >/dev/null
  take "$work/sdist" "$1" "${VLLM_PARTS[@]}" "$OPS_SOURCES"
  list_tests "$1"
}

# Into a pack's pristine tree at $1: what the series adds under tests/ and csrc/, where
# `vllm-exl3 apply` puts it (no patch touches either).
place_ours() {
  PYTHONPATH=scripts "$PY" - "$1" <<'PYTHON'
import sys
from pathlib import Path

from vllm_exl3.repo import Series

series = Series.load()
for f in (*series.overlay, *series.csrc):
    if f.dest.startswith(("tests/", "csrc/")):
        target = Path(sys.argv[1], f.dest)
        if f.dest.startswith("tests/") and target.exists():
            sys.exit(f"test_vllm_harness: {f.origin} would replace vLLM's own {f.dest}")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(f.read_bytes())
PYTHON
  list_tests "$1"
}

# Lines "name==version" of the requirements file $2 that interpreter $1 does not have.
missing_requirements() {
  "$1" - "$2" <<'PYTHON'
import importlib.metadata as md
import sys

for line in open(sys.argv[1]):
    spec = line.split("#")[0].strip()
    if not spec:
        continue
    name, version = spec.split("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have != version:
        print(spec)
PYTHON
}

if [ "${1:-}" = --pack ]; then
  out=${2:?"--pack needs an output path"}
  pyver=3.12  # the GPU host's Python
  if [ "${3:-}" = --python-version ]; then pyver=${4:?"--python-version needs a version"}; fi
  tool_py=${PYTHON:-python3}
  cp -a "$(sdist_tree "$tool_py")" "$work/sdist"
  take "$work/sdist" "$work/pack/tree" "${VLLM_PARTS[@]}"
  # Binary wheels for that CPython (or the abi3 / pure-Python wheel, where that is what exists).
  "$tool_py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -r "$requirements" -d "$work/pack/wheels"
  cp "$requirements" "$work/pack/requirements-harness.txt"
  tar -czf "$out" -C "$work/pack" tree wheels requirements-harness.txt
  echo "test_vllm_harness: wrote $out ($(du -h "$out" | cut -f1)) for CPython $pyver"
  exit 0
fi

if [ -n "${VLLM_EXL3_HARNESS_PACK:-}" ]; then
  PY=${PYTHON:-python3}
  tar -xzf "$VLLM_EXL3_HARNESS_PACK" -C "$work"
  tree=$work/tree
  place_ours "$tree"
  missing=$(missing_requirements "$PY" "$work/requirements-harness.txt")
  if [ -n "$missing" ]; then
    wheels=()
    for spec in $missing; do
      wheels+=("$(ls "$work"/wheels/"${spec%%==*}"-"${spec##*==}"-*.whl)")
    done
    "$PY" -m pip install -q --no-index --no-deps --target "$work/site" "${wheels[@]}"
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "test_vllm_harness: installed for this run:" $missing
  fi
else
  VENV=${VLLM_EXL3_VENV:-$HOME/.cache/vllm-exl3/venv}
  PY=$VENV/bin/python
  missing=$(missing_requirements "$PY" "$requirements")
  if [ -n "$missing" ]; then
    echo "test_vllm_harness: installing into $VENV:" $missing
    "$PY" -m pip install -q --no-deps $missing
  fi
  site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$PY" scripts/vllm-exl3 apply --replace "$site" >/dev/null
  tree=$work/tree
  make_tree "$tree" "$PY"
fi

export EXL3_TEST_MODELS_DIR=${EXL3_TEST_MODELS_DIR:-$repo/tests/fixtures/qwen3-tiny}
mapfile -t tests < "$tree/$TEST_LIST"
echo "test_vllm_harness: tree ready in $(( $(date +%s) - t0 ))s; running ${#tests[@]} test files"
set +e
(cd "$tree" && "$PY" -m pytest -c pyproject.toml --rootdir . -p no:cacheprovider -q -ra \
  "${tests[@]}" "$@")
rc=$?
set -e
echo "test_vllm_harness: done in $(( $(date +%s) - t0 ))s (pytest exit $rc)"
exit $rc
