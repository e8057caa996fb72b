"""The e2e checkpoints: seeded, so a profile always gives the same bytes; shaped as asked."""

from __future__ import annotations

import hashlib
import json
import pathlib

from tests.e2e_harness import needs_cpu_engine

pytestmark = needs_cpu_engine


def _digest(directory: pathlib.Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def test_a_profile_always_gives_the_same_checkpoint(tmp_path: pathlib.Path) -> None:
    from prime_r3.e2e.checkpoint import Profile, ensure

    profile = Profile("t", layers=3, topk=2, experts=8, seed=5)
    a, b = ensure(profile, tmp_path / "a"), ensure(profile, tmp_path / "b")
    assert _digest(a) == _digest(b)
    other = ensure(Profile("t", layers=3, topk=2, experts=8, seed=6), tmp_path / "a")
    assert other != a and _digest(other)["model.safetensors"] != _digest(a)["model.safetensors"]
    assert ensure(profile, tmp_path / "a") == a  # cached: not written again
    assert [p.name for p in (tmp_path / "a").iterdir() if p.name.startswith(".")] == []


def test_profiles_have_the_routing_shapes_asked_for() -> None:
    from prime_r3.e2e.checkpoint import PROFILES

    shapes = {n: (p.layers, p.topk, p.experts, p.row_dtype) for n, p in PROFILES.items()}
    assert shapes["prod46x8"][:2] == (46, 8)
    assert shapes["uint16"][2] > 256 and shapes["uint16"][3] == "uint16"
    config = PROFILES["prod46x8"].hf_config()
    assert config["num_hidden_layers"] == 46 and config["mlp_only_layers"] == []
    assert json.loads(json.dumps(config)) == config
