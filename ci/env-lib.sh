# SPDX-License-Identifier: Apache-2.0
# The steps the two pinned CPU environments share (ci/setup-env.sh for vLLM 0.26,
# ci/setup-env-upstream.sh for the upstream series): the interpreter, one builder per
# environment, the release wheels in the shared cache. Sourced by them after they set NAME (for
# messages), VENV, WHEELS and P (the venv's pip, for release_wheel). An environment's path is keyed
# by its own script's hash alone: these steps decide how it is built, not what it holds.

# $VLLM_EXL3_PYTHON, else the first of python3.11-3.13 on PATH: 3.11 is the oldest the tool
# takes and the one vLLM 0.34's mypy hook checks for; both torch releases publish wheels to 3.13.
env_python() {
  local py=${VLLM_EXL3_PYTHON:-} candidate
  if [ -z "$py" ]; then
    for candidate in python3.11 python3.12 python3.13; do
      if command -v "$candidate" >/dev/null; then py=$candidate; break; fi
    done
  fi
  [ -n "$py" ] || { echo "$NAME: no python3.11-3.13 found (set VLLM_EXL3_PYTHON)" >&2; return 1; }
  echo "$py"
}

# Exits the script when VENV is complete (MARKER exists); else holds VENV's lock for the rest
# of the script: a second builder of the same environment waits here, then finds the marker.
env_reuse_or_lock() {
  local marker=$1
  [ -f "$marker" ] && { echo "$NAME: reusing $VENV"; exit 0; }
  mkdir -p "$(dirname "$VENV")" "$WHEELS"
  exec 9>"$VENV.lock"
  flock 9
  [ -f "$marker" ] && { echo "$NAME: reusing $VENV"; exit 0; }
  return 0
}

# Prints the path of the release wheel PROJECT==VERSION in WHEELS matching GLOB, downloading it
# once (SIZE: what the message tells the wait).
release_wheel() {
  local project=$1 version=$2 glob=$3 size=$4 whl
  whl=$(ls "$WHEELS"/$glob 2>/dev/null | head -1 || true)
  if [ -z "$whl" ]; then
    echo "$NAME: downloading $project $version ($size)" >&2
    "$P" download -q --no-deps "$project==$version" -d "$WHEELS" >&2
    whl=$(ls "$WHEELS"/$glob | head -1)
  fi
  echo "$whl"
}
