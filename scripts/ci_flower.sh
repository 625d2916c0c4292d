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
  # PyTorch's family (5.5 GB) is linked from .venv, whose pins are the same, not installed a second time
  .venv/bin/python scripts/share_torch.py "$VENV"
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

READY='import lightning_fedhet, flwr, ray, lightning, torch, google.protobuf as pb
print("flwr", flwr.__version__, "torch", torch.__version__, "lightning", lightning.__version__, "protobuf", pb.__version__)'
if ! cmp -s "$MERGED" "$VENV/.constraints-installed" || ! VERSIONS="$("$VENV/bin/python" -c "$READY" 2>/dev/null)"; then
  echo "[flower] pip install -c $MERGED -e .[dev,flower]"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$MERGED" -e ".[dev,flower]" 2>&1 \
    | grep -v "^WARNING: Location" || true
  VERSIONS="$("$VENV/bin/python" -c "$READY")"  # fails the script when an import still fails
  cp "$MERGED" "$VENV/.constraints-installed"
fi
echo "[flower] ready: $VERSIONS"  # one interpreter start less than checking and printing apart

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" WANDB_MODE=offline
# Nothing leaves the machine: Flower's telemetry and update check, Ray's usage statistics.
export FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 RAY_USAGE_STATS_ENABLED=0

run_tests() {  # run_tests LOG PYTEST-ARGS...: pytest in $VENV; fails on a failure or on any skip
  local log="$1" status
  shift
  set +e
  FEDHET_REQUIRE_FLOWER=1 "$VENV/bin/python" -m pytest "$@" -p no:cacheprovider -rs -q 2>&1 | tee "$log"
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    echo "[flower] tests failed (exit $status)"
    exit "$status"
  fi
  if grep -qE "^SKIPPED|[0-9]+ skipped" "$log"; then
    echo "[flower] some Flower tests were skipped: in this environment every one must run"
    exit 1
  fi
}
SECONDS=0

# 1. In the background, while the tests run (it mostly waits on its processes): a real SuperLink on localhost with
#    TLS and SuperNode authentication, where a registered SuperNode comes online and one whose key is not
#    registered is refused (docs/flower.md, "Deploying for real"). Its log is printed when it ends; the EXIT trap
#    waits for it, so that it always stops its own processes before this script ends.
AUTH_LOG="$VENV/auth-check.log"
rm -f "$AUTH_LOG" "$AUTH_LOG.status"
( set +e; PATH="$PWD/$VENV/bin:$PATH" timeout 300 bash scripts/flower_auth_check.sh > "$AUTH_LOG" 2>&1
  echo $? > "$AUTH_LOG.status" ) &
AUTH=$!
trap 'wait "$AUTH" 2>/dev/null || true' EXIT

# 2. The bridge's tests (Flower's simulation runtime included) and its doctests, with the deployment tests
#    (FEDHET_FLOWER_DEPLOY=1, tests/flower/test_deployment.py): the example app on a SuperLink over TLS with
#    certificates made for the test and two SuperNodes, `flwr run examples/flower_app` against it; a clean run
#    equals the in-process simulation, a SuperNode killed mid-round is a lost upload and rejoins under a new node id
#    as its client, a ServerApp killed between rounds resumes from its checkpoint to the uninterrupted model. Every
#    process they start is killed by id when they end (tests/flower/deployment.py). FEDHET_REQUIRE_FLOWER=1 makes a
#    missing flwr a failure; -rs lists every skip, and any skip fails the run.
REPORT="$PWD/$VENV/deploy-report.txt"
rm -f "$REPORT"
echo "[flower] tests/flower (the deployment tests included: several minutes)"
FEDHET_FLOWER_DEPLOY=1 FEDHET_DEPLOY_REPORT="$REPORT" run_tests "$VENV/pytest-flower.log" tests/flower \
  --doctest-modules lightning_fedhet/flower
echo "[flower] what the deployment tests measured:"
cat "$REPORT"
echo "[flower] tests: ${SECONDS} s"

wait "$AUTH" || true
echo "[flower] TLS and SuperNode authentication (scripts/flower_auth_check.sh):"
cat "$AUTH_LOG"
if [ "$(cat "$AUTH_LOG.status" 2>/dev/null)" != "0" ]; then
  echo "[flower] the authentication check failed (exit $(cat "$AUTH_LOG.status" 2>/dev/null || echo '?'))"
  exit 1
fi
echo "[flower] ok (${SECONDS} s)"
