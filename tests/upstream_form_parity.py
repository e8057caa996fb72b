"""The upstream-form worker connector (06-batched_commit) against the
installed release's own, through the differential harness (tests/batched_harness.py).

Run in a subprocess with a patched tree (``scripts/patches.py apply --out``) first on
``sys.path`` and ``PRIME_R3=0``: ``vllm.distributed.aux_output_connector.worker`` is then
the diffs' connector with its array-held request state. The reference is the installed
vLLM's own ``worker.py``, ``routed_experts.py`` and ``connector.py``, loaded from the
site by file path under alias names (the worker's ``routed_experts`` import bound to the
pristine module while it loads), so it runs upstream's code, not a copy. Both sides run
the real ``prepare_output``/``enqueue_cpu_copy``/``process_output``/``begin_step`` of
their module; the reference side's consumer is the installed ``take_output`` (dict
outputs), the patched side's the patched tree's (packed outputs).

    python -m tests.upstream_form_parity OUT.pickle --site SITE --seeds 0:200 --steps 300
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import sys
import time
from collections import Counter
from pathlib import Path
from types import MethodType, ModuleType
from typing import Any

PACKAGE = "vllm.distributed.aux_output_connector"


def _load(site: Path, name: str, alias: str, bind: dict[str, ModuleType]) -> ModuleType:
    """``site``'s ``vllm/.../<name>.py`` as module ``alias``; while it executes, the
    modules in ``bind`` stand in for their names (its ``from ... import`` lines)."""
    path = site / PACKAGE.replace(".", "/") / f"{name}.py"
    spec = importlib.util.spec_from_file_location(alias, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    saved = {key: sys.modules[key] for key in bind}
    sys.modules.update(bind)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.update(saved)
    return module


def pristine_modules(site: Path) -> dict[str, ModuleType]:
    """The installed release's routed_experts, connector and worker modules."""
    import importlib

    for name in ("routed_experts", "connector", "worker"):
        importlib.import_module(f"{PACKAGE}.{name}")  # the patched tree's, loaded first
    routed = _load(site, "routed_experts", "pristine_routed_experts", {})
    connector = _load(site, "connector", "pristine_connector", {})
    worker = _load(
        site,
        "worker",
        "pristine_worker",
        {f"{PACKAGE}.routed_experts": routed, f"{PACKAGE}.connector": connector},
    )
    return {"routed_experts": routed, "connector": connector, "worker": worker}


def run(site: Path, seeds: range, steps: int, shapes: str) -> dict[str, Any]:
    import vllm.distributed.aux_output_connector.worker as patched_worker
    from vllm.distributed.aux_output_connector.connector import AuxOutputSchedulerConnector

    from tests import batched_harness as harness

    pristine = pristine_modules(site)
    assert Path(pristine["worker"].__file__).is_relative_to(site)
    assert not Path(patched_worker.__file__).is_relative_to(site)
    assert hasattr(patched_worker, "_WorkerRequests"), "the patched tree has no 06 diff"
    assert hasattr(pristine["worker"], "_WorkerRequestState")
    # The installed take_output reads the installed worker's dict outputs; the patched
    # tree's reads packed ones.
    upstream_take = pristine["connector"].AuxOutputSchedulerConnector.take_output
    harness.TAKE = MethodType(
        upstream_take, object.__new__(pristine["connector"].AuxOutputSchedulerConnector)
    )
    harness.live_take = lambda: object.__new__(AuxOutputSchedulerConnector).take_output

    class Episode(harness.Episode):
        real_prepare = True
        compare_pickles = False  # the diffs hold the state in arrays: values compared

        def __init__(self, seed: int, shape: Any, async_scheduling: bool) -> None:
            super().__init__(seed, shape, async_scheduling)
            self.close()
            self.sides = {
                "upstream": harness.make_connector(shape, False, pristine["worker"]),
                "patched": harness.make_connector(shape, False, patched_worker),
            }
            _count_paths(self.sides["patched"], paths)

    paths: Counter[str] = Counter()
    seen: Counter[str] = Counter()
    ends: Counter[Any] = Counter()
    total_steps = checks = 0
    episodes = 0
    for seed in seeds:
        if shapes == "ci":
            # As tests/test_batched_commit.py's differential test: mostly roomy stores,
            # some that evict and overflow, every tenth behind the background writer.
            shape_list = [
                harness.Shape(
                    store_slots=(1024, 1024, 160, 96)[seed % 4], background=seed % 10 == 0
                )
            ]
        else:  # other hash block sizes, and pools that run dry
            shape_list = [
                harness.Shape(
                    block=block,
                    max_num_seqs=12,
                    max_batched_tokens=32,
                    store_slots=(1024, 96)[seed % 2],
                    free_slots=free_slots,
                )
                for block in (1, 2, 3, 8)
                for free_slots in (None, 5, 9)
            ]
        for shape in shape_list:
            episode = Episode(seed, shape, async_scheduling=seed % 2 == 1)
            try:
                for _ in range(steps):
                    episode.step()
            except harness.EpisodeOver:
                pass
            finally:
                episode.close()
            episodes += 1
            seen.update(episode.seen)
            ends[episode.dead] += 1
            total_steps += episode.steps
            checks += episode.checks
    return {
        "episodes": episodes,
        "steps": total_steps,
        "checks": checks,
        "seen": dict(seen),
        "paths": dict(paths),
        "ends": dict(ends),
        "patched_file": patched_worker.__file__,
        "pristine_file": pristine["worker"].__file__,
    }


def crafted(site: Path) -> dict[str, Any]:
    """Steps the randomised workload never makes, each on both sides: the same error
    (or none), outputs and worker state. Returns what each case ended with."""
    import numpy as np
    import vllm.distributed.aux_output_connector.worker as patched_worker
    from vllm.distributed.aux_output_connector.connector import AuxOutputConnectorMetadata

    from tests import batched_harness as harness

    pristine = pristine_modules(site)
    shape = harness.Shape(block=4, token_shape=(3, 2), dtype=np.uint16)

    def sides() -> dict[str, Any]:
        return {
            "upstream": harness.make_connector(shape, False, pristine["worker"]),
            "patched": harness.make_connector(shape, False, patched_worker),
        }

    def meta(requests: dict[str, int], finished: tuple[str, ...] = ()) -> Any:
        return AuxOutputConnectorMetadata(0, requests, {}, finished)

    def pending(
        connector: Any,
        ids: list[str],
        starts: list[int],
        sizes: list[int],
        query_start_loc: list[int] | None = None,
    ) -> Any:
        """The step's PendingAuxOutput from the connector's prepare_output; the rows
        are ``query_start_loc``'s last value (default: the sizes' cumulative sum)."""
        if query_start_loc is None:
            query_start_loc = np.concatenate(([0], np.cumsum(sizes))).tolist()
        total = query_start_loc[-1]
        rows = np.arange(total * 6, dtype=np.uint16).reshape(total, 3, 2)
        batch = harness._InputBatch(
            req_ids=ids,
            query_start_loc_np=np.array(query_start_loc, np.int32),
            num_computed_tokens_np=np.array(starts, np.int32),
        )
        connector._capturer = harness._Capturer(rows)
        out = connector.prepare_output(batch)
        out.enqueue_cpu_copy(np.ones(len(ids), np.int32), np.zeros(len(ids), np.int32))
        return out

    def both(action: Any) -> tuple[Any, Any]:
        """``action(connector)`` on both sides: (error or output state, worker state)."""
        found = {}
        for name, connector in connections.items():
            try:
                result = harness.output_state(action(connector))
            except Exception as error:  # noqa: BLE001
                result = harness.error_of(error)
            found[name] = (result, harness.worker_state(connector))
        assert found["upstream"] == found["patched"], found
        stores = [connector for connector in connections.values()]
        assert harness.store_calls(stores[0]) == harness.store_calls(stores[1])
        assert harness.store_state(stores[0]) == harness.store_state(stores[1])
        return found["patched"]

    ends: dict[str, Any] = {}
    # A settled request whose emit start is ahead of the worker's emit cursor: begin_step
    # adds the new requests before it, not those after, then raises.
    connections = sides()
    both(lambda c: c.begin_step(meta({"a": 0, "b": 0})))
    both(lambda c: pending(c, ["a", "b"], [0, 0], [3, 2]).process_output())
    ends["emit_ahead"] = both(lambda c: c.begin_step(meta({"n1": 0, "a": 5, "n2": 0, "b": 0})))
    # A step naming a request the worker does not know: prepare_output counts the ones
    # before it, then raises KeyError.
    connections = sides()
    both(lambda c: c.begin_step(meta({"a": 0, "b": 0})))
    ends["unknown_in_prepare"] = both(lambda c: pending(c, ["a", "x", "b"], [0, 0, 0], [1, 1, 1]))
    # A request listed twice in one step (its second capture moves backwards), and a
    # repeated request whose first capture kept nothing.
    connections = sides()
    both(lambda c: c.begin_step(meta({"a": 0, "b": 0})))
    both(lambda c: pending(c, ["a", "b"], [0, 0], [4, 4]).process_output())
    both(lambda c: c.begin_step(meta({"a": 4, "b": 4})))
    ends["repeated"] = both(
        lambda c: pending(c, ["a", "b", "a"], [4, 4, 4], [1, 1, 1]).process_output()
    )
    # Decodes on both sides of a run of other requests, a new aligned tail, a tail that
    # completes, and a finished request torn down by the step that covered it.
    connections = sides()
    both(lambda c: c.begin_step(meta({"a": 0, "b": 0, "c": 0})))
    both(lambda c: pending(c, ["a", "b", "c"], [0, 0, 0], [3, 4, 5]).process_output())
    both(lambda c: c.begin_step(meta({"a": 3, "b": 4, "c": 5})))
    step = {}
    for name, connector in connections.items():
        step[name] = pending(connector, ["a", "c", "b"], [3, 5, 4], [1, 2, 1])
    both(lambda c: c.begin_step(meta({}, finished=("a",))))
    ends["mixed_then_teardown"] = both(
        lambda c: step["upstream" if c is connections["upstream"] else "patched"].process_output()
    )
    for connector in connections.values():
        connector.close()
    # A query_start_loc that falls back below a one-token request's end (the model
    # runner never makes one): upstream slices no rows for that request and raises at
    # the next one, whose token count is negative, not an IndexError for the row.
    connections = sides()
    both(lambda c: c.begin_step(meta({"a": 0, "b": 0, "c": 0})))
    both(lambda c: pending(c, ["a", "b", "c"], [0, 0, 0], [2, 1, 1]).process_output())
    both(lambda c: c.begin_step(meta({"a": 2, "b": 1, "c": 1})))
    ends["decode_past_rows"] = both(
        lambda c: pending(c, ["a", "b", "c"], [2, 1, 1], [], [0, 2, 3, 2]).process_output()
    )
    for connector in connections.values():
        connector.close()
    # Decode runs completing blocks whose keys have not arrived (they wait for them,
    # held by the buffer, between requests whose keyed blocks are published from their
    # slots) until a later begin_step brings them; and one decode run opening more new
    # tails than the buffer has tail rows (its tail arrays grow).
    from vllm.distributed.aux_output_connector.connector import PackedBlockHashes

    def hashes(ids: list[str], number: int) -> dict[str, Any]:
        return {i: PackedBlockHashes(f"{i:>6}{number:02}".encode(), 8) for i in ids}

    connections = sides()
    ids = [f"r{index}" for index in range(2 * shape.max_num_seqs)]
    both(lambda c: c.begin_step(AuxOutputConnectorMetadata(0, dict.fromkeys(ids, 0), {}, ())))
    both(lambda c: pending(c, ids, [0] * len(ids), [4] * len(ids)).process_output())
    both(lambda c: c.begin_step(AuxOutputConnectorMetadata(0, {}, hashes(ids, 0), ())))
    for token in range(4, 8):
        both(lambda c, t=token: c.begin_step(meta(dict.fromkeys(ids, t))))
        if token == 7:  # the keys of block 1 for every third request only
            both(lambda c: c.begin_step(AuxOutputConnectorMetadata(0, {}, hashes(ids[::3], 1), ())))
        ends[f"decode_{token}"] = both(
            lambda c, t=token: pending(c, ids, [t] * len(ids), [1] * len(ids)).process_output()
        )
    waiting = [i for i in ids if i not in ids[::3]]
    ends["keys_after_blocks"] = both(
        lambda c: c.begin_step(AuxOutputConnectorMetadata(0, {}, hashes(waiting, 1), ()))
    )
    for connector in connections.values():
        connector.close()
    # A worker row reused by a new request after its former tenant, torn down, left a
    # tail there (06 keeps a request's buffer tail in its worker row): the newcomer's
    # first decode finds no tail and opens one in the decode run, as upstream's capture
    # does. The stale row's tail arrays (block start 0, 3 rows) must not count.
    connections = sides()
    both(lambda c: c.begin_step(meta({"a": 0, "b": 0})))
    both(lambda c: pending(c, ["a", "b"], [0, 0], [3, 2]).process_output())
    patched = connections["patched"]
    a_row = patched._requests.rows["a"]
    both(lambda c: c.begin_step(meta({"b": 2}, finished=("a",))))
    both(lambda c: c.begin_step(AuxOutputConnectorMetadata(0, {"c": 0}, hashes(["c"], 0), ())))
    assert patched._requests.rows["c"] == a_row
    both(lambda c: pending(c, ["b", "c"], [2, 0], [1, 4]).process_output())
    both(lambda c: c.begin_step(meta({"b": 3, "c": 4})))
    ends["row_reused"] = both(lambda c: pending(c, ["b", "c"], [3, 4], [1, 1]).process_output())
    assert patched._buffer._requests == {"c": a_row}
    for connector in connections.values():
        connector.close()
    # A request finished while a step covered it is scheduled again (the scheduler never
    # does) and torn down by that step's process_output between begin_step and
    # prepare_output: upstream's lookup raises KeyError for it, and so must the patched side.
    connections = sides()
    both(lambda c: c.begin_step(meta({"a": 0, "b": 0})))
    step = {name: pending(c, ["a", "b"], [0, 0], [1, 1]) for name, c in connections.items()}
    both(lambda c: c.begin_step(meta({"b": 1}, finished=("a",))))
    both(lambda c: c.begin_step(meta({"a": 1, "b": 1})))
    ends["freed_before_prepare"] = both(
        lambda c: step["upstream" if c is connections["upstream"] else "patched"].process_output()
    )
    ends["batch_row_freed"] = both(lambda c: pending(c, ["a", "b"], [1, 1], [1, 1]))
    for connector in connections.values():
        connector.close()
    # A begin_step that raises after it extended a request's keys (an unknown finished
    # request: KeyError before it publishes), so that request's block, completed before
    # its key, still waits; the next commit's visit publishes it, a plain decode or not.
    connections = sides()
    both(lambda c: c.begin_step(meta({"a": 0, "b": 0})))
    both(lambda c: pending(c, ["a", "b"], [0, 0], [3, 2]).process_output())
    both(lambda c: c.begin_step(meta({"a": 3, "b": 2})))
    ends["block_before_key"] = both(
        lambda c: pending(c, ["a", "b"], [3, 2], [1, 1]).process_output()
    )
    ends["raising_begin"] = both(
        lambda c: c.begin_step(AuxOutputConnectorMetadata(0, {}, hashes(["a"], 0), ("zz",)))
    )
    both(lambda c: c.begin_step(meta({"a": 4, "b": 3})))
    ends["visit_after_raise"] = both(
        lambda c: pending(c, ["a", "b"], [4, 3], [1, 1]).process_output()
    )
    for connector in connections.values():
        connector.close()
    # A step that is one run of plain decodes: 06 reads their rows as a slice of the
    # snapshot (consecutive tokens), and its packed output is still an array of its own,
    # as the gather made it (upstream's dict may alias the snapshot, so both sides cannot
    # tell: checked on the patched side, after the same step on both).
    connections = sides()
    both(lambda c: c.begin_step(meta({"a": 0, "b": 0})))
    both(lambda c: pending(c, ["a", "b"], [0, 0], [2, 2]).process_output())
    both(lambda c: c.begin_step(meta({"a": 2, "b": 2})))
    step = {name: pending(c, ["a", "b"], [2, 2], [1, 1]) for name, c in connections.items()}
    outputs = {}

    def process(connector: Any) -> Any:
        name = "upstream" if connector is connections["upstream"] else "patched"
        output = step[name].process_output()
        # The packed rows, before the comparison's first lookup splits the step.
        outputs[name] = getattr(output, "rows", None)
        return output

    ends["one_decode_run"] = both(process)
    snapshot = step["patched"].routed_experts
    assert len(outputs["patched"]) == 2 == len(snapshot)
    assert not np.shares_memory(outputs["patched"], snapshot)
    for connector in connections.values():
        connector.close()
    # A step without metadata (begin_step(None)) after a scheduled one: upstream drops
    # the step's metadata, so the request state alone holds its ids. The patched side
    # must hold no more of them.
    held = {}
    for name, connector in sides().items():
        request_id = "".join(["held-", name])  # a str of this side's own
        connector.begin_step(meta({request_id: 0}))
        connector.begin_step(None)
        held[name] = sys.getrefcount(request_id)
        connector.close()
    ends["ids_after_no_metadata"] = held
    assert held["upstream"] == held["patched"], held
    return ends


def _count_paths(connector: Any, paths: Counter[str]) -> None:
    """Count, on this connector, the requests its decode runs committed at once
    (``_commit_decodes``) and the captures its loop body made one at a time
    (``capture_row``, the buffer's capture keyed by the worker's row), so the
    test can tell that both paths ran (instance attributes over the class's)."""
    commit_decodes = connector._commit_decodes
    capture = connector._buffer.capture_row

    def counted_commit_decodes(pending: Any, rows: Any, first: int, last: int, *rest: Any) -> Any:
        paths["decodes_at_once"] += last - first
        paths["decode_runs"] += 1
        return commit_decodes(pending, rows, first, last, *rest)

    def counted_capture(*args: Any) -> Any:
        paths["loop_captures"] += 1
        return capture(*args)

    connector._commit_decodes = counted_commit_decodes
    connector._buffer.capture_row = counted_capture


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--site", type=Path, required=True)
    parser.add_argument("--seeds", default="0:200")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--shapes", choices=["ci", "small", "crafted"], default="ci")
    args = parser.parse_args()
    assert os.environ.get("PRIME_R3") == "0", "run with the overlay off (PRIME_R3=0)"
    first, last = (int(part) for part in args.seeds.split(":"))
    began = time.perf_counter()
    if args.shapes == "crafted":
        result = crafted(args.site.resolve())
    else:
        result = run(args.site.resolve(), range(first, last), args.steps, args.shapes)
    result["seconds"] = round(time.perf_counter() - began, 1)
    args.out.write_bytes(pickle.dumps(result))


if __name__ == "__main__":
    main()
