#!/usr/bin/env bash
# PyTorch/XLA environment for the executor's XLA backend, and its tests.
#
# torch_xla 2.9.0 is bound to torch 2.9.0 (CPython 3.11), while the project's main environment
# runs torch 2.13, so XLA lives in its own virtual environment (about 7 GB: torch 2.9.0 from PyPI
# brings its CUDA libraries along):
#
#   scripts/xla_env.sh              # create/refresh .venv-xla, then run tests/test_xla*.py in it
#   scripts/xla_env.sh --install    # only create/refresh the environment
#   scripts/xla_env.sh -- -k single # extra pytest arguments after --
#
# Environment: XLA_VENV (default <repo>/.venv-xla), PYTHON (default python3.11),
# PJRT_DEVICE (default CPU; TPU or CUDA on machines that have them).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${XLA_VENV:-$ROOT/.venv-xla}"
PY="${PYTHON:-python3.11}"
INSTALL_ONLY=0
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --install) INSTALL_ONLY=1 ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        *) echo "usage: $0 [--install] [-- pytest args]" >&2; exit 2 ;;
    esac
    shift
done

export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[xla_env] creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi
# keep the environment out of git without touching the repository's .gitignore
[ -f "$VENV/.gitignore" ] || echo '*' > "$VENV/.gitignore"

PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -q)
if ! "$VENV/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as m, sys
ok = m.version("torch").startswith("2.9.0") and m.version("torch_xla").startswith("2.9.0")
sys.exit(0 if ok else 1)
EOF
then
    echo "[xla_env] installing torch==2.9.0 torch_xla==2.9.0 (large download)"
    "${PIP[@]}" "torch==2.9.0" "torch_xla==2.9.0"
fi
# the project without its pinned torch, plus the light dependencies the executor and tests use
"${PIP[@]}" "numpy>=1.26" "simpy>=4.1" "pydantic>=2.6" "pyyaml>=6.0" "scipy>=1.11" "tqdm>=4.66" \
    "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "ray>=2.40"
"${PIP[@]}" --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import torch, torch_xla; print('[xla_env] torch', torch.__version__, 'torch_xla', torch_xla.__version__)"

[ "$INSTALL_ONLY" = 1 ] && exit 0
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -p no:cacheprovider tests/test_xla.py -rs "${PYTEST_ARGS[@]}"
