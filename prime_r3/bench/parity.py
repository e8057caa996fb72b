"""Bitwise parity of routed-experts rows between two R3 arms, request by request."""

from __future__ import annotations

from typing import Any

import numpy as np


class ParityError(AssertionError):
    """Two arms handed a request different routed-experts rows."""


def compare(base: dict[str, Any], other: dict[str, Any], names: tuple[str, str]) -> dict[str, Any]:
    """Compare every request both arms finished; raise ParityError naming the first mismatch.

    Both arms run the same deterministic workload for the same number of steps, so they
    must also finish the same requests; a request finished by only one arm is an error.
    """
    a, b = base["digests"], other["digests"]
    only = sorted(set(a) ^ set(b))
    if only:
        where = names[0] if only[0] in a else names[1]
        raise ParityError(
            f"{len(only)} request(s) finished in only one arm, first {only[0]} (only in {where})"
        )
    for request_id in sorted(a):
        sha_a, prints_a, rows_a = a[request_id]
        sha_b, prints_b, rows_b = b[request_id]
        if sha_a == sha_b and rows_a == rows_b:
            continue
        n = min(len(prints_a), len(prints_b))
        diff = np.flatnonzero(np.asarray(prints_a[:n]) != np.asarray(prints_b[:n]))
        first = int(diff[0]) if len(diff) else n
        raise ParityError(
            f"request {request_id}: routed-experts rows differ between {names[0]} and "
            f"{names[1]}, first differing row {first} (rows {rows_a} vs {rows_b})"
        )
    flags = base["flags"]
    return {
        "requests": len(a),
        "rows": int(sum(v[2] for v in a.values())),
        "preempted_requests": sum(1 for r in a if flags[r][0]),
        "prefix_hit_requests": sum(1 for r in a if flags[r][1] > 0),
    }
