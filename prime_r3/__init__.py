"""prime_r3: guarded monkey patches that make vLLM router replay (R3) cheap.

``import prime_r3; prime_r3.apply()`` in a launch script, or nothing at all under
``vllm serve``: the ``vllm.general_plugins`` entry point applies the overlay in every
process vLLM starts. Environment variables select patches (README.md, "Settings").
"""

from __future__ import annotations

from prime_r3.config import ConfigError
from prime_r3.layer import (
    PatchNotApplied,
    Report,
    apply,
    get_original,
    is_object_patched,
    revert,
    status,
)

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "PatchNotApplied",
    "Report",
    "apply",
    "get_original",
    "is_object_patched",
    "revert",
    "status",
    "__version__",
]
