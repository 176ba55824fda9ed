#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Copies the MoE fixture conversions that the GPU end-to-end run needs (run_moe_e2e.py
# --moe-dir DEST) out of the shared fixture set into DEST, small enough to carry to the GPU host:
# the EXL3 conversions whole (weights, config.json, quantization_config.json, tokenizer and
# generation files), ExLlamaV3's perplexity records, and SHA256SUMS of every copied file, which
# the runner checks on the host. The bf16 originals (18 MB each) only with --with-bf16.
#
#   scripts/e2e/stage_fixtures.sh [--with-bf16] DEST [FIXTURES]
#
# FIXTURES defaults to $FIXTURES, else ../shared/fixtures next to the repository root.
set -euo pipefail

usage() { echo "usage: $0 [--with-bf16] DEST [FIXTURES]" >&2; exit 2; }

with_bf16=0
args=()
for a in "$@"; do
  case "$a" in
    --with-bf16) with_bf16=1 ;;
    -h|--help) usage ;;
    -*) echo "$0: unknown option $a" >&2; usage ;;
    *) args+=("$a") ;;
  esac
done
[ "${#args[@]}" -ge 1 ] && [ "${#args[@]}" -le 2 ] || usage
dest=${args[0]}
repo=$(cd "$(dirname "$0")/../.." && pwd)
src=${args[1]:-${FIXTURES:-$repo/../shared/fixtures}}

# model/conversion directories and the perplexity records, relative to FIXTURES
conversions=(qwen3moe-e16-tiny/exl3-3.0bpw-mcg qwen3moe-e16-tiny/exl3-5.0bpw-mul1
             dsv3-tiny/exl3-4.0bpw-mcg)
originals=(qwen3moe-e16-tiny/bf16 dsv3-tiny/bf16)
records=(logs/ppl_exllamav3_moe_e16.json logs/ppl_exllamav3_dsv3.json)

dirs=("${conversions[@]}")
[ "$with_bf16" = 1 ] && dirs+=("${originals[@]}")
for d in "${dirs[@]}"; do
  [ -f "$src/$d/config.json" ] || { echo "$0: $src/$d: no config.json (not the fixture set?)" >&2; exit 1; }
done
for r in "${records[@]}"; do
  [ -f "$src/$r" ] || { echo "$0: $src/$r missing" >&2; exit 1; }
done

mkdir -p "$dest"
for d in "${dirs[@]}"; do
  rm -rf "${dest:?}/$d"
  mkdir -p "$dest/$d"
  # Regular files only: a checkpoint directory holds no subdirectories worth carrying.
  find "$src/$d" -maxdepth 1 -type f -exec cp {} "$dest/$d/" \;
  chmod -R u+w "$dest/$d"
done
for r in "${records[@]}"; do
  cp "$src/$r" "$dest/"
  chmod u+w "$dest/$(basename "$r")"
done
(cd "$dest" && find . -type f ! -name SHA256SUMS | sed 's|^\./||' | LC_ALL=C sort \
   | xargs sha256sum > SHA256SUMS)
echo "staged into $dest: ${dirs[*]}"
du -sh "$dest"
