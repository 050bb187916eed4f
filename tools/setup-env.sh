# Sourced by serve.sh and test.sh: make ./.venv with everything installed, once per pyproject change.
# Torch is pinned to the CPU wheel unless CUDA is present (a bare `torch` pulls a multi-GB CUDA build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.specloop-installed"
want="$(cat "$root/pyproject.toml" | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install -q torch
  else
    "$venv/bin/python" -m pip install -q "torch==2.13.0"
  fi
  "$venv/bin/python" -m pip install -q -e "$root[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
