#!/usr/bin/env bash
# Create .venv-spec: a CPU-only environment with the vLLM `speculators` package (0.9.0) for the EAGLE-3
# export round-trip test (tests/test_export.py). Separate from .venv because speculators pins
# transformers <= 5.19; installed --no-deps because its unpinned torchvision/torchaudio requirements
# would pull a CUDA torch (~6 GB) that it never imports.  Usage: bash scripts/make_speculators_venv.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-spec}
python3 -m venv "$DIR"
"$DIR/bin/pip" install -q torch==2.13.0
"$DIR/bin/pip" install -q --no-deps speculators==0.9.0
"$DIR/bin/pip" install -q aiohttp click "datasets<=5.1.0" httpx huggingface-hub loguru numpy openai protobuf psutil \
  pydantic pydantic-settings rich safetensors tqdm "transformers>=5.0,<=5.19" typer hs-connectors==0.9.0
HF_HUB_OFFLINE=1 "$DIR/bin/python" -c "import speculators.models.eagle3, transformers; print('speculators ok, transformers', transformers.__version__)"
