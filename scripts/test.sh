#!/usr/bin/env bash
# Run the test suite in .venv/ (created on first use). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/ensure_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -q "$@"
