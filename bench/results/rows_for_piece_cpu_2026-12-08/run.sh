#!/usr/bin/env bash
# rows_for_piece A/B on this CPU: HEAD (after) against a480fe1~1 (before), prompts together forced on, fast mode.
extra=$'[scheduler]\nprefill_together = "on"'
for pair in ${PAIRS:-1 2}; do
  for tree in after before; do
    dir=/work/main; [ $tree = before ] && dir=/tmp/wt_before
    (cd $dir && PYTHONPATH=$dir .venv/bin/python bench/council_http.py --seats 4 --turns 3 --system-tokens 1000 --max-tokens 32 \
      --rounds 2 --arms fast --config-extra "$extra" --json /tmp/ab/$tree-$pair.json --markdown /tmp/ab/$tree-$pair.md \
      --logs /tmp/ab/logs-$tree-$pair > /tmp/ab/$tree-$pair.log 2>&1)
    echo "$tree $pair rc $? $(date +%T)"
  done
done
