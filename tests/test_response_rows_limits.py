"""response_rows at the kernel's limits: it never fails where upstream succeeds.

Every call the patch makes on a mapping (``mmap``, ``madvise``, ``mremap`` to grow, the
shrink at finish) may be refused; each refusal takes upstream's path, counted, and the
finished rows are upstream's ``np.concatenate`` of the same chunks. Here: each refusal
injected in process; a real finish at the process's ``vm.max_map_count`` (in a
subprocess, which the limit leaves crippled); the cap on mappings of requests in flight;
and the huge-page advice, on a mapping advised as THP ``always`` would treat it.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import json
import mmap
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prime_r3.fixes import response_rows

ROOT = Path(__file__).resolve().parents[1]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
LINUX = sys.platform.startswith("linux")


def _rows(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 100, size=(n, 5, 3)).astype(np.uint8)


def _same(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert np.array_equal(got, expected)


def _finish(chunks: response_rows.RowChunks, **state: Any) -> np.ndarray:
    """The finished output's rows as the output processor gets them: upstream's
    ``_new_completion_output`` (its concatenation of a non-empty list) under the wrapper,
    called as upstream calls it."""

    def upstream(token_ids: list[int], finish_reason: Any, stop_reason: Any) -> Any:
        rows = np.concatenate(chunks, axis=0) if chunks else None
        return types.SimpleNamespace(finish_reason=finish_reason, routed_experts=rows)

    instance = types.SimpleNamespace(routed_experts_chunks=chunks, **state)
    wrapper = response_rows._new_completion_output({})
    return wrapper(upstream, instance, ([7], "length", None), {}).routed_experts


def _module_like_mmap() -> types.SimpleNamespace:
    """A stand-in for ``response_rows.mmap``: the ``mmap`` module's names, to replace some."""
    return types.SimpleNamespace(**{k: getattr(mmap, k) for k in dir(mmap) if k[0] != "_"})


class _Kernel:
    """``response_rows.mmap`` with mappings whose kernel calls can be refused."""

    refuse = ""
    error: type[Exception] = OSError  # SystemError: a Python without mremap

    def __init__(self) -> None:
        kernel = self

        class Mapping(mmap.mmap):
            def madvise(self, *args: Any) -> None:
                if kernel.refuse == "advise":
                    raise OSError(errno.ENOMEM, "Cannot allocate memory")
                if kernel.refuse == "advise_no_thp":
                    raise OSError(errno.EINVAL, "Invalid argument")
                super().madvise(*args)

            def resize(self, size: int) -> None:
                if kernel.refuse == ("grow" if size > len(self) else "shrink"):
                    if kernel.error is SystemError:  # CPython's mmap without mremap
                        raise SystemError("mmap: resizing not available--no mremap()")
                    raise OSError(errno.ENOMEM, "Cannot allocate memory")
                super().resize(size)

        def new_mapping(*args: Any, **kwargs: Any) -> mmap.mmap:
            if kernel.refuse == "map":
                raise OSError(errno.ENOMEM, "Cannot allocate memory")
            return Mapping(*args, **kwargs)

        self.module = _module_like_mmap()
        self.module.mmap = new_mapping


@pytest.mark.parametrize(
    "refused",
    [
        "map",
        pytest.param(
            "advise",
            marks=pytest.mark.skipif(
                not hasattr(mmap, "MADV_NOHUGEPAGE"), reason="no MADV_NOHUGEPAGE here"
            ),
        ),
        "grow",
        "shrink",
        "grow-no_mremap",
        "shrink-no_mremap",
    ],
)
def test_each_refused_kernel_call_takes_upstreams_path(
    monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """The kernel refuses one call (``ENOMEM``; or a Python without ``mremap`` refuses a
    resize with ``SystemError``): no error reaches the output processor, the count names
    the call, and the finished rows (after a trim too) are upstream's concatenation."""
    kernel = _Kernel()
    refused, _, no_mremap = refused.partition("-")
    kernel.error = SystemError if no_mremap else OSError
    monkeypatch.setattr(response_rows, "mmap", kernel.module)
    monkeypatch.setattr(response_rows, "MAPPED_FROM", 64)
    monkeypatch.setattr(response_rows, "FOLD", 8)
    rng = np.random.default_rng(11)
    chunks = [_rows(rng, 3)] + [_rows(rng, 1) for _ in range(900)] + [_rows(rng, 4)]
    upstream = list(chunks)
    gathered = response_rows.RowChunks()
    response_rows.COUNTERS.reset()
    kernel.refuse = refused
    for chunk in chunks:
        gathered.append(chunk)
    gathered[-1] = chunks[-1][:2]  # upstream's trim of tokens past a stop string
    upstream[-1] = chunks[-1][:2]
    out = _finish(gathered)
    _same(out, np.concatenate(upstream, axis=0))
    assert out.flags.c_contiguous and out.flags.writeable
    assert dict(response_rows.COUNTERS.fallback) == {refused: 1}
    assert gathered.gathered == (refused == "shrink")
    if refused == "shrink":  # a copy of its own; the buffer keeps the rows as they were
        assert out.flags.owndata and out.base is None
        _same(gathered.array(), out)
    assert f"upstream's path: {refused} 1" in response_rows.live_note()
    assert response_rows.SPEC.live_note is response_rows.live_note


_AT_THE_LIMIT = """
import ctypes, errno, json, mmap, types
import numpy as np
from prime_r3.fixes import response_rows

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_NORESERVE, M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = 0x4000, -1, -3
FAILED = ctypes.c_void_p(-1).value

# A warm heap, as a long-running server's: arrays come from memory malloc already has
# (glibc moves its mmap threshold up to the sizes it frees), so upstream's concatenation
# needs no new mapping at the limit.
assert libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
warm = np.ones(24 << 20, np.uint8)
del warm


def finish(chunks):
    def upstream(token_ids, finish_reason, stop_reason):
        rows = np.concatenate(chunks, axis=0) if chunks else None
        return types.SimpleNamespace(finish_reason=finish_reason, routed_experts=rows)

    state = types.SimpleNamespace(routed_experts_chunks=chunks)
    wrapper = response_rows._new_completion_output({})
    return wrapper(upstream, state, ([7], "length", None), {}).routed_experts


# Requests in flight, each past MAPPED_FROM: the kernel merges their mappings.
response_rows.FOLD = 1  # every chunk folded as it comes
rng = np.random.default_rng(12)
requests = []
for _ in range(16):
    # the first chunk maps room for twice its rows: the later ones need no growth
    chunks = [rng.integers(0, 255, (n, 46, 8), dtype=np.uint8) for n in (300, 10, 10)]
    gathered = response_rows.RowChunks()
    for chunk in chunks:
        gathered.append(chunk)
    assert type(gathered._rows) is mmap.mmap
    requests.append((gathered, chunks))
crossing = [rng.integers(0, 255, (n, 46, 8), dtype=np.uint8) for n in (10, 300, 300)]
late = response_rows.RowChunks()
late.append(crossing[0])  # under MAPPED_FROM: upstream's list; the next chunk maps
assert late._rows is None
response_rows.COUNTERS.reset()

# The map count filled: every other page of one mapping gets another protection.
page, limit = mmap.PAGESIZE, int(open("/proc/sys/vm/max_map_count").read())
flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
base = libc.mmap(None, (limit + 64) * page, 0, flags, -1, 0)  # PROT_NONE
assert base not in (None, FAILED), ctypes.get_errno()
filled = 0
for i in range(1, limit + 64, 2):
    if libc.mprotect(base + i * page, page, mmap.PROT_READ) != 0:
        filled = ctypes.get_errno()
        break

errors, upstream_errors, equal = [], [], []
for chunk in crossing[1:]:
    late.append(chunk)
for gathered, chunks in [*requests, (late, crossing)]:
    try:  # upstream's finish in this state
        expected = np.concatenate(chunks, axis=0)
    except Exception as error:
        upstream_errors.append(repr(error))
        continue
    try:
        got = finish(gathered)
    except Exception as error:
        errors.append(repr(error))
        continue
    equal.append(got.dtype == expected.dtype and bool(np.array_equal(got, expected)))
print(json.dumps({
    "filled": errno.errorcode.get(filled, filled),
    "upstream_errors": upstream_errors,
    "errors": errors,
    "equal": equal,
    "fallback": dict(response_rows.COUNTERS.fallback),
}))
"""


@pytest.mark.skipif(not LINUX, reason="vm.max_map_count is Linux's")
def test_a_finish_at_the_map_count_limit_gets_upstreams_rows() -> None:
    """The issue's crash: at ``vm.max_map_count`` the shrink at finish must split a
    mapping the kernel merged with its neighbours and fails (``ENOMEM``); upstream's
    concatenation succeeds there, and so must every finish here, with upstream's rows;
    so must a request whose rows cross ``MAPPED_FROM`` at the limit (the kernel then
    gives it a mapping or not: either way no error, upstream's rows)."""
    limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    if limit > 1 << 20:
        pytest.skip(f"vm.max_map_count is {limit}: too many mappings to fill in a test")
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_AT_THE_LIMIT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.splitlines()[-1])
    assert got["filled"] == "ENOMEM", got  # mprotect refused: the map count is full
    assert got["upstream_errors"] == [], got  # a state where upstream's finish succeeds
    assert got["errors"] == [], got
    assert got["equal"] == [True] * 17, got
    assert got["fallback"].get("shrink", 0) >= 1, got  # the merged mappings' shrinks
    assert set(got["fallback"]) <= {"shrink", "map", "advise", "grow"}, got


def test_mappings_of_requests_in_flight_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``MAX_IN_FLIGHT`` mappings of requests in flight, a request keeps upstream's
    list of chunks; one handed out at finish or dropped with its request (an abort)
    frees its place."""
    gc.collect()
    monkeypatch.setattr(response_rows, "MAPPED_FROM", 64)
    monkeypatch.setattr(response_rows, "FOLD", 1)
    base = len(response_rows._IN_FLIGHT)
    monkeypatch.setattr(response_rows, "MAX_IN_FLIGHT", base + 2)
    rng = np.random.default_rng(13)
    response_rows.COUNTERS.reset()
    requests = [(response_rows.RowChunks(), []) for _ in range(3)]
    for _ in range(40):  # one step: a chunk for each request in flight
        for gathered, chunks in requests:
            chunks.append(_rows(rng, 1))
            gathered.append(chunks[-1])
    assert [g.gathered for g, _ in requests] == [True, True, False]
    assert dict(response_rows.COUNTERS.fallback) == {"mappings_in_flight": 1}
    assert len(response_rows._IN_FLIGHT) == base + 2
    assert f"mappings in flight {base + 2} of {base + 2}" in response_rows.live_note()
    finished = [_finish(g) for g, _ in requests[:1] + requests[2:]]
    for out, (_, chunks) in zip(finished, requests[:1] + requests[2:], strict=True):
        _same(out, np.concatenate(chunks, axis=0))
    del requests[1]  # aborted: its state, and its mapping, dropped
    assert len(response_rows._IN_FLIGHT) == base
    for _ in range(2):
        chunks = [_rows(rng, 40)]
        gathered = response_rows.RowChunks()
        gathered.append(chunks[0])
        assert gathered.gathered and type(gathered._rows) is mmap.mmap
        _same(_finish(gathered), chunks[0])
    assert dict(response_rows.COUNTERS.fallback) == {"mappings_in_flight": 1}


def _address(mapping: mmap.mmap) -> int:
    view = np.frombuffer(mapping, np.uint8, count=1)
    address = view.ctypes.data
    del view  # no export left: the mapping may still resize
    return address


def _resident_pages(address: int, length: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(address, length, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def _vm_flags(address: int) -> list[str]:
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.mark.skipif(
    not LINUX or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs transparent huge pages (enabled: always or madvise)",
)
def test_rows_mappings_hold_only_their_rows_pages_under_thp_always(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each mapping is advised ``MADV_NOHUGEPAGE``: on a mapping THP treats as ``always``
    does (``MADV_HUGEPAGE`` on the mapping itself, so the host is left as it is), the
    requests in flight hold exactly the pages their rows were written to. Without the
    advice, the first touch of an untouched aligned 2 MiB range makes all of it resident."""

    class AlwaysHuge(mmap.mmap):
        def __new__(cls, *args: Any, **kwargs: Any) -> AlwaysHuge:
            mapping = super().__new__(cls, *args, **kwargs)
            mapping.madvise(mmap.MADV_HUGEPAGE)
            return mapping

    module = _module_like_mmap()
    module.mmap = AlwaysHuge
    monkeypatch.setattr(response_rows, "mmap", module)
    rng = np.random.default_rng(14)
    requests = [response_rows.RowChunks() for _ in range(8)]
    row = rng.integers(0, 255, (1, 46, 8), dtype=np.uint8)
    for _ in range((5 << 20) // row.nbytes):  # 5 MiB of rows each, one row per step
        for gathered in requests:
            gathered.append(row)
    mappings = [gathered._rows for gathered in requests]
    assert all(isinstance(mapping, AlwaysHuge) for mapping in mappings)
    addresses = [_address(mapping) for mapping in mappings]
    resident = [_resident_pages(a, len(m)) for a, m in zip(addresses, mappings, strict=True)]
    written = [-(-gathered._size // mmap.PAGESIZE) for gathered in requests]
    assert resident == written  # pages, each request: its rows' pages, not one more
    for address in addresses:
        assert "nh" in _vm_flags(address) and "hg" not in _vm_flags(address)


@pytest.mark.parametrize("refused", ["map", "advise", "mappings_in_flight"])
def test_a_first_chunk_past_the_buffer_refused_its_mapping_is_upstreams(
    monkeypatch: pytest.MonkeyPatch, refused: str
) -> None:
    """A long prompt's rows arrive as one first chunk past ``MAPPED_FROM``: a refused
    mapping (or no place left in flight) leaves upstream's list as it is, no error."""
    kernel = _Kernel()
    monkeypatch.setattr(response_rows, "mmap", kernel.module)
    monkeypatch.setattr(response_rows, "MAPPED_FROM", 64)
    monkeypatch.setattr(response_rows, "FOLD", 1)
    if refused == "mappings_in_flight":
        monkeypatch.setattr(response_rows, "MAX_IN_FLIGHT", 0)
    else:
        kernel.refuse = refused
    rng = np.random.default_rng(5)
    chunks = [_rows(rng, 40)] + [_rows(rng, 1) for _ in range(3)]
    gathered = response_rows.RowChunks()
    response_rows.COUNTERS.reset()
    for chunk in chunks:
        gathered.append(chunk)
    _same(_finish(gathered), np.concatenate(chunks, axis=0))
    assert dict(response_rows.COUNTERS.fallback) == {refused: 1}


def test_advice_refused_for_want_of_thp_keeps_the_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """``EINVAL`` from ``MADV_NOHUGEPAGE``: a kernel without THP has no huge pages to
    avoid; the rows stay mapped and are handed out as such."""
    kernel = _Kernel()
    kernel.refuse = "advise_no_thp"
    monkeypatch.setattr(response_rows, "mmap", kernel.module)
    monkeypatch.setattr(response_rows, "MAPPED_FROM", 64)
    monkeypatch.setattr(response_rows, "FOLD", 4)
    rng = np.random.default_rng(6)
    chunks = [_rows(rng, 1) for _ in range(50)]
    gathered = response_rows.RowChunks()
    response_rows.COUNTERS.reset()
    for chunk in chunks:
        gathered.append(chunk)
    out = _finish(gathered)
    _same(out, np.concatenate(chunks, axis=0))
    assert not response_rows.COUNTERS.fallback
    assert gathered._handed  # the mapping itself went out with the output


def test_a_streaming_input_requests_finish_lends_no_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A streaming-input request's state lives on after a finish: the output gets a copy,
    so a consumer writing to it cannot change the rows a later finish reads."""
    monkeypatch.setattr(response_rows, "MAPPED_FROM", 64)
    monkeypatch.setattr(response_rows, "FOLD", 2)
    rng = np.random.default_rng(7)
    chunks = [_rows(rng, 40) for _ in range(3)]
    gathered = response_rows.RowChunks()
    for chunk in chunks:
        gathered.append(chunk)
    assert gathered.gathered and len(gathered) == 1  # the third chunk not folded yet
    response_rows.COUNTERS.reset()
    out = _finish(gathered, streaming_input=True)
    _same(out, np.concatenate(chunks, axis=0))
    out[:] = 0  # the consumer's to change
    more = _rows(rng, 2)
    gathered.append(more)
    _same(_finish(gathered), np.concatenate([*chunks, more], axis=0))
    assert response_rows.COUNTERS.fallback["streaming_input"] == 1
