#!/usr/bin/env bash
# Download, HERE (where PyPI is reachable), the wheels that an offline CUDA box lacks, into wheels/
# (git-ignored), for tools/gpu_check.sh to install there with --no-index.
#
#   tools/fetch_gpu_wheels.sh            # -> wheels/*.whl (+ wheels/fallback/), prints the list and total size
#
# The target box: python 3.12, x86_64, torch 2.11 + CUDA 13, triton, transformers, pyyaml, tqdm,
# pyarrow, safetensors, tokenizers, numpy, sympy, packaging, pytest (its image), no megatron-core, no
# math-verify, no pebble, no network. Each package is fetched with --no-deps (so torch or a CUDA stack is
# never pulled) at the version constraints.txt pins; the dependencies that the box lacks are named
# explicitly below (read off each wheel's Requires-Dist):
#   megatron-core          -> torch, numpy, packaging>=24.2 (on the box); a cp312 platform wheel (it
#                             ships a compiled helper for Megatron's datasets, which we do not use)
#   math-verify            -> latex2sympy2_extended (==1.11.0)
#   latex2sympy2_extended  -> sympy (on the box), antlr4-python3-runtime (>=4.9.3,<=4.13.2)
#   pebble                 -> none
# wheels/fallback/ holds transformers at our pin (pure python), installed by gpu_check.sh only when
# the box's transformers is older than the oldest version the CPU dry run was checked with.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY=python3
DEST="${WHEELS_DIR:-$ROOT/wheels}"

pin() {  # the version constraints.txt pins for a package (names compared case-insensitively, - == _)
  local want
  want="$(echo "$1" | tr 'A-Z_' 'a-z-')"
  awk -F'==' -v w="$want" '!/^#/ && NF == 2 { n = tolower($1); gsub("_", "-", n); if (n == w) print $2 }' constraints.txt
}

REQUIRED=(megatron-core math-verify latex2sympy2_extended antlr4-python3-runtime pebble)
FALLBACK=(transformers)

download() {  # dir pkg...
  local dir="$1"; shift
  local specs=() p v
  for p in "$@"; do
    v="$(pin "$p")"
    [[ -n "$v" ]] || { echo "[fetch] error: $p is not pinned in constraints.txt" >&2; exit 1; }
    specs+=("$p==$v")
  done
  mkdir -p "$dir"
  echo "[fetch] ${specs[*]} -> $dir" >&2
  # manylinux_2_28 / 2_24 too: megatron-core 0.16.1's wheel is tagged manylinux_2_24 / manylinux_2_28
  # (the box's torch 2.11 wheel is manylinux_2_28 itself, so its glibc is new enough).
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d "$dir" "${specs[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
}

download "$DEST" "${REQUIRED[@]}"
download "$DEST/fallback" "${FALLBACK[@]}"

# one version of each package only (an older download left beside a newer one would stop the install)
dups="$(cd "$DEST" && ls *.whl fallback/*.whl | sed -E 's#^fallback/##; s/-[0-9][^-]*-.*//' | tr 'A-Z_' 'a-z-' | sort | uniq -d)"
if [[ -n "$dups" ]]; then
  echo "[fetch] error: more than one wheel of: $dups (remove the stale ones from $DEST)" >&2
  exit 1
fi

echo "[fetch] wheels in $DEST:"
(cd "$DEST" && ls -l *.whl fallback/*.whl | awk '{ printf "  %8.1f KiB  %s\n", $5 / 1024, $NF }')
total="$(du -cb "$DEST"/*.whl "$DEST"/fallback/*.whl | tail -1 | cut -f1)"
echo "[fetch] total $(awk -v b="$total" 'BEGIN { printf "%.1f MiB", b / 1048576 }') (keep under 40 MiB: it travels with the checkout)"
if (( total > 40 * 1048576 )); then
  echo "[fetch] error: over 40 MiB" >&2
  exit 1
fi
