#!/usr/bin/env bash
# Runs specloop's test suite; sets up ./.venv on first use.
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup-env.sh
exec python -m pytest -q "$@"
