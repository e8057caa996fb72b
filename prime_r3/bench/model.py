"""The only simulated part: a deterministic model that plays the GPU model runner's role.

It tracks requests from ``SchedulerOutput`` the way the V2 runner does (preempted
requests are dropped and come back as new requests), returns one sampled token per
request that finished its prefill, and for every executed token a routing row that
depends only on (token id, position), so a cached prefix reproduces the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from prime_r3.bench.workload import BenchConfig, request_seed

_TABLE = 4096
_MIX = np.uint64(0x9E3779B97F4A7C15)


def sampled_tokens(seeds: np.ndarray | int, positions: np.ndarray, vocab: int) -> np.ndarray:
    """The token a request samples at each position: a pure function of (request, position)."""
    salt = (np.asarray(seeds, dtype=np.uint64) * np.uint64(0xBF58476D1CE4E5B9)).astype(np.uint64)
    x = positions.astype(np.uint64) * _MIX + salt
    x ^= x >> np.uint64(31)
    return (x % np.uint64(vocab - 1) + np.uint64(1)).astype(np.int64)


class RoutingTable:
    """rows(token, position) = (T[token % n] + P[position % n]) % experts, per layer and k."""

    def __init__(self, cfg: BenchConfig) -> None:
        rng = np.random.default_rng([cfg.seed, 99])
        shape = (_TABLE, cfg.layers, cfg.topk)
        self.experts = cfg.experts
        self.dtype = np.dtype(np.uint8 if cfg.experts <= 256 else np.uint16)
        self._tok = rng.integers(0, cfg.experts, shape, dtype=np.uint32)
        self._pos = rng.integers(0, cfg.experts, shape, dtype=np.uint32)

    def rows(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        out = self._tok[tokens % _TABLE] + self._pos[positions % _TABLE]
        out %= np.uint32(self.experts)
        return out.astype(self.dtype)


@dataclass
class _Req:
    prompt: np.ndarray
    seed: int
    prefill_len: int
    num_computed: int


def sort_batch(num_scheduled: dict[str, int]) -> list[str]:
    """Decodes first, then short extends, then prefills -- the V2 runner's batch order."""
    return sorted(num_scheduled, key=lambda r: (num_scheduled[r] != 1, num_scheduled[r]))


class ModelStandIn:
    """Worker-side request state plus the "forward pass" (tokens -> routing rows)."""

    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.table = RoutingTable(cfg)
        self._reqs: dict[str, _Req] = {}

    def update_states(self, so: Any) -> None:
        """finish_requests / add_requests / update_requests of the V2 runner."""
        for req_id in so.finished_req_ids | (so.preempted_req_ids or set()):
            self._reqs.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            prefill = new.prefill_token_ids or new.prompt_token_ids
            self._reqs[new.req_id] = _Req(
                np.asarray(new.prompt_token_ids, dtype=np.int64),
                request_seed(new.req_id),
                len(prefill),
                new.num_computed_tokens,
            )
        cached = so.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self._reqs[req_id].num_computed = num_computed

    def execute(self, so: Any) -> tuple[Any, np.ndarray, list[list[int]], np.ndarray]:
        """Run one step: (input batch view, routing rows, sampled tokens, num_sampled)."""
        req_ids = sort_batch(so.num_scheduled_tokens)
        reqs = [self._reqs[r] for r in req_ids]
        n = len(req_ids)
        counts = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), np.int64, n)
        starts = np.fromiter((q.num_computed for q in reqs), np.int64, n)
        seeds = np.fromiter((q.seed for q in reqs), np.uint64, n)
        prefill_lens = np.fromiter((q.prefill_len for q in reqs), np.int64, n)
        query_start_loc = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        total = int(query_start_loc[-1])
        # Every executed position, and the request it belongs to, in batch order.
        owner = np.repeat(np.arange(n), counts)
        positions = np.arange(total) - np.repeat(query_start_loc[:-1], counts) + starts[owner]
        tokens = sampled_tokens(seeds[owner], positions, self.cfg.vocab)
        for i in np.flatnonzero(starts < np.fromiter((len(q.prompt) for q in reqs), np.int64, n)):
            prompt = reqs[i].prompt
            lo = int(query_start_loc[i])
            end = min(int(starts[i] + counts[i]), len(prompt))
            tokens[lo : lo + end - int(starts[i])] = prompt[int(starts[i]) : end]
        rows = self.table.rows(tokens, positions)
        done = starts + counts >= prefill_lens
        num_sampled = done.astype(np.int32)
        next_tokens = sampled_tokens(seeds, starts + counts, self.cfg.vocab).tolist()
        sampled = [[t] if d else [] for t, d in zip(next_tokens, done.tolist(), strict=True)]
        batch = SimpleNamespace(
            req_ids=req_ids,
            query_start_loc_np=query_start_loc,
            num_computed_tokens_np=starts.astype(np.int32),
        )
        return batch, rows, sampled, num_sampled
