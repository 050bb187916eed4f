#!/usr/bin/env bash
# Runs specloop's test suite; sets up ./.venv on first use.
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup-env.sh
# -P: the checkout's root is the specloop package, so its subpackages must not become top-level
# modules (its `kernels` would hide the PyPI package of that name, which transformers probes for).
exec python -P -m pytest -q "$@"
