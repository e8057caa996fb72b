"""A minimal Triton ``cpu`` backend: enough for Triton and vLLM to start, nothing compiled.

Test-environment only (see ../README.md). Triton finds backends through its
``triton.backends`` entry point group and imports ``<package>.compiler`` and
``<package>.driver``, each holding one concrete subclass. PyPI's Triton has no CPU
backend, and vLLM's CPU build enables Triton only when one is listed
(``vllm/triton_utils/importing.py``). Kernels never reach this backend's compiler: with
``TRITON_INTERPRET=1`` every ``@triton.jit`` function runs in Triton's own interpreter
on the host; anything that does try to compile gets an error saying so.
"""
