#!/usr/bin/env bash
# Serves the embedded default model over the OpenAI API on 127.0.0.1:8000; sets up ./.venv on first use.
set -euo pipefail
cd "$(dirname "$0")"
source tools/setup-env.sh
exec specloop serve "$@"
