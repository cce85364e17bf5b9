#!/usr/bin/env bash
# Create (or reuse) .venv and install titan_commopt with its pinned stack. Idempotent.
# torch==2.13.0 goes in first: on our CPU machines pip takes the local CPU wheel; an open-ended
# "torch" requirement on a fresh venv would pull a multi-GB CUDA build instead.
# GPU users: install your own CUDA/ROCm torch 2.13 into the venv first (or set TORCH_SPEC).
# Variables: VENV (default .venv: the venv to create or reuse, e.g. one on a filesystem every node
# sees), PYTHON (default python3.11, else python3: the interpreter that makes it), TORCH_SPEC
# (default torch==2.13.0: pip's arguments for torch, used only when the venv has no torch yet),
# TORCHTITAN (default 0.2.2: the torchtitan release to install, 0.2.2 or 0.3.0; one line per venv), e.g.
#   VENV=/shared/venvs/commopt TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>" bash scripts/setup.sh
#   TORCHTITAN=0.3.0 VENV=.venv-tt03 bash scripts/setup.sh     # torchtitan 0.3 in a venv of its own
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VENV="${VENV:-.venv}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# pip, minus this machine's noise about missing local index folders; pip's own exit status is kept.
pip_install() {
  "$VENV/bin/python" -m pip --disable-pip-version-check -q install "$@" 2>&1 \
    | { grep -v "Location 'file://.*' is ignored" || true; }
}
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  pip_install ${TORCH_SPEC:-torch==2.13.0}
fi
TORCHTITAN="${TORCHTITAN:-0.2.2}"
case "$TORCHTITAN" in
  0.2.2|0.3.*) ;;
  *) echo "scripts/setup.sh: TORCHTITAN=$TORCHTITAN: supported are 0.2.2 and 0.3.x (e.g. 0.3.0)" >&2; exit 2 ;;
esac
# The line goes in before the package, whose requirement (torchtitan>=0.2.2,<0.4) accepts both.
pip_install "torchtitan==$TORCHTITAN"
pip_install -e ".[dev,bench]"
# torchtitan imports (needs triton on CPU); the bundled corpus and the tokenizer the installed line
# reads built once and cached: 0.2.2's SentencePiece model, or 0.3's HuggingFace BPE (with the corpus
# as the JSON dataset its config module reads).
case "$TORCHTITAN" in
  0.2.2) BUILD="from titan_commopt.titan.tt022.tokenizer import bundled_tokenizer_path; bundled_tokenizer_path()" ;;
  *) BUILD="from titan_commopt.titan.tt03.assets import dataset_dir, tokenizer_dir; tokenizer_dir(); dataset_dir()" ;;
esac
"$VENV/bin/python" -c "import titan_commopt.titan; $BUILD"
