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
