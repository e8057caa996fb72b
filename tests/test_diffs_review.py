"""Review findings on the upstream-form diffs (02's split take, 06's block
batches).

Each test drives the patched ``connector.py`` or ``store.py`` of the installed release (built with
``scripts/patches.py apply``, loaded as a module of its own) against the installed
upstream, on inputs the scenarios in ``tests/diffs_scenarios.py`` do not reach. Every
release expects the same thing: the diff behaves as the installed upstream does.
"""

from __future__ import annotations

import importlib.util
import inspect
import pickle
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from tests.test_upstream_diffs import RELEASE, SITE, patches

CONNECTOR = "vllm/distributed/aux_output_connector/connector.py"
STORE = "vllm/distributed/aux_output_connector/store.py"


@pytest.fixture(scope="module")
def patched_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(patches.apply(SITE, RELEASE, tmp_path_factory.mktemp("review_vllm")))


def _patched_module(tree: Path, path: str, name: str) -> ModuleType:
    """One file of the patched tree as a module of its own."""
    spec = importlib.util.spec_from_file_location(name, tree / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def patched_connector(patched_tree: Path) -> ModuleType:
    """The release's connector.py with its diffs applied, as a module of its own."""
    return _patched_module(patched_tree, CONNECTOR, "review_patched_connector")


@pytest.fixture(scope="module")
def patched_store(patched_tree: Path) -> ModuleType:
    """The release's store.py with its diffs applied, as a module of its own."""
    return _patched_module(patched_tree, STORE, "review_patched_store")


def test_an_empty_block_batch_puts_as_an_empty_list(patched_store: ModuleType) -> None:
    """06's BlockObjectBatch of no objects over a (0, n) buffer (what an empty gather of
    the block buffer is): put with a release does what upstream's put of an empty list
    does, and the batch iterates as nothing. A memoryview with a zero in its shape
    cannot be cast, which raised after the release had been applied."""
    from vllm.distributed.aux_output_connector.store import BlockObjectStore

    empty = patched_store.BlockObjectBatch([], memoryview(np.empty((0, 8), np.uint8)))
    assert list(empty) == []
    found = []
    for store, objects in (
        (BlockObjectStore(max_bytes=64, object_nbytes=8), []),
        (patched_store.BlockObjectStore(max_bytes=64, object_nbytes=8), empty),
    ):
        store.put([], retain_keys=["a", "a"])
        store.put(objects, release_keys=["a"])
        found.append(dict(store._references))
    assert found == [{"a": 1}, {"a": 1}]


def _connector(connector_type: type) -> Any:
    """A connector built as the release's real Scheduler builds it."""
    if len(inspect.signature(connector_type.__init__).parameters) > 1:  # 0.33
        from tests.test_packed_outputs import real_vllm

        scheduler = real_vllm().scheduler
        return connector_type(scheduler.kv_cache_manager, scheduler.connector)
    return connector_type()


def _step(patched_connector: ModuleType) -> Any:
    outputs = {
        f"r{i}": patched_connector.AuxRequestOutput(
            10 * i, np.arange(6 * i, 6 * i + 6, dtype=np.uint16).reshape(3, 2)
        )
        for i in range(4)
    }
    return patched_connector.PackedAuxOutputs.pack(outputs, np.dtype(np.uint16), (2,))


def test_a_step_being_split_reads_whole_from_another_thread(
    patched_connector: ModuleType,
) -> None:
    """Upstream's received dict reads the same from any thread at any time. The split
    step is mutated by its first lookup; a lookup or a pickle from another thread while
    that first lookup is finishing its split must see every request's rows. The trace
    stops the first lookup's thread as ``_split`` returns (deterministic interleaving)."""
    step = _step(patched_connector)
    split = type(step)._split.__code__
    paused, resume = threading.Event(), threading.Event()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not split:
            return None

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "return":
                paused.set()
                resume.wait(30)
            return local

        return local

    def first() -> None:
        sys.settrace(tracer)
        try:
            step.lookup("r0")
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert paused.wait(30)
        found = step.lookup("r2")
        try:
            again = pickle.loads(pickle.dumps(step))
            pickled: Any = [again.lookup(f"r{i}")[1].tolist() for i in range(4)]
        except Exception as error:  # noqa: BLE001 - compared below
            pickled = repr(error)
    finally:
        resume.set()
        thread.join(30)
    assert found is not None and found[0] == 20
    assert found[1].tolist() == [[12, 13], [14, 15], [16, 17]]
    assert pickled == [np.arange(6 * i, 6 * i + 6).reshape(3, 2).tolist() for i in range(4)]
    assert step.lookup("r3") is not None


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("diff_pending", "no diff yet, for a reason long enough", "both"),
        ("diff_in", "batched_take", "itself"),
    ],
)
def test_a_contradictory_diff_record_fails_at_parse_time(
    field: str, value: str, words: str
) -> None:
    """A record both carried by another diff and pending a diff of its own passed every
    check silently (``registry_mismatch`` counts it in both lists and reports nothing);
    one carried by its own diff is never linked to one. Both are refused when built."""
    import dataclasses

    from prime_r3.patches import REGISTRY

    spec = next(s for s in REGISTRY if s.name == "batched_take")
    assert spec.diff_in == "packed_outputs"
    with pytest.raises(ValueError, match=rf"batched_take.*{field}.*{words}"):
        dataclasses.replace(spec, **{field: value})


@pytest.mark.parametrize(
    "value",
    [(("0.33.0", ""),), (("0.33.0",),), ("0.33.0",), ((0.33, "not ported"),)],
)
def test_a_malformed_per_release_diff_pending_fails_at_parse_time(value: Any) -> None:
    """``diff_pending`` as ``(release, reason)`` pairs (batched_commit's): a pair with an
    empty reason, a missing half, a bare string inside the tuple or a release that is
    not a string would make ``diff_pending_for`` answer wrongly or crash later; refused
    when the record is built, naming the patch, the value and the valid choices."""
    import dataclasses

    from prime_r3.patches import REGISTRY

    spec = next(s for s in REGISTRY if s.name == "batched_commit")
    with pytest.raises(ValueError, match=r"batched_commit.*diff_pending=.*valid choices"):
        dataclasses.replace(spec, diff_pending=value)


# -- upstream's tested contracts (issue 27: vLLM's own tests on the patched tree) ----------


def _take(connector: Any, request: Any, output: Any) -> Any:
    try:
        rows = connector.take_output(request, output)
    except AssertionError as error:
        return ("raise", str(error))
    return ("rows", None if rows is None else (rows.tolist(), rows.base is not None))


def test_take_output_of_a_plain_dict_is_upstreams(
    reverted: pytest.MonkeyPatch, patched_connector: ModuleType
) -> None:
    """02 keeps take_output's contract for a dict from any producer (vLLM's scheduler
    tests hand it one): same rows, a view of the dict's rows as upstream's slice, the
    same assertion messages for a missing request, None, and past-the-end rows."""
    from types import SimpleNamespace

    from vllm.distributed.aux_output_connector import connector as upstream

    def request(request_id: str, num_tokens: int, finished: bool = False) -> Any:
        return SimpleNamespace(
            request_id=request_id, num_tokens=num_tokens, is_finished=lambda: finished
        )

    cases = [
        (request("a", 5), True),  # all 3 rows accepted
        (request("a", 4), True),  # the first 2
        (request("a", 1), True),  # before the output: None
        (request("a", 9), True),  # past its rows: assertion
        (request("a", 1, finished=True), True),
        (request("b", 4), True),  # missing
        (request("a", 4), False),  # no output at all
    ]
    found = {}
    for module in (upstream, patched_connector):
        rows = np.arange(6, dtype=np.uint8).reshape(3, 2)
        step = {"a": module.AuxRequestOutput(1, rows)}
        connector = _connector(module.AuxOutputSchedulerConnector)
        found[module] = [_take(connector, r, step if has else None) for r, has in cases]
    assert found[patched_connector] == found[upstream]
    assert found[upstream][0] == ("rows", ([[0, 1], [2, 3], [4, 5]], True))
    assert [kind for kind, _ in found[upstream]].count("raise") == 4


def test_capture_keeps_upstreams_signature_and_blocks(patched_tree: Path) -> None:
    """06 keeps RoutedExpertsBuffer.capture(request_id, token_start, rows) (vLLM's
    buffer tests call it so); the worker's row-keyed form is capture_row beside it.
    The same captures give the same completed blocks and errors as upstream's."""
    if "batched_commit" not in [d.name for d in patches.series(RELEASE)]:
        pytest.skip(f"no 06 diff for vLLM {RELEASE}")
    from vllm.distributed.aux_output_connector.routed_experts import RoutedExpertsBuffer

    patched = _patched_module(
        patched_tree,
        "vllm/distributed/aux_output_connector/routed_experts.py",
        "review_patched_routed_experts",
    ).RoutedExpertsBuffer
    assert inspect.signature(patched.capture) == inspect.signature(RoutedExpertsBuffer.capture)
    assert "request_row" in inspect.signature(patched.capture_row).parameters

    def run(buffer_type: type) -> list[Any]:
        buffer = buffer_type(np.dtype(np.uint8), (2,), 4, 2, 8, 2)
        rows = np.arange(40, dtype=np.uint8).reshape(20, 2)
        found: list[Any] = []
        for request_id, start, end in [
            ("a", 0, 3), ("b", 0, 1), ("a", 3, 5), ("b", 1, 9), ("c", 0, 1), ("a", 9, 10),
        ]:  # fmt: skip
            try:
                blocks = buffer.capture(request_id, start, rows[start:end])
            except AssertionError as error:
                found.append(("raise", str(error)))
                continue
            found.append([(block_start, block.tolist()) for block_start, block in blocks])
        return found

    upstream = run(RoutedExpertsBuffer)
    assert run(patched) == upstream
    assert upstream[-1][0] == "raise" and any(blocks for blocks in upstream[:-1])
