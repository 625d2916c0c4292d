#!/usr/bin/env bash
# Installs everything lightning-fedhet needs into ./.venv (idempotent):
#   - Debian's offline Fashion-MNIST (dataset-fashion-mnist) when apt-get is available,
#   - the Python stack pinned in constraints.txt and this package (editable, with dev extras).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi
  echo "[install] apt-get install dataset-fashion-mnist"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null \
    || echo "[install] could not install dataset-fashion-mnist; the Fashion-MNIST examples will need --data-dir"
fi

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[install] creating .venv"
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import lightning_fedhet, torchvision, lightning" >/dev/null 2>&1 \
   || ! cmp -s constraints.txt .venv/.constraints-installed; then
  echo "[install] pip install -c constraints.txt -e .[dev,docs] (torch + torchvision take about 2 minutes)"
  .venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev,docs]" 2>&1 \
    | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import lightning_fedhet, torchvision, lightning"
  cp constraints.txt .venv/.constraints-installed
fi
echo "[install] ready: $(.venv/bin/python -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__)')"
