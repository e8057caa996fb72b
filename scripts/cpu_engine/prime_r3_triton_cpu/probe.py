"""Test-only ``vllm.general_plugins`` entry point: a copy of each process's prime_r3 log.

Inert unless ``R3_E2E_PROBE_DIR`` is set (by ``prime_r3.e2e``). vLLM imports every
general plugin before it calls any (``vllm.plugins.load_plugins_by_group``), so what
this does on import is in place before prime_r3's plugin logs its summary line: every
``vllm.prime_r3`` record of the process, debug ones included (the ``installed on
import`` lines), is appended to ``<dir>/<pid>.log`` as ``pid<TAB>process name<TAB>
message``. vLLM's own handlers keep their level: what the process prints is unchanged.

The copy is made by the logger object itself (its class is switched to one whose
``handle`` writes the file first), not by a handler: vLLM configures logging again
after the plugins ran (``configure_logging_if_needed`` in ``LLMEngine``/``AsyncLLM``),
and ``logging.config.dictConfig`` then empties the handlers and resets the level of
every existing child of the ``vllm`` logger; it keeps the logger objects.
"""

from __future__ import annotations

import logging
import os

_DIRECTORY = os.environ.get("R3_E2E_PROBE_DIR")


class _ProbeLogger(logging.Logger):
    def getEffectiveLevel(self) -> int:  # noqa: N802 - logging's name
        return logging.DEBUG  # debug records are made; vLLM's handler still drops them

    def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging's name
        return not self.disabled and level >= logging.DEBUG

    def handle(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage().replace("\n", " ")
            path = os.path.join(_DIRECTORY or ".", f"{os.getpid()}.log")
            with open(path, "a") as f:  # reopened per record: fork/spawn safe, tiny volume
                f.write(f"{os.getpid()}\t{record.processName}\t{message}\n")
        except Exception:  # noqa: BLE001 - a probe never breaks the process it watches
            pass
        if record.levelno >= logging.Logger.getEffectiveLevel(self):
            super().handle(record)


if _DIRECTORY:
    logging.getLogger("vllm.prime_r3").__class__ = _ProbeLogger


def load() -> None:
    """Called by vLLM; the work was done on import."""
