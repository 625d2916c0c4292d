#!/usr/bin/env bash
# CI: the property tests (every tests/ file with a Hypothesis @given) in reverse and in a shuffled order, files and
# the tests inside them mixed (tests/conftest.py's FEDHET_TEST_ORDER). Their examples are derandomized and must not
# depend on what ran before them: a draw that changes with the order (e.g. Hypothesis's pool of literals from the
# modules imported so far, emptied in tests/conftest.py) fails here rather than in somebody's subset of the suite.
# Each order is about 35 s of one core; the two run side by side (FEDHET_ORDER_SERIAL=1: one after the other, on a
# shared machine). FEDHET_ORDER_SEED picks another shuffle.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
mapfile -t FILES < <(grep -rl --include='test_*.py' -e '@given' tests | sort)
LOGS="$(mktemp -d)"
trap 'rm -rf "$LOGS"' EXIT

run() {  # run ORDER: the property files in that order, quiet; the log is printed when it fails
  local log="$LOGS/${1//:/-}.log"
  if WANDB_MODE=offline OMP_NUM_THREADS=1 FEDHET_TEST_ORDER="$1" \
      "$PY" -m pytest -q -x -p no:cacheprovider -p no:randomly "${FILES[@]}" >"$log" 2>&1; then
    echo "[property-order] $1: $(tail -n 1 "$log")"
  else
    cat "$log"; echo "[property-order] $1 FAILED"; return 1
  fi
}

ORDERS=(reverse "shuffle:${FEDHET_ORDER_SEED:-0}")
echo "[property-order] ${#FILES[@]} files: ${FILES[*]}"
if [ -n "${FEDHET_ORDER_SERIAL:-}" ]; then
  for order in "${ORDERS[@]}"; do run "$order"; done
else
  pids=()
  for order in "${ORDERS[@]}"; do run "$order" & pids+=($!); done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  exit "$status"
fi
