#!/usr/bin/env bash
# Set up .venv (first run only) and run the NanGuard demo: a small image classifier whose
# cosine-normalised convolution turns NaN on blank images, guarded through configs/nanguard.yaml.
# Extra arguments are passed to the LightningCLI, e.g. `bash scripts/demo.sh --trainer.max_epochs=2`.
source "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
python examples/cosine_norm_demo.py fit --config configs/demo.yaml --config configs/nanguard.yaml "$@"
