#!/usr/bin/env bash
# Runs the tests that kill, wait for or time other threads and processes ROUNDS times (default
# 5) next to two busy CPU processes, to show that none of them depends on how fast the machine
# is. Prints one line per round (pytest's summary) and then "stress: passed P of N rounds";
# exits non-zero unless every round passed. A failed round's full log is kept (path printed).
#
# Usage: tools/stress_tests.sh [ROUNDS]   (from any directory; uses .venv when one exists and
# no virtual environment is active)
set -euo pipefail
cd "$(dirname "$0")/.."

rounds="${1:-5}"
if ! [[ "$rounds" =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 [ROUNDS >= 1]" >&2
  exit 2
fi
if [[ -z "${VIRTUAL_ENV:-}" && -f .venv/bin/activate ]]; then
  # shellcheck source=/dev/null
  . .venv/bin/activate
fi

# The files, and the keyword expression that picks their tests (a file's name selects all of
# its tests):
#   test_crash_kill.py   SIGKILL at named points and at moments chosen by events, then resume
#   test_split.py        actor–learner split: the generator thread, weight swaps, two processes
#   test_multiprocess.py two JAX processes on the distributed runtime, checkpoint and restore
#   test_train_modes.py  async: generator thread, rate limiter, failures on either side, a stall
#   test_train_loop.py   the async generator blocked by the limiter; a hanging scorer thread
#   test_math_reward.py  scoring worker processes killed, hanging, timed out, replaced
#   test_controller_mu.py the controller's decisions on a machine made slow (and its timers)
tests=(
  tests/test_crash_kill.py
  tests/test_split.py
  tests/test_multiprocess.py
  tests/test_train_modes.py
  tests/test_train_loop.py
  tests/test_math_reward.py
  tests/test_controller_mu.py
)
keywords="test_crash_kill or test_split or test_multiprocess or async or hanging or worker or timeout or loaded_machine"

busy=()
stop_busy() {
  if ((${#busy[@]})); then
    kill "${busy[@]}" 2>/dev/null || true
  fi
}
trap stop_busy EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in 1 2; do
  python -c 'while True: pass' &
  busy+=("$!")
done

logs="$(mktemp -d "${TMPDIR:-/tmp}/stress_tests.XXXXXX")"
passed=0
for ((i = 1; i <= rounds; i++)); do
  log="$logs/round_$i.log"
  if python -m pytest "${tests[@]}" -k "$keywords" -p no:cacheprovider >"$log" 2>&1; then
    ok=1
  else
    ok=0
  fi
  summary="$(grep -E '[0-9]+ (passed|failed|errors?|skipped|deselected)' "$log" | tail -n 1)"
  echo "round $i/$rounds: ${summary:-no pytest summary}"
  if ((ok)); then
    passed=$((passed + 1))
    rm -f "$log"
  else
    grep -E '^(FAILED|ERROR) ' "$log" | sed 's/^/  /' || true
    echo "  log: $log"
  fi
done
echo "stress: passed $passed of $rounds rounds"
((passed == rounds))
