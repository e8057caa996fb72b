"""Bitwise parity of routed-experts rows between two R3 arms, request by request."""

from __future__ import annotations

from typing import Any

import numpy as np


class ParityError(AssertionError):
    """Two arms handed a request different routed-experts rows."""


def compare(base: dict[str, Any], other: dict[str, Any], names: tuple[str, str]) -> dict[str, Any]:
    """Compare every request either arm has rows for; raise ParityError on the first mismatch.

    Both arms run the same deterministic workload for the same number of steps, so they
    must finish the same requests and end with the same requests in flight. A finished
    request's rows are compared whole; a request still running at the end (``in_flight``:
    only those that received rows) is compared on the rows it has received so far, which
    is where preempted requests are: they recompute, and a short run ends before most of
    them finish. A request finished, or in flight with rows, in only one arm is an error.
    """
    finished = _same_requests(base["digests"], other["digests"], names, "finished")
    in_flight = _same_requests(
        base["in_flight"], other["in_flight"], names, "in flight with rows at the end"
    )
    _same_rows(finished, base["digests"], other["digests"], names, "")
    _same_rows(in_flight, base["in_flight"], other["in_flight"], names, " (in flight)")
    flags = base["flags"]
    compared = finished + in_flight
    rows = sum(base["digests"][r][2] for r in finished)
    rows += sum(base["in_flight"][r][2] for r in in_flight)
    return {
        "requests": len(compared),
        "finished_requests": len(finished),
        "in_flight_requests": len(in_flight),
        "rows": int(rows),
        "preempted_requests": sum(1 for r in compared if flags[r][0]),
        "prefix_hit_requests": sum(1 for r in compared if flags[r][1] > 0),
    }


def _same_requests(
    a: dict[str, Any], b: dict[str, Any], names: tuple[str, str], what: str
) -> list[str]:
    only = sorted(set(a) ^ set(b))
    if only:
        where = names[0] if only[0] in a else names[1]
        raise ParityError(
            f"{len(only)} request(s) {what} in only one arm, first {only[0]} (only in {where})"
        )
    return sorted(a)


def _same_rows(
    request_ids: list[str],
    a: dict[str, Any],
    b: dict[str, Any],
    names: tuple[str, str],
    label: str,
) -> None:
    for request_id in request_ids:
        sha_a, prints_a, rows_a = a[request_id]
        sha_b, prints_b, rows_b = b[request_id]
        if sha_a == sha_b and rows_a == rows_b:
            continue
        n = min(len(prints_a), len(prints_b))
        diff = np.flatnonzero(np.asarray(prints_a[:n]) != np.asarray(prints_b[:n]))
        first = int(diff[0]) if len(diff) else n
        raise ParityError(
            f"request {request_id}{label}: routed-experts rows differ between {names[0]} and "
            f"{names[1]}, first differing row {first} (rows {rows_a} vs {rows_b})"
        )
