#!/usr/bin/env bash
# Builds the wheel and the sdist, installs the wheel (not editable) with the pinned stack into a fresh virtual
# environment, and from outside the source tree imports every module of the source tree and runs the quickstart
# and the command line for two rounds. A package, module, data file or config the wheel misses fails here.
#   bash scripts/check_wheel.sh          (about 2 minutes; .ci/run calls it)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON="${PYTHON:-python3}"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

echo "[wheel] python -m build (sdist and wheel)"
.venv/bin/python -m build -q -o "$WORK/dist" . >/dev/null
WHEEL=$(ls "$WORK"/dist/*.whl)
# the sdist must rebuild the same wheel contents
.venv/bin/python -m pip wheel -q --no-deps --disable-pip-version-check -w "$WORK/from_sdist" "$WORK"/dist/*.tar.gz
diff <(unzip -Z1 "$WHEEL" | sort) <(unzip -Z1 "$WORK"/from_sdist/*.whl | sort) \
  || { echo "[wheel] the sdist builds a different wheel"; exit 1; }

echo "[wheel] fresh venv: pip install -c constraints.txt $(basename "$WHEEL")"
"$PYTHON" -m venv "$WORK/venv"
# PyTorch's family (5.5 GB) is linked from .venv, not installed a second time: a third copy in CI has filled a
# machine's disk. Everything else the wheel asks for is installed here, from its own metadata and the pins.
.venv/bin/python scripts/share_torch.py "$WORK/venv"
set +e
"$WORK/venv/bin/python" -m pip install -q --no-cache-dir --disable-pip-version-check -c constraints.txt "$WHEEL" \
  2>&1 | grep -v "^WARNING: Location"
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
  echo "[wheel] pip install failed (exit $status); free disk:"
  df -h "$WORK"
  exit 1
fi

mkdir "$WORK/run" && cd "$WORK/run"
"$WORK/venv/bin/python" -I "$ROOT/scripts/check_wheel.py" "$ROOT"
echo "[wheel] quickstart, 2 rounds, from $WORK/run"
OMP_NUM_THREADS=1 "$WORK/venv/bin/python" -I "$ROOT/examples/quickstart.py" --rounds 2 --save-dir "$WORK/run/out" \
  | tail -n 1
echo "[wheel] lightning-fedhet fit --config configs/quickstart.yaml, 2 rounds"
OMP_NUM_THREADS=1 "$WORK/venv/bin/lightning-fedhet" fit --config "$ROOT/configs/quickstart.yaml" \
  --trainer.max_epochs=2 --trainer.check_val_every_n_epoch=1 --trainer.default_root_dir="$WORK/run/cli" \
  >"$WORK/cli.log" 2>&1 || { tail -n 40 "$WORK/cli.log"; exit 1; }
echo "[wheel] ok"
