#!/usr/bin/env bash
# Makes .venv-verl/: verl 0.9.1 with this package (the loss core and openrlhf_drpo.verl), without
# openrlhf. verl pins transformers < 5.11 and openrlhf 5.15.0, so the two never share an environment.
# The main test suite runs this venv's python on tests/verl_oracle.py (verl's own loss code as oracle).
# VERL_VENV chooses another place; PYTHON the interpreter it is made from.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VERL_VENV:-.venv-verl}
${PYTHON:-python3} -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q"
export PIP_ROOT_USER_ACTION=ignore
# torch first and pinned (an unpinned torch pulls a multi-GB CUDA build), then held by a constraint
$PIP torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
pin=$(mktemp); trap 'rm -f "$pin"' EXIT
# (the version from the metadata: importing torch before numpy is in would warn)
printf 'torch==%s\n' "$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("torch"))')" > "$pin"
$PIP -c "$pin" verl==0.9.1
# this package without openrlhf: the core needs torch, sympy, lark and numpy only
$PIP -c "$pin" -e '.[verl]'
