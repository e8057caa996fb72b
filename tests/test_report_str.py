"""``print(prime_r3.apply())`` shows the process log line, not the dataclass dump."""

from __future__ import annotations

import logging
import os

import pytest

import prime_r3
from prime_r3 import layer
from tests.test_layer import fake_registry  # noqa: F401 - the fixture


def test_a_report_prints_as_the_log_line_and_keeps_its_repr() -> None:
    report = layer.Report(
        "0.32.0",
        (
            layer.Outcome(
                "engine_gc", layer.PENDING, "waits for import of vllm.v1.worker.gpu_worker"
            ),
            layer.Outcome("packed_outputs", layer.APPLIED),
            layer.Outcome("store_eviction", layer.SKIPPED, "vllm 0.33.0 has this fix upstream"),
            layer.Outcome("store_headroom", layer.DISABLED, "not selected by PRIME_R3_PATCHES"),
        ),
    )
    assert str(report) == report.summary()
    assert str(report) == (
        f"prime_r3 on vllm 0.32.0 (pid {os.getpid()}): active: packed_outputs"
        " | on import: engine_gc (waits for import of vllm.v1.worker.gpu_worker)"
        " | skipped: store_eviction (vllm 0.33.0 has this fix upstream)"
        " | disabled: store_headroom"
    )
    assert repr(report).startswith("Report(vllm_version='0.32.0', outcomes=(Outcome(")


def test_print_of_apply_is_what_the_process_logs(
    fake_registry,  # noqa: ANN001, F811
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with caplog.at_level(logging.INFO, logger="vllm.prime_r3"):
        report = prime_r3.apply()
    print(report)
    printed = capsys.readouterr().out.strip()
    assert printed == caplog.records[-1].getMessage()
    assert printed.endswith("active: two_targets, one_target")
    assert "Outcome(" not in printed


def test_print_of_revert_names_what_went_and_what_was_not_active(fake_registry) -> None:  # noqa: ANN001, F811
    prime_r3.apply(["one_target"])
    printed = str(prime_r3.revert())
    assert printed.endswith(": revert | reverted: one_target | not active: two_targets"), printed
