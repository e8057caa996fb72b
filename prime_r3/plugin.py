"""The ``vllm.general_plugins`` entry point: how the overlay reaches every vLLM process.

vLLM calls ``load()`` once per process (API server, EngineCore, each worker, fork or
spawn) from ``load_general_plugins()``. vLLM swallows errors raised while *importing*
a plugin but not errors raised by calling it, so configuration errors raised here stop
vLLM from starting, as they should.

It also makes the settings reach Ray workers, with the head's values winning (see
``config.export_for_ray_workers``): vLLM copies only some variable prefixes to Ray
workers, and its V2 Ray executor lets a node's own values win.
"""

from __future__ import annotations

import logging

from prime_r3 import config
from prime_r3.layer import Report, apply

logger = logging.getLogger("vllm.prime_r3")


def load() -> Report:
    settings_env, note = config.settings_environ()
    if note:
        logger.warning("prime_r3: %s (the head's settings win on every node)", note)
    report = apply(environ=settings_env)
    config.export_for_ray_workers(settings_env)
    return report
