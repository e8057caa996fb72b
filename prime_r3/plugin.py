"""The ``vllm.general_plugins`` entry point: how the overlay reaches every vLLM process.

vLLM calls ``load()`` once per process (API server, EngineCore, each worker, fork or
spawn) from ``load_general_plugins()``. vLLM swallows errors raised while *importing*
a plugin but not errors raised by calling it, so configuration errors raised here stop
vLLM from starting, as they should.
"""

from __future__ import annotations

from prime_r3.layer import Report, apply


def load() -> Report:
    return apply()
