#!/usr/bin/env bash
# Runs the test suite from a clean clone of the current commit several times in a row, the last run
# with another process burning one core (--load), to find flakes before CI does. Each run is a
# fresh `git clone` of HEAD (uncommitted changes are not in it) running `make test`, as CI does:
# the first with CI's fixed seed, the others with fresh ones (`make test SEED=fresh`); each prints
# its random seed, so a failure replays with `make test SEED=<seed>`.
#
#   scripts/stress-suite.sh [--runs N] [--load] [--fresh-venv] [--repeat-failed N] [--workdir DIR] [-- PYTEST ARGS...]
#
#   --runs N       runs in a row (default 2)
#   --load         the last run has a busy loop pinned to the last core beside it
#   --fresh-venv   let each clone's `make test` build its own .venv (as a new user would; slow):
#                  by default the repo's .venv is copied in and the clone installed into it
#   --repeat-failed N  after a run, run each test that failed alone N more times with the run's
#                  seed (a test's draws depend only on the run seed and its node id, so they are
#                  the same): failing N of N is a bug that replays; passing some is a flake (timing,
#                  load, order), whose logs stay beside the run's
#   -- ARGS        what the runs test instead of the whole suite (`make test TESTS="ARGS"`),
#                  e.g. `-- tests/launcher`
#
# Prints per run: seed, exit code, wall time, pytest's counts and failed tests; then every failure
# and the 15 slowest tests over all runs. Logs stay in the work directory (printed). Exits 1 if
# any run failed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
runs=2 load=0 fresh_venv=0 repeat=0 work="" tests=()
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs="$2"; shift 2 ;;
        --load) load=1; shift ;;
        --fresh-venv) fresh_venv=1; shift ;;
        --repeat-failed) repeat="$2"; shift 2 ;;
        --workdir) work="$2"; shift 2 ;;
        --) shift; tests=("$@"); break ;;
        *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
    esac
done
[[ "$runs" =~ ^[1-9][0-9]*$ ]] || { echo "--runs takes a positive integer, not '$runs'" >&2; exit 2; }
[[ "$repeat" =~ ^[0-9]+$ ]] || { echo "--repeat-failed takes a count, not '$repeat'" >&2; exit 2; }
work="${work:-$(mktemp -d /tmp/stress-suite.XXXXXX)}"
mkdir -p "$work"
commit="$(git -C "$repo" rev-parse HEAD)"
[ -z "$(git -C "$repo" status --porcelain --untracked-files=no)" ] ||
    echo "note: uncommitted changes in $repo are not tested (the clones are of $commit)" >&2

burner=""
stop_burner() {
    if [ -n "$burner" ]; then kill "$burner" 2>/dev/null || true; wait "$burner" 2>/dev/null || true; burner=""; fi
}
# Each run's `make test` leads its own process group (job control), so that stopping this script
# stops the run's pytest and its servers too: their command lines are relative to the clone, and a
# pytest left behind loads the next run (seen: a stopped run's suite ran on beside the next one).
set -m
run_group=""
stop_run() {
    if [ -n "$run_group" ]; then kill -TERM -- "-$run_group" 2>/dev/null || true; run_group=""; fi
}
trap 'stop_run; stop_burner' EXIT
trap 'exit 143' INT TERM HUP
start_burner() {  # a busy loop on the last core (pinned where taskset exists)
    local pin=()
    command -v taskset >/dev/null && pin=(taskset -c "$(($(nproc) - 1))")
    "${pin[@]}" bash -c 'while :; do :; done' &
    burner=$!
}

# Each test that failed in a run (its "FAILED <node id> - ..." line), alone, `repeat` more times
# with the run's seed and the same hypothesis profile ("ci", as `make test`), under the same load.
repeat_failures() {
    local clone="$1" log="$2" seed="$3" dir="$4" id k failed
    mkdir -p "$dir"
    sed -nE 's/^(FAILED|ERROR) (.+) - .*$/\2/p; s/^(FAILED|ERROR) ([^ ]+)$/\2/p' "$log" | sort -u |
    while IFS= read -r id; do
        failed=0
        for k in $(seq 1 "$repeat"); do
            if [ "$load" = 1 ] && [ "$i" = "$runs" ]; then start_burner; fi
            (cd "$clone" && .venv/bin/python -m pytest -q -rfE -p no:cacheprovider --hypothesis-profile=ci \
                --seed "$seed" "$id") </dev/null >"$dir/$(echo "$id" | tr -c 'A-Za-z0-9_.-' '_')-$k.log" 2>&1 ||
                failed=$((failed + 1))
            stop_burner
        done
        if [ "$failed" = "$repeat" ]; then verdict="a bug: fails every time with seed $seed"
        elif [ "$failed" = 0 ]; then verdict="a flake: passed every time alone (order, timing or load)"
        else verdict="a flake: failed $failed of $repeat alone"; fi
        echo "    replayed $repeat x: $id: $verdict"
    done
}

failed_runs=0
summary="$work/summary.txt"
: >"$summary"
for i in $(seq 1 "$runs"); do
    clone="$work/run-$i"
    log="$work/run-$i.log"
    rm -rf "$clone"
    git clone --quiet --no-hardlinks "$repo" "$clone"
    git -C "$clone" checkout --quiet "$commit"
    if [ "$fresh_venv" = 0 ] && [ -x "$repo/.venv/bin/python" ]; then
        # Hard links (5+ GB otherwise): pip and Python replace files, never write into them.
        cp -al "$repo/.venv" "$clone/.venv" 2>/dev/null || { rm -rf "$clone/.venv"; cp -a "$repo/.venv" "$clone/.venv"; }
        # The copy's editable install points at $repo: point it at the clone, then mark it built.
        (cd "$clone" && .venv/bin/python -m pip install -q --no-deps -e . >/dev/null 2>&1)
        touch "$clone/.venv/.installed"
    fi
    under=""
    if [ "$load" = 1 ] && [ "$i" = "$runs" ]; then start_burner; under=" (one core busy)"; fi
    echo "run $i/$runs$under: $clone, log $log" >&2
    begin=$SECONDS
    make_args=(test)
    # The first run draws as CI does (the Makefile's CI_SEED); the others draw fresh seeds.
    [ "$i" -gt 1 ] && make_args+=("SEED=fresh")
    [ ${#tests[@]} -gt 0 ] && make_args+=("TESTS=${tests[*]}")
    set +e
    (cd "$clone" && CI=true exec make "${make_args[@]}") </dev/null >"$log" 2>&1 &
    run_group=$!
    wait "$run_group"
    rc=$?
    run_group=""
    set -e
    stop_burner
    took=$((SECONDS - begin))
    seed="$(sed -nE 's/^random seed: ([0-9]+).*/\1/p' "$log" | head -n 1)"
    counts="$(grep -E '^(=+ )?[0-9]+ (passed|failed|error)' "$log" | tail -n 1 | sed -E 's/=//g; s/^ +| +$//g')"
    [ "$rc" = 0 ] || failed_runs=$((failed_runs + 1))
    {
        echo "run $i$under: exit $rc, ${took}s, seed ${seed:-?}: ${counts:-no pytest summary line}"
        grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/    /' || true
    } | tee -a "$summary"
    [ "$repeat" -gt 0 ] && [ -n "$seed" ] && repeat_failures "$clone" "$log" "$seed" "$work/run-$i-repeat" | tee -a "$summary"
done

echo
echo "== $runs runs of $commit, $failed_runs failed (logs: $work)"
echo "== slowest tests over all runs:"
for i in $(seq 1 "$runs"); do
    # pytest's --durations block: "12.34s call     tests/x.py::test_y"
    sed -nE "s/^([0-9]+\.[0-9]+)s (setup|call|teardown) +(.*)$/\1 \2 \3 (run $i)/p" "$work/run-$i.log"
done | sort -rn | head -n 15 | awk '{printf "    %8.2fs %-8s %s %s %s\n", $1, $2, $3, $4, $5}'
[ "$failed_runs" = 0 ]
