#!/usr/bin/env bash
# Run the test suite in the environment of one vLLM release (VLLM_VERSION, default 0.32.0 in
# .venv/; see scripts/release.sh), set up on first use. Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=release.sh
. "$ROOT/scripts/release.sh"
VLLM_VERSION="$VLLM_RELEASE" VLLM_BUILD="$VLLM_BUILD_NAME" "$ROOT/scripts/ensure_env.sh"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q "$@"
