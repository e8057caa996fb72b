"""Environment toggles select exactly what they say, and bad values fail loudly."""

from __future__ import annotations

import os

import pytest

from prime_r3 import config
from prime_r3.patches import REGISTRY

NAMES = [s.name for s in REGISTRY]


def settings(**env: str) -> config.Settings:
    return config.from_env(REGISTRY, env)


def test_default_is_everything_on() -> None:
    s = settings()
    assert s.enabled and list(s.selected) == NAMES and not s.requested


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_prime_r3_zero_disables(value: str) -> None:
    assert not settings(PRIME_R3=value).enabled


@pytest.mark.parametrize("value", ["1", "true", "on", "yes", ""])
def test_prime_r3_on_values(value: str) -> None:
    assert settings(PRIME_R3=value).enabled


def test_prime_r3_bad_value_names_variable_value_and_choices() -> None:
    with pytest.raises(config.ConfigError) as info:
        settings(PRIME_R3="maybe")
    message = str(info.value)
    assert "PRIME_R3='maybe'" in message and "true" in message and "0" in message


def test_selection_by_name_list() -> None:
    s = settings(PRIME_R3_PATCHES=NAMES[0])
    assert list(s.selected) == [NAMES[0]] and s.requested == {NAMES[0]}


def test_selection_drop_one() -> None:
    s = settings(PRIME_R3_PATCHES=f"-{NAMES[0]}")
    assert list(s.selected) == NAMES[1:] and not s.requested


def test_selection_all_then_drop() -> None:
    s = settings(PRIME_R3_PATCHES=f"all,-{NAMES[0]}")
    assert list(s.selected) == NAMES[1:]


@pytest.mark.parametrize("value", ["nope", f"{NAMES[0]},nope", "-nope"])
def test_unknown_patch_name_is_an_error_naming_it_and_the_choices(value: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        settings(PRIME_R3_PATCHES=value)
    message = str(info.value)
    assert "PRIME_R3_PATCHES" in message and "'nope'" in message
    assert all(name in message for name in NAMES)


def test_empty_item_is_an_error() -> None:
    with pytest.raises(config.ConfigError, match="empty item"):
        settings(PRIME_R3_PATCHES=f"{NAMES[0]},,")


def test_param_default_and_override() -> None:
    assert settings().params["engine_gc"]["thresholds"] == (50_000, 20, 100)
    s = settings(PRIME_R3_ENGINE_GC_THRESHOLDS="1_000, 5,7")
    assert s.params["engine_gc"]["thresholds"] == (1000, 5, 7)


@pytest.mark.parametrize("value", ["1,2", "a,b,c", "1,2,-3", "1,2,3,4", "99999999999,1,1"])
def test_malformed_param_names_variable_value_and_expectation(value: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        settings(PRIME_R3_ENGINE_GC_THRESHOLDS=value)
    message = str(info.value)
    assert f"PRIME_R3_ENGINE_GC_THRESHOLDS={value!r}" in message
    assert "three integers in 0..2147483647" in message


def test_output_turns_slice_default_override_and_bad_values() -> None:
    assert settings().params["output_turns"]["slice_ms"] == 100.0
    assert settings(PRIME_R3_OUTPUT_TURNS_SLICE_MS="0").params["output_turns"]["slice_ms"] == 0.0
    for value in ("-1", "1001", "nan", "fast"):
        with pytest.raises(config.ConfigError) as info:
            settings(PRIME_R3_OUTPUT_TURNS_SLICE_MS=value)
        message = str(info.value)
        assert f"PRIME_R3_OUTPUT_TURNS_SLICE_MS={value!r}" in message
        assert "milliseconds in 0..1000" in message


def test_gc_threshold_range_is_exactly_what_gc_set_threshold_accepts() -> None:
    """The limit is gc.set_threshold's own (C int), checked against the interpreter."""
    import gc

    saved = gc.get_threshold()
    try:
        gc.set_threshold(config.C_INT_MAX, 1, 1)  # the largest value we accept works
        with pytest.raises(OverflowError):
            gc.set_threshold(config.C_INT_MAX + 1, 1, 1)  # one more is what upstream rejects
    finally:
        gc.set_threshold(*saved)
    top = f"{config.C_INT_MAX},{config.C_INT_MAX},0"
    assert settings(PRIME_R3_ENGINE_GC_THRESHOLDS=top).params["engine_gc"]["thresholds"] == (
        config.C_INT_MAX,
        config.C_INT_MAX,
        0,
    )
    for i in range(3):
        parts = ["1", "1", "1"]
        parts[i] = str(config.C_INT_MAX + 1)
        with pytest.raises(config.ConfigError, match="outside the valid range 0..2147483647"):
            settings(PRIME_R3_ENGINE_GC_THRESHOLDS=",".join(parts))


def test_setup_script_variable_is_known_but_changes_nothing() -> None:
    """scripts/ensure_env.sh reads PRIME_R3_PYTHON: exporting it must not break the overlay."""
    plain = settings()
    with_python = settings(PRIME_R3_PYTHON="/usr/bin/python3.11")
    assert with_python.selected == plain.selected and with_python.params == plain.params
    shown = {v.var: v for v in with_python.values}
    assert shown["PRIME_R3_PYTHON"].value == "/usr/bin/python3.11"
    assert shown["PRIME_R3_PYTHON"].from_env
    assert "PRIME_R3_PYTHON" in config.SETUP_VARS


def test_setup_script_reads_the_variables_config_knows() -> None:
    """Every PRIME_R3_* variable the setup script reads is known to config."""
    import pathlib
    import re

    script = pathlib.Path(__file__).parents[1] / "scripts" / "ensure_env.sh"
    read = set(re.findall(r"\b(PRIME_R3_[A-Z0-9_]+)", script.read_text()))
    assert read, "ensure_env.sh reads no PRIME_R3_ variable any more: update SETUP_VARS"
    assert read <= set(config.SETUP_VARS)


def test_values_report_every_setting_with_its_source() -> None:
    s = settings(PRIME_R3_ENGINE_GC_THRESHOLDS="1,2,3", PRIME_R3_ENGINE_GC_API_SERVER=" ")
    shown = {v.var: v for v in s.values}
    params = {p.env_var(spec.name) for spec in REGISTRY for p in spec.params}
    assert set(shown) == {"PRIME_R3", "PRIME_R3_PATCHES", *params, *config.SETUP_VARS}
    assert shown["PRIME_R3_ENGINE_GC_THRESHOLDS"].value == (1, 2, 3)
    assert shown["PRIME_R3_ENGINE_GC_THRESHOLDS"].from_env
    assert shown["PRIME_R3_ENGINE_GC_THRESHOLDS"].default == (50_000, 20, 100)
    assert shown["PRIME_R3_ENGINE_GC_API_SERVER"].value is False
    assert not shown["PRIME_R3_ENGINE_GC_API_SERVER"].from_env  # blank means default
    assert shown["PRIME_R3"].value is True and not shown["PRIME_R3"].from_env
    assert shown["PRIME_R3_PATCHES"].value == ",".join(NAMES)


def test_unknown_prime_r3_variable_is_an_error() -> None:
    with pytest.raises(config.ConfigError) as info:
        settings(PRIME_R3_ENGINE_GC_THRESHOLD="1,2,3")
    assert "PRIME_R3_ENGINE_GC_THRESHOLD " in str(info.value)
    assert "PRIME_R3_ENGINE_GC_THRESHOLDS" in str(info.value)


def test_parsers() -> None:
    parse = config.parse_float_in_range(1.0, 8.0)
    assert parse(" 2.5 ") == 2.5
    assert parse("1") == 1.0 and parse("8") == 8.0
    for bad in ("0.5", "nan", "inf", "-inf", "8.001", "1e9", "x"):
        with pytest.raises(ValueError):
            parse(bad)


# -- the head's settings for Ray workers ----------------------------------------------


def _carrier(machine: str, **env: str) -> str:
    import json

    return json.dumps({"machine": machine, "env": env})


def test_export_appends_prime_r3_to_vllms_extra_prefixes_once() -> None:
    env = {"VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY": "MYLIB_, OTHER_"}
    config.export_for_ray_workers({"PRIME_R3_PATCHES": "engine_gc", "PRIME_R3_PYTHON": "/p"}, env)
    assert env["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MYLIB_, OTHER_,PRIME_R3"
    config.export_for_ray_workers({}, env)
    assert env["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MYLIB_, OTHER_,PRIME_R3"
    empty: dict[str, str] = {}
    config.export_for_ray_workers({}, empty)
    assert empty["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "PRIME_R3"


def test_export_records_this_machine_and_only_overlay_settings() -> None:
    import json

    env: dict[str, str] = {}
    config.export_for_ray_workers(
        {"PRIME_R3": "1", "PRIME_R3_PATCHES": "engine_gc", "PRIME_R3_PYTHON": "/p", "HOME": "/"},
        env,
    )
    carrier = json.loads(env[config.HEAD_VAR])
    with open(f"/proc/{os.getpid()}/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[19])
    assert carrier == {
        "machine": config.machine_id(),
        "process": [os.getpid(), start],
        "env": {"PRIME_R3": "1", "PRIME_R3_PATCHES": "engine_gc"},
    }


def test_remote_heads_settings_replace_the_nodes_own(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        config.HEAD_VAR: _carrier("head-machine", PRIME_R3_ENGINE_GC_THRESHOLDS="4,5,6"),
        "PRIME_R3_ENGINE_GC_THRESHOLDS": "1,1,1",
        "PRIME_R3_PATCHES": "-engine_gc",  # the node's own, not set on the head: dropped
        "PRIME_R3_PYTHON": "/node/python",  # setup variable: the node's stays
        "HOME": "/home/node",
    }
    merged, note = config.settings_environ(env)
    assert merged == {
        config.HEAD_VAR: env[config.HEAD_VAR],
        "PRIME_R3_ENGINE_GC_THRESHOLDS": "4,5,6",
        "PRIME_R3_PYTHON": "/node/python",
        "HOME": "/home/node",
    }
    assert "PRIME_R3_ENGINE_GC_THRESHOLDS='1,1,1' -> '4,5,6'" in note
    assert "PRIME_R3_PATCHES='-engine_gc' -> None" in note
    s = config.from_env(REGISTRY, merged)
    assert s.params["engine_gc"]["thresholds"] == (4, 5, 6) and list(s.selected) == NAMES
    # Its own children keep the head's record (the whole tree agrees).
    before = env[config.HEAD_VAR]
    config.export_for_ray_workers(merged, env)
    assert env[config.HEAD_VAR] == before
    assert config.settings_environ(env)[0]["PRIME_R3_ENGINE_GC_THRESHOLDS"] == "4,5,6"


def test_same_machine_keeps_its_own_settings() -> None:
    env = {
        config.HEAD_VAR: _carrier(config.machine_id(), PRIME_R3_ENGINE_GC_THRESHOLDS="4,5,6"),
        "PRIME_R3_ENGINE_GC_THRESHOLDS": "1,1,1",
    }
    merged, note = config.settings_environ(env)
    assert merged is env and note == ""


def _same_machine(process: list[int] | None) -> dict[str, str]:
    import json

    carrier = {"machine": config.machine_id(), "process": process, "env": {"PRIME_R3_PATCHES": "a"}}
    return {config.HEAD_VAR: json.dumps(carrier), "PRIME_R3_PATCHES": "-engine_gc"}


def test_same_machine_below_the_writer_keeps_its_own_settings() -> None:
    """Written by this process or an ancestor (vLLM's spawned children): own settings."""
    for pid in (os.getpid(), os.getppid()):
        if pid == 0:  # this process is a PID namespace's first (a container's): no parent
            continue
        process = config._process_id(pid)
        assert process is not None
        env = _same_machine(process)
        assert config.settings_environ(env) == (env, "")


def test_same_machine_outside_the_writers_tree_runs_the_heads_settings() -> None:
    """A Ray worker of a cluster started elsewhere on this machine: not below EngineCore."""
    import subprocess

    other = subprocess.Popen(["sleep", "30"])  # a child of ours: not our ancestor
    try:
        process = config._process_id(other.pid)
        assert process is not None
        merged, note = config.settings_environ(_same_machine(process))
        assert merged["PRIME_R3_PATCHES"] == "a"
        assert (
            note
            == "this node's own values replaced by the head's: PRIME_R3_PATCHES='-engine_gc' -> 'a'"
        )
        # The same pid with another start time is another process (a reused pid).
        own = config._process_id(os.getpid())
        assert own is not None
        env = _same_machine([own[0], own[1] + 1])
        assert config.settings_environ(env)[0]["PRIME_R3_PATCHES"] == "a"
    finally:
        other.kill()
        other.wait()


def test_same_machine_without_readable_ancestry_keeps_its_own_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = _same_machine([1, 1])
    monkeypatch.setattr(config, "_stat", lambda pid: None)
    assert config.settings_environ(env) == (env, "")
    env = _same_machine(None)  # a writer that could not read its own start time
    assert config.settings_environ(env) == (env, "")


@pytest.mark.parametrize(
    "raw",
    [
        "{",
        '{"env": {}}',
        '{"machine": 1, "env": {}}',
        "[1]",
        '{"machine": "m", "process": [1], "env": {}}',
        '{"machine": "m", "process": ["1", 2], "env": {}}',
    ],
)
def test_malformed_head_record_names_the_variable(raw: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        config.settings_environ({config.HEAD_VAR: raw})
    assert str(info.value).startswith(f"{config.HEAD_VAR}={raw!r} is not valid")


def test_head_record_is_a_known_variable() -> None:
    settings(PRIME_R3_FROM_HEAD=_carrier("m"))
