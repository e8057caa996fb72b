#!/usr/bin/env bash
# Create (first time) or reuse .venv/ with vLLM 0.32.0 on the CPU build of torch 2.13.0.
# Reruns check what is installed and install only what is missing or wrong.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PRIME_R3_PYTHON:-$(command -v python3.11 || command -v python3)}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "prime_r3: creating $VENV" >&2
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
PIP=("$VENV/bin/python" -m pip install -q)

missing="$("$VENV/bin/python" "$ROOT/scripts/check_env.py" "$ROOT" || true)"
[ -z "$missing" ] && exit 0
echo "prime_r3: setting up .venv ($missing)" >&2

case " $missing " in *" torch "*) "${PIP[@]}" torch==2.13.0 ;; esac
# torch first: vLLM 0.32.0's pins accept the local CPU build, so pip keeps it.
case " $missing " in *" vllm "*) "${PIP[@]}" vllm==0.32.0 ;; esac
case " $missing " in *" tools "*) "${PIP[@]}" wrapt numpy packaging pytest ruff tqdm matplotlib ;; esac
# --no-deps: resolving vllm's deps again would bring back the broken torchvision.
case " $missing " in *" prime_r3 "*) "${PIP[@]}" --no-deps -e "$ROOT" ;; esac
# PyPI's torchvision/torchaudio/torchcodec fail to load beside the CPU torch
# ("operator torchvision::nms does not exist") and break `import vllm`.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

still="$("$VENV/bin/python" "$ROOT/scripts/check_env.py" "$ROOT" || true)"
if [ -n "$still" ]; then
    echo "prime_r3: environment still not right after install: $still" >&2
    exit 1
fi
