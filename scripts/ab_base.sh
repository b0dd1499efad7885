#!/usr/bin/env bash
# Makes DIR a copy of this repository's tree at REV with its own native library built in place
# (by this checkout's Python), for scripts/ab_trees.sh on a machine without git: carry DIR there.
#
#   bash scripts/ab_base.sh REV DIR        # e.g. bash scripts/ab_base.sh aabb1d7 .whl/base
set -euo pipefail
if [ $# -ne 2 ]; then sed -n '2,5p' "$0"; exit 2; fi
rev=$1; dir=$2
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-$PWD/.venv/bin/python}
rm -rf "$dir"
mkdir -p "$dir"
git archive "$rev" | tar -x -C "$dir"
(cd "$dir" && "$PYTHON" setup.py build_ext --inplace -q >/dev/null && rm -rf build)  # (carried: keep it small)
echo "$dir: tree $(git rev-parse --short "$rev"), library $(ls "$dir"/moe_ep/native/_native*.so)"
