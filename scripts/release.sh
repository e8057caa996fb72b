# Sourced by the setup scripts: which vLLM release to run, and its environment.
# VLLM_VERSION picks a supported release (default 0.32.0 in .venv/; others in
# .venv-<release>/, each set up on first use and reused after). It is unset again here:
# vLLM warns about VLLM_* variables it does not know.
PRIME_R3_RELEASES="0.31.0 0.32.0 0.33.0"
PRIME_R3_DEFAULT_RELEASE="0.32.0"
VLLM_RELEASE="${VLLM_VERSION:-$PRIME_R3_DEFAULT_RELEASE}"
case " $PRIME_R3_RELEASES " in
    *" $VLLM_RELEASE "*) ;;
    *)
        echo "prime_r3: VLLM_VERSION=$VLLM_RELEASE is not supported; supported releases:" \
            "0.31.0, 0.32.0 (default), 0.33.0" >&2
        exit 2
        ;;
esac
if [ "$VLLM_RELEASE" = "$PRIME_R3_DEFAULT_RELEASE" ]; then
    VENV="$ROOT/.venv"
else
    VENV="$ROOT/.venv-$VLLM_RELEASE"
fi
unset VLLM_VERSION
