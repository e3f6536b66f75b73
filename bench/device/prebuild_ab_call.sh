#!/usr/bin/env bash
# One device call (after staging): fresh starts (an empty PTX folder, no user cache) of this tree
# against the same tree with OLD's prebuild files (engine/jit/prebuild.py, prebuild_recipes.py,
# engine_thread/prebuild_start.py), alternated by pair, PAIRS pairs (issue 46).
#   git show REV:daemon/engine/jit/prebuild.py > old_prebuild/prebuild.py   (likewise the other two)
#   OLD=old_prebuild PAIRS=3 bash bench/device/prebuild_ab_call.sh          (results in $OUT/pab.tgz)
export PYTHONUNBUFFERED=1
o=${OUT:-/tmp/out}/pab
old=/tmp/old-tree
mkdir -p "$o"; rm -rf "$old"; cp -r "$PWD" "$old"
cp "${OLD:-old_prebuild}"/prebuild.py "${OLD:-old_prebuild}"/prebuild_recipes.py "$old/daemon/engine/jit/"
cp "${OLD:-old_prebuild}"/prebuild_start.py "$old/daemon/engine_thread/"
start() {  # name tree
  # As a fresh machine: no probe verdicts (the user's cache folder, shared by every daemon of an
  # install: the harness links each start's verdicts there), no driver JIT cache.
  local uc=$(cd "$2" && env -u COUNCILD_CACHE_DIR PYTHONPATH=/tmp/site:$2 python3 -c 'from daemon.paths import cache_dir; print(cache_dir())')
  rm -rf "$uc" ~/.nv/ComputeCache
  local s=$(date +%s)
  (cd "$2" && PYTHONPATH=/tmp/site:$2 timeout 150 python3 bench/start_timeline.py --fresh-only --ptx "/tmp/ptx-$1" \
    --json "$o/$1.json" > "$o/$1.log" 2>&1)
  echo "$1 rc $? ($(( $(date +%s) - s )) s, user cache $uc): $(grep -E '^compiling' "$o/$1.log")"
}
for pair in $(seq 1 ${PAIRS:-3}); do
  if [ $((pair % 2)) = 1 ]; then start "old_$pair" "$old"; start "new_$pair" "$PWD"
  else start "new_$pair" "$PWD"; start "old_$pair" "$old"; fi
done
python3 - "$o" <<'PY'
import json, statistics, sys
from pathlib import Path
rows = {}
for f in sorted(Path(sys.argv[1]).glob("*_*.json")):
    arm = f.stem.split("_")[0]
    run = json.loads(f.read_text())["runs"][0]
    rows.setdefault(arm, []).append((run["ready_s"], (run.get("prebuild") or {}).get("waited_s"), run["first_requests_s"]))
for arm, rs in rows.items():
    print(f"{arm}: ready {statistics.median(r[0] for r in rs):.1f} s ({', '.join(f'{r[0]:.1f}' for r in rs)}); "
          f"prebuild waited {', '.join(str(r[1]) for r in rs)} s; first requests {[r[2] for r in rs]}")
PY
tar czf "$o.tgz" -C "$(dirname "$o")" "$(basename "$o")" && rm -rf "$o"
