#!/usr/bin/env bash
# Several session scripts in one device call: a machine's start costs a minute or more of the
# session's device time, and a call brings back at most 8 files. Each step runs with its own
# time limit and its own OUT folder ($OUT/<n>-<first word of its script>), so one step that hangs
# or fails leaves the others' results; at the end everything is packed into $OUT/batch.tgz and
# each step's exit code and seconds are printed.
#
#   bash bench/batch_session.sh LIMIT_S 'ENV=... bash bench/x_session.sh ARGS' [LIMIT_S 'CMD' ...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
repo=$PWD
step=0
summary=()
while [ $# -ge 2 ]; do
    limit=$1 cmd=$2
    shift 2
    step=$((step + 1))
    name=$(echo "$cmd" | grep -o 'bench/[a-z_0-9]*' | head -1 | sed 's#bench/##')
    dir="$OUT/$step-${name:-step}"
    mkdir -p "$dir"
    start=$(date +%s)
    (cd "$repo" && OUT="$dir" timeout --kill-after=10 "$limit" bash -c "$cmd") >"$dir/console.log" 2>&1
    rc=$?
    summary+=("step $step (${name:-step}): rc=$rc, $(( $(date +%s) - start )) s of $limit")
    tail -n 25 "$dir/console.log"
done
[ $# -eq 0 ] || echo "batch_session: ignored a trailing argument without a command: $1"
(cd "$OUT" && tar czf batch.tgz --remove-files -- */ 2>/dev/null)
printf '%s\n' "${summary[@]}"
