"""Tiny random-weight Qwen3-MoE checkpoints, made on first use and cached.

A :class:`Profile` sets the routing shape (MoE layers x top-k x experts); everything
else is as small as vLLM's CPU engine accepts. The weights are drawn by transformers'
own initialisation under a fixed seed and saved in HF format (``config.json`` and
``model.safetensors``, no tokenizer: engines run with ``skip_tokenizer_init=True`` on
token-id prompts), so a profile always gives the same checkpoint. Every layer is an
MoE layer, so a routed-experts row is ``layers x topk`` ids, uint8 up to 256 experts
and uint16 above.

Checkpoints are cached under the checkout's ``.cache/e2e-models/`` (git-ignored) or,
for an installed prime_r3, ``$XDG_CACHE_HOME/prime_r3/e2e-models``; the directory name
carries a hash of everything that decides the bytes (the profile, the maker, the torch
and transformers versions), so a change gives a new directory, never a stale one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata as md
import json
import os
import pathlib
import shutil
import tempfile

#: Bump when the maker changes what it writes for the same profile.
MAKER_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Profile:
    """The routing shape of a checkpoint, and the seed of its weights."""

    name: str
    layers: int
    topk: int
    experts: int
    hidden: int = 64
    moe_intermediate: int = 32
    vocab: int = 512
    seed: int = 0

    @property
    def row_dtype(self) -> str:
        return "uint8" if self.experts <= 256 else "uint16"

    def hf_config(self) -> dict:
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": 2 * self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "max_position_embeddings": 4096,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": self.moe_intermediate,
            "num_experts": self.experts,
            "num_experts_per_tok": self.topk,
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "bfloat16",
        }

    def key(self) -> str:
        """A hash of what decides the bytes: the maker, seed, config and the versions of
        the torch and transformers that draw and write the weights."""
        versions = [md.version("torch"), md.version("transformers")]
        blob = json.dumps([MAKER_VERSION, self.seed, self.hf_config(), versions], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


PROFILES = {
    p.name: p
    for p in (
        Profile("small", layers=4, topk=4, experts=16),
        # > 256 experts: routed-expert rows are uint16.
        Profile("uint16", layers=2, topk=2, experts=300, moe_intermediate=8),
        # The production row shape: 46 MoE layers x top-8.
        Profile("prod46x8", layers=46, topk=8, experts=16, hidden=32, moe_intermediate=8),
    )
}


def cache_root() -> pathlib.Path:
    """``<checkout>/.cache/e2e-models`` in a checkout, else the user's cache directory."""
    checkout = pathlib.Path(__file__).resolve().parents[2]
    if (checkout / "pyproject.toml").is_file() and (checkout / ".git").exists():
        return checkout / ".cache" / "e2e-models"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return pathlib.Path(base) / "prime_r3" / "e2e-models"


def ensure(profile: Profile, root: pathlib.Path | None = None) -> pathlib.Path:
    """The checkpoint directory of ``profile``, written first if not cached yet."""
    root = root or cache_root()
    target = root / f"{profile.name}-{profile.key()}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place: a half-written checkpoint
    # (an interrupted first run, a concurrent one) is never taken for a cached one.
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".{profile.name}-", dir=root))
    try:
        _write(profile, work)
        try:
            work.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _write(profile: Profile, directory: pathlib.Path) -> None:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**profile.hf_config())
    torch.manual_seed(profile.seed)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "prime_r3-profile.json").write_text(
        json.dumps(dataclasses.asdict(profile) | {"maker": MAKER_VERSION}, indent=1) + "\n"
    )
