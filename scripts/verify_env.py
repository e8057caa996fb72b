"""Check that a freshly set-up environment runs every vLLM module prime_r3 touches.

Run by ensure_env.sh after an install. vLLM 0.33.0 is installed over a torch it does not
pin (see ensure_env.sh), so "pip installed it" proves nothing: this imports each module a
patch targets or relies on, and runs the aux-output store once, on the installed torch.
On success it records the release and torch in the environment (``prime_r3-verified``),
which check_env.py reads, so the check runs once per install, not on every test run.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import pathlib
import sys

MODULES = (
    "vllm.distributed.aux_output_connector.store",
    "vllm.distributed.aux_output_connector.connector",
    "vllm.distributed.aux_output_connector.worker",
    "vllm.distributed.aux_output_connector.routed_experts",
    "vllm.distributed.device_communicators.shm_broadcast",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.engine.core",
    "vllm.v1.engine.output_processor",
    "vllm.entrypoints.launchers.utils.server_utils",
)
MARKER = "prime_r3-verified"


def verify() -> None:
    for name in MODULES:
        importlib.import_module(name)
    import numpy as np
    from vllm.distributed.aux_output_connector.store import BlockObject, BlockObjectStore

    store = BlockObjectStore(max_bytes=64, object_nbytes=16)
    try:
        for key in range(8):  # more keys than slots: exercises eviction on this release
            payload = np.full(16, key, dtype=np.uint8).tobytes()
            store.put([BlockObject(str(key), payload)])
        if store.get_concatenated(["7"]) != np.full(16, 7, dtype=np.uint8).tobytes():
            raise RuntimeError("the aux-output store returned the wrong bytes")
    finally:
        store.close()


def main(release: str, torch_version: str) -> int:
    installed = md.version("vllm"), md.version("torch").split("+")[0]
    if installed != (release, torch_version):
        print(f"prime_r3: expected vllm {release} on torch {torch_version}, found {installed}")
        return 1
    try:
        verify()
    except Exception as error:  # noqa: BLE001 - report any failure as a setup failure
        print(f"prime_r3: vllm {release} does not run here: {type(error).__name__}: {error}")
        return 1
    (pathlib.Path(sys.prefix) / MARKER).write_text(f"{release} {torch_version}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
