"""prime_r3's own modules may be what imports vLLM's aux-output connector first.

``apply()`` before vLLM is imported leaves packed_outputs, batched_take and
batched_commit waiting for vLLM's aux-output modules (post-import hooks). Their
factories read ``prime_r3.packed``, which itself imports vLLM's connector module. When
``prime_r3.packed`` is what imports the connector first (user code importing it, a
script, or a process whose first contact with it is unpickling a packed step), the
hooks run in the middle of ``prime_r3.packed``'s own import: the patches must still
install. (They rolled back with "cannot import name ... from partially initialized
module 'prime_r3.packed'" before the connector import moved to that module's end.)

Each case runs in a fresh interpreter: the import order is the point, and this test
session imported both modules long ago.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

PATCHES = ("packed_outputs", "batched_take", "batched_commit")

SCRIPT = """
import json, os, pickle, sys
import prime_r3
from prime_r3 import layer
layer.apply(log=False)
connector = "vllm.distributed.aux_output_connector.connector"
before = connector in sys.modules
{first}
import vllm.distributed.aux_output_connector.worker  # the rest of the package
from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector
status = layer.status()
print(json.dumps({{
    "connector_imported_before": before,
    "states": {{name: status.outcome(name).state for name in {patches!r}}},
    "take_output_patched": prime_r3.is_object_patched(
        AuxOutputSchedulerConnector.__dict__["take_output"]
    ),
    "received": received,
}}))
"""

FIRST = {
    "import": "import prime_r3.packed\nreceived = None",
    "from-import": "from prime_r3.packed import PackedAuxOutputs  # noqa: F401\nreceived = None",
    "unpickle": (
        "step = pickle.loads(bytes.fromhex(os.environ['TEST_PACKED_STEP_HEX']))\n"
        "received = {r: [o.token_start, o.rows.tolist()] for r, o in sorted(step.items())}"
    ),
}


def _packed_step_hex() -> tuple[str, dict[str, list]]:
    from vllm.distributed.aux_output_connector.connector import AuxRequestOutput

    from prime_r3.packed import PackedAuxOutputs

    rows = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(3, 2, 2)
    outputs = {"a": AuxRequestOutput(5, rows[:2]), "b": AuxRequestOutput(9, rows[2:])}
    expected = {r: [o.token_start, o.rows.tolist()] for r, o in sorted(outputs.items())}
    return pickle.dumps(PackedAuxOutputs.pack(outputs)).hex(), expected


@pytest.mark.parametrize("first", sorted(FIRST))
def test_patches_install_when_prime_r3_packed_imports_the_connector_first(first: str) -> None:
    blob, expected = _packed_step_hex()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(first=FIRST[first], patches=PATCHES)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu", "TEST_PACKED_STEP_HEX": blob},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["connector_imported_before"] is False  # the import order under test
    assert result["states"] == dict.fromkeys(PATCHES, "applied"), done.stderr[-3000:]
    assert result["take_output_patched"] is True
    assert "rolled back" not in done.stderr
    if first == "unpickle":
        assert result["received"] == expected
