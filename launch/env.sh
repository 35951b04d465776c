# Sourced by the README's two commands: create or reuse the project venv.
# Reinstalls only when pyproject.toml, or the checkout the venv's editable
# install points at, changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${COMMSLAYER_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
STAMP="$VENV/.commslayer-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) $ROOT"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[dev]"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# torch warns at import when NumPy is absent; we do not depend on NumPy.
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore:Failed to initialize NumPy}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# The direct path in native code (commslayer/comm/native.py): built once per source and torch;
# where it cannot be built, it says why and communicators run that path in Python.
"$VENV/bin/commslayer-native" >/dev/null || true
cd "$ROOT"
