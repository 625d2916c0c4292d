#!/usr/bin/env bash
# Build the documentation site with warnings as errors: `bash scripts/build_docs.sh [SITE_DIR]`.
#
# Runs `mkdocs build --strict` from the repository root into SITE_DIR (default `site/`, git-ignored) with the
# mkdocs of `.venv` (installed by `pip install -e ".[docs]"`), or of the active environment when there is no
# `.venv`. Exits non-zero on any warning: a broken link or anchor, a page missing from the nav, a docstring
# mkdocstrings cannot parse. Nothing is fetched: MathJax is loaded by the reader's browser, not by the build.
set -euo pipefail
cd "$(dirname "$0")/.."
site_dir="${1:-site}"
if [ -x .venv/bin/mkdocs ]; then mkdocs=.venv/bin/mkdocs; else mkdocs=mkdocs; fi
export NO_MKDOCS_2_WARNING=1  # mkdocs-material's banner about its successor, printed on every build
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
start=$(date +%s)
"$mkdocs" build --strict --clean --site-dir "$site_dir"
echo "docs built into $site_dir/ in $(( $(date +%s) - start )) s"
