#!/usr/bin/env bash
# CI for the Flower bridge (lightning_fedhet.flower, extra [flower]), called from .ci/run after the core suite.
#
# Flower cannot share the core environment (every flwr release needs protobuf < 7; constraints.txt pins 7.x),
# so this builds .venv-flower: the core stack of constraints.txt with the overrides and additions of
# constraints-flower.txt, then runs tests/flower there. A skipped test fails the run: in this environment
# nothing may skip for lack of flwr.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV=.venv-flower
if [ ! -x "$VENV/bin/python" ]; then
  echo "[flower] creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

# constraints.txt less every package that constraints-flower.txt names, then constraints-flower.txt.
# Package names compare case-insensitively with '-', '_' and '.' alike (PEP 503).
MERGED="$VENV/constraints-merged.txt"
norm() { sed -E 's/[[:space:]]*#.*$//; /^[[:space:]]*$/d' "$1"; }
key() { sed -E 's/[<>=!~ ].*$//' | tr 'A-Z_.' 'a-z--'; }
norm constraints-flower.txt | key | sort -u > "$VENV/.flower-names"
{
  norm constraints.txt | while IFS= read -r line; do
    if ! printf '%s\n' "$line" | key | grep -qxF -f "$VENV/.flower-names"; then printf '%s\n' "$line"; fi
  done
  norm constraints-flower.txt
} > "$MERGED.new"
mv "$MERGED.new" "$MERGED"

if ! "$VENV/bin/python" -c "import lightning_fedhet, flwr, ray, lightning" >/dev/null 2>&1 \
   || ! cmp -s "$MERGED" "$VENV/.constraints-installed"; then
  echo "[flower] pip install -c $MERGED -e .[dev,flower]"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$MERGED" -e ".[dev,flower]" 2>&1 \
    | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import lightning_fedhet, flwr, ray, lightning"
  cp "$MERGED" "$VENV/.constraints-installed"
fi
echo "[flower] ready: $("$VENV/bin/python" -c 'import flwr, torch, lightning, google.protobuf as pb; print("flwr", flwr.__version__, "torch", torch.__version__, "lightning", lightning.__version__, "protobuf", pb.__version__)')"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_MODE=offline
# Nothing leaves the machine: Flower's telemetry and update check, Ray's usage statistics.
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0

# 1. The bridge's tests (Flower's simulation runtime included) and its doctests. FEDHET_REQUIRE_FLOWER=1 makes a
#    missing flwr a failure; -rs lists every skip, and any skip fails the run.
LOG="$VENV/pytest-flower.log"
set +e
FEDHET_REQUIRE_FLOWER=1 "$VENV/bin/python" -m pytest tests/flower --doctest-modules lightning_fedhet/flower \
  -p no:cacheprovider -rs -q 2>&1 | tee "$LOG"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  echo "[flower] tests failed (exit $status)"
  exit "$status"
fi
if grep -qE "^SKIPPED|[0-9]+ skipped" "$LOG"; then
  echo "[flower] some Flower tests were skipped: in this environment every one must run"
  exit 1
fi

# 2. A real SuperLink on localhost with TLS and SuperNode authentication: a registered SuperNode comes online, one
#    whose key is not registered is refused (docs/flower.md, "Deploying for real").
echo "[flower] TLS and SuperNode authentication"
PATH="$PWD/$VENV/bin:$PATH" timeout 300 bash scripts/flower_auth_check.sh

# 3. The example app through Flower's own command (a local SuperLink in simulation mode, 4 nodes, 1 round).
#    FLWR_HOME is a fresh folder, so the SuperLink that `flwr run` starts (and leaves running) is ours to stop.
FLWR_HOME="$(mktemp -d)"
export FLWR_HOME
descendants() {  # the process ids below $1
  local child
  for child in $(pgrep -P "$1" || true); do echo "$child"; descendants "$child"; done
}
stop_superlink() {  # the SuperLink whose database is in our FLWR_HOME, and the processes it started
  local link pids=""
  for link in $(pgrep -f -- "--database $FLWR_HOME/" || true); do pids="$pids $link $(descendants "$link")"; done
  if [ -n "${pids// /}" ]; then
    kill $pids 2>/dev/null || true
    for _ in $(seq 20); do  # until every one has exited (at most 10 s)
      local alive=""
      for pid in $pids; do if kill -0 "$pid" 2>/dev/null; then alive=1; fi; done
      [ -z "$alive" ] && break
      sleep 0.5
    done
  fi
  rm -rf "$FLWR_HOME"
}
trap stop_superlink EXIT
echo "[flower] flwr run examples/flower_app"
set +e
PATH="$PWD/$VENV/bin:$PATH" timeout 600 flwr run examples/flower_app --stream \
  --federation-config "num-supernodes=4" \
  --run-config "num-clients=4 num-server-rounds=1 samples-per-client=64 local-steps=2 eval-samples=500" \
  2>&1 | tee "$VENV/flwr-run.log"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ] || ! grep -q "^round 0: " "$VENV/flwr-run.log"; then
  echo "[flower] the example app did not finish its round (exit $status)"
  exit 1
fi
echo "[flower] ok"
