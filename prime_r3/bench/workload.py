"""The closed-loop RL-style load: what requests exist, and in what order they arrive.

Kept free of vLLM imports so the parent process (which only parses flags and spawns
arms) never loads vLLM or applies patches.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BenchConfig:
    """Every knob of one run; identical across arms so the arms are comparable."""

    concurrency: int = 400
    steps: int = 400
    warmup: int = 150
    layers: int = 46
    topk: int = 8
    experts: int = 128
    block_size: int = 16
    #: Shared "system prompt" tokens per prompt family, then per-problem tokens.
    prefix_len: int = 192
    problem_len: int = 320
    #: RL groups: each problem is sampled this many times (shared prompt, prefix hits).
    samples_per_prompt: int = 8
    prefix_families: int = 4
    max_tokens: int = 1024
    min_tokens: int = 16
    max_num_batched_tokens: int = 2048
    #: KV capacity as a fraction of what all running requests would need at full length.
    kv_fraction: float = 0.25
    kv_blocks: int | None = None
    async_scheduling: bool = False
    seed: int = 0
    vocab: int = 32000
    #: Keep each request's routed-experts digest (for parity) -- costs one hash per output.
    parity: bool = True

    @property
    def prompt_len(self) -> int:
        return self.prefix_len + self.problem_len

    @property
    def num_kv_blocks(self) -> int:
        if self.kv_blocks is not None:
            return self.kv_blocks
        full = self.concurrency * (self.prompt_len + self.max_tokens) / self.block_size
        minimum = 4 * (self.prompt_len + self.max_tokens) // self.block_size
        return max(int(full * self.kv_fraction), minimum)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"num_kv_blocks": self.num_kv_blocks}


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: list[int]
    max_tokens: int


class Workload:
    """Deterministic stream of requests: the k-th request is the same in every arm."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self._next = 0
        rng = np.random.default_rng(cfg.seed)
        self._families = [
            rng.integers(1, cfg.vocab, cfg.prefix_len).tolist() for _ in range(cfg.prefix_families)
        ]

    def next_request(self) -> RequestSpec:
        cfg = self.cfg
        k = self._next
        self._next += 1
        problem = k // cfg.samples_per_prompt
        rng = np.random.default_rng([cfg.seed, problem])
        body = rng.integers(1, cfg.vocab, cfg.problem_len).tolist()
        prompt = self._families[problem % cfg.prefix_families] + body
        # Long-tailed output lengths, like RL rollouts hitting the cap now and then.
        out_rng = np.random.default_rng([cfg.seed, problem, k % cfg.samples_per_prompt, 7])
        length = int(out_rng.exponential(cfg.max_tokens / 3)) + cfg.min_tokens
        return RequestSpec(f"r{k:07d}", prompt, min(length, cfg.max_tokens))

    @property
    def issued(self) -> int:
        return self._next


def request_seed(request_id: str) -> int:
    """Per-request sampling seed, stable across processes (unlike ``hash``)."""
    return zlib.crc32(request_id.encode())
