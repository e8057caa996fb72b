"""Environment toggles select exactly what they say, and bad values fail loudly."""

from __future__ import annotations

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


@pytest.mark.parametrize("value", ["1,2", "a,b,c", "1,2,-3", "1,2,3,4"])
def test_malformed_param_names_variable_value_and_expectation(value: str) -> None:
    with pytest.raises(config.ConfigError) as info:
        settings(PRIME_R3_ENGINE_GC_THRESHOLDS=value)
    message = str(info.value)
    assert f"PRIME_R3_ENGINE_GC_THRESHOLDS={value!r}" in message
    assert "three non-negative integers" in message


def test_unknown_prime_r3_variable_is_an_error() -> None:
    with pytest.raises(config.ConfigError) as info:
        settings(PRIME_R3_ENGINE_GC_THRESHOLD="1,2,3")
    assert "PRIME_R3_ENGINE_GC_THRESHOLD " in str(info.value)
    assert "PRIME_R3_ENGINE_GC_THRESHOLDS" in str(info.value)


def test_parsers() -> None:
    parse = config.parse_float_at_least(1.0)
    assert parse(" 2.5 ") == 2.5
    for bad in ("0.5", "nan", "inf", "x"):
        with pytest.raises(ValueError):
            parse(bad)
