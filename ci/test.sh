#!/usr/bin/env bash
# The project's test command (README; .ci/run calls it): sets up the pinned CPU environment
# (cached after the first run), applies our series onto the venv's installed vLLM 0.26.0, and runs
# the test suite. GPU tests are marked `gpu` and skip themselves without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup-env.sh
VENV=$(bash ci/setup-env.sh --path)
PY="$VENV/bin/python"
# The linters first (ruff, ruff format, clang-format, SPDX headers, generated sources): a
# finding fails the command, after the tests have run.
set +e
bash ci/lint.sh
lint_rc=$?
set -e
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Re-apply the current series onto the installed vLLM (reverting an earlier application first),
# so the tests exercise exactly what the patches and overlay produce.
"$PY" scripts/vllm-exl3 apply --replace "$site"
# The tool's package (with vllm_exl3.testing, .bench and .e2e), editable, pointing at this
# checkout: the tests of both trees import it by name. Strict mode links the files on an
# import path entry, so a copy of scripts/ on PYTHONPATH (as the build tests make) wins
# whole, where the lenient mode's import hook would fill in its missing modules.
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  --config-settings editable_mode=strict 2>/dev/null ||
  "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . \
    --config-settings editable_mode=strict
set +e
# On a plain run (no pytest arguments, as CI calls it): our kernels compiled by vLLM's own
# CMake as objects of its _C_stable_libtorch target and checked (flags, architectures, symbols;
# its own script, so it also runs alone). Before the tests, so that their summary ends the log.
cmake_rc=0
if [ $# -eq 0 ]; then
  bash ci/compile_in_vllm_target.sh
  cmake_rc=$?
fi
# The tool's own tests (tests/), then vLLM's own harness on every test of vLLM's code paths
# (overlay/tests/) on a plain run. The harness is its own script, so it also runs alone.
"$PY" -m pytest -q -ra tests "$@"
rc=$?
if [ $# -eq 0 ]; then
  VLLM_EXL3_VENV=$VENV bash ci/test_vllm_harness.sh
  harness_rc=$?
  [ "$rc" -ne 0 ] || rc=$harness_rc
fi
set -e
[ "$rc" -ne 0 ] || rc=$cmake_rc
[ "$rc" -ne 0 ] || rc=$lint_rc
# pytest's 5 means "no tests collected": that is a failure of this command, not a pass.
exit $rc
