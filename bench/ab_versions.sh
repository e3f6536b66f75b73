#!/usr/bin/env bash
# Before/after a refactor: `councild bench serial` in a checkout of REV and in this tree,
# alternating (before, after, before, after), each writing its JSON to OUT_DIR.
# Usage: bench/ab_versions.sh REV OUT_DIR [ROUNDS_PER_RUN]
# The old tree runs with this tree's .venv (same mlx, mlx-lm); its own code comes first on
# the path because the bench runs from inside it.
set -euo pipefail
rev=$1 out=$2 rounds=${3:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
old=$(mktemp -d)/before
git -C "$here" worktree add -q --detach "$old" "$rev"
trap 'git -C "$here" worktree remove --force "$old"' EXIT
mkdir -p "$out"
for r in 1 2; do
  for side in before after; do
    dir=$here; [ "$side" = before ] && dir=$old
    (cd "$dir" && PYTHONPATH="$dir" "$here/.venv/bin/python" -m daemon.cli bench serial --rounds "$rounds" \
        --tokens 64 --json "$out/serial_${side}_$r.json")
  done
done
