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
#                                                 the tests tree plus the wheels of
#                                                 ci/requirements-harness.txt, for an offline host
#   VLLM_EXL3_HARNESS_PACK=OUT.tar.gz ci/test_vllm_harness.sh [PYTEST_ARGS...]
#                                                 run from such a pack: no network, nothing
#                                                 applied; vLLM is the one $PYTHON imports (the
#                                                 built wheel), requirements it lacks go to a
#                                                 temporary --target directory
# Env: VLLM_EXL3_VENV (the venv of ci/setup-env.sh; its vLLM gets the series re-applied),
# PYTHON (pack mode; default python3). The fixture checkpoints reach the tests through
# EXL3_TEST_MODELS_DIR (this checkout's tests/fixtures/qwen3-tiny).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
requirements=$repo/ci/requirements-harness.txt
# Kept from the patched sdist: vLLM's tests/ and pytest configuration, and our op registrations
# (the CPU op tests read the ops' schemas from there).
KEEP=(tests pyproject.toml csrc/libtorch_stable/quantization/exl3)
TEST_LIST=.exl3-harness-tests

work=$(mktemp -d "${TMPDIR:-/tmp}/vllm-exl3-harness.XXXXXX")
trap 'rm -rf "$work"' EXIT
t0=$(date +%s)

# The patched tests tree at $1, built with the tool run by interpreter $2.
make_tree() {
  local dest=$1 tool_py=$2 sdist
  sdist=$("$tool_py" scripts/vllm-exl3 fetch | tail -1)
  cp -a "$sdist" "$work/sdist"
  rm -f "$work/sdist/.vllm-exl3-unpacked"
  "$tool_py" scripts/vllm-exl3 apply "$work/sdist" >/dev/null
  mkdir -p "$dest"
  for p in "${KEEP[@]}"; do
    mkdir -p "$dest/$(dirname "$p")"
    mv "$work/sdist/$p" "$dest/$p"
  done
  rm -rf "$work/sdist"
  (cd overlay && find tests -name 'test_*.py' | sort) > "$dest/$TEST_LIST"
  [ -s "$dest/$TEST_LIST" ] || { echo "test_vllm_harness: overlay/tests holds no tests" >&2; exit 1; }
}

# Lines "name==version" of ci/requirements-harness.txt that interpreter $1 does not have.
missing_requirements() {
  "$1" - "$requirements" <<'EOF'
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
EOF
}

if [ "${1:-}" = --pack ]; then
  out=${2:?"--pack needs an output path"}
  pyver=3.12  # the GPU host's Python
  if [ "${3:-}" = --python-version ]; then pyver=${4:?}; fi
  tool_py=${PYTHON:-python3}
  make_tree "$work/pack/tree" "$tool_py"
  # Binary wheels for the host's CPython (abi3/none wheels where that is what is published).
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
  requirements=$work/requirements-harness.txt
  missing=$(missing_requirements "$PY")
  if [ -n "$missing" ]; then
    wheels=()
    for spec in $missing; do
      name=${spec%%==*}
      wheels+=("$(ls "$work"/wheels/"${name//-/_}"-"${spec##*==}"-*.whl)")
    done
    "$PY" -m pip install -q --no-index --no-deps --target "$work/site" "${wheels[@]}"
    export PYTHONPATH="$work/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "test_vllm_harness: installed for this run:" $missing
  fi
else
  VENV=${VLLM_EXL3_VENV:-$HOME/.cache/vllm-exl3/venv}
  PY=$VENV/bin/python
  missing=$(missing_requirements "$PY")
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
