"""Generic consumers see upstream's dict content in a PackedAuxOutputs, on every side.

Semantics (issue 9 item 2): a ``PackedAuxOutputs`` *is* upstream's dict for any code
that is not pickle. On the writer side it holds upstream's own values; after a hop it
holds equal values (token starts as Python ints, rows as private arrays). So:

* msgspec and vLLM's ``MsgpackEncoder`` encode the content: identical bytes to
  upstream's dict on the writer side, and upstream's content after a hop (where a
  numpy-int token start that vLLM's encoder refuses upstream is a plain int here);
* ``dataclasses.asdict(ModelRunnerOutput)`` gives upstream's result;
* ``copy.copy`` is shallow (same value objects), ``copy.deepcopy`` deep, as for a dict;
* ``==`` is dict's (including numpy's "ambiguous truth value" where upstream has it);
* ``pop`` / ``del`` / ``[]=`` / ``update`` / ``clear`` / ``popitem`` / ``setdefault``
  work as on a dict, and a later pickle carries the mutated content (packed again, or
  upstream's plain dict when the content no longer packs). Replacing a value's rows
  before pickling is seen too.

Oracle: the same operation on upstream's dict (the one the worker produced, and its
plain-pickle copy for the received side).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import copy  # noqa: E402
import dataclasses  # noqa: E402
import pickle  # noqa: E402
from typing import Any  # noqa: E402

import msgspec  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from vllm.distributed.aux_output_connector.connector import AuxRequestOutput  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from prime_r3.packed import PackedAuxOutputs  # noqa: E402
from tests.test_packed_outputs import Req, assert_parity, make_step  # noqa: E402


def _step(int_starts: bool) -> dict[str, AuxRequestOutput]:
    outputs, _ = make_step(np.random.default_rng(5), 40, np.uint16, (4, 2))
    if int_starts:
        for value in outputs.values():
            value.token_start = int(value.token_start)
    return outputs


def _sides(outputs: dict[str, AuxRequestOutput]) -> dict[str, tuple[Any, Any]]:
    """(ours, upstream's) for the writer side and for after a protocol-5 pickle hop."""
    packed = PackedAuxOutputs.pack(outputs)
    return {
        "writer": (packed, outputs),
        "received": (
            pickle.loads(pickle.dumps(packed, protocol=5)),
            pickle.loads(pickle.dumps(outputs, protocol=5)),
        ),
    }


def _result(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return ("ok", fn(*args))
    except Exception as error:  # noqa: BLE001 - the failure itself is compared
        return ("raise", (type(error), str(error)))


def _plain(obj: Any) -> Any:
    """Content as builtins: arrays as (dtype, shape, bytes), numpy ints as int."""
    if isinstance(obj, dict):
        return {key: _plain(value) for key, value in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map(_plain, obj))
    return obj


def _numpy_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": obj.tobytes()}
    if isinstance(obj, np.integer):
        return int(obj)
    raise NotImplementedError(type(obj))


@pytest.mark.parametrize("side", ["writer", "received"])
def test_vllm_msgpack_encoder_sees_the_content(side: str) -> None:
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
    ours, theirs = _sides(_step(int_starts=True))[side]
    frames = encoder.encode(ours)
    assert [bytes(f) for f in frames] == [bytes(f) for f in encoder.encode(theirs)]
    assert len(decoder.decode(frames)) == 40
    # Upstream's worker mixes numpy-int token starts in, which vLLM's encoder refuses:
    # the writer side refuses identically; after a hop they are ints and encode.
    ours, theirs = _sides(_step(int_starts=False))[side]
    if side == "writer":
        assert _result(encoder.encode, ours) == _result(encoder.encode, theirs)
        assert _result(encoder.encode, theirs)[0] == "raise"
    else:
        as_ints = {k: AuxRequestOutput(int(v.token_start), v.rows) for k, v in theirs.items()}
        assert [bytes(f) for f in encoder.encode(ours)] == [
            bytes(f) for f in encoder.encode(as_ints)
        ]


@pytest.mark.parametrize("side", ["writer", "received"])
def test_msgspec_encodes_the_content(side: str) -> None:
    ours, theirs = _sides(_step(int_starts=False))[side]
    for encode in (msgspec.msgpack.encode, msgspec.json.encode):
        assert encode(ours, enc_hook=_numpy_hook) == encode(theirs, enc_hook=_numpy_hook)
    assert len(msgspec.msgpack.decode(msgspec.msgpack.encode(ours, enc_hook=_numpy_hook))) == 40


def test_an_unfilled_instance_is_read_before_a_c_level_reader_sees_it() -> None:
    """``_trusted`` (arrays from a writer with no dict) answers Python-level reads at once;
    once read, C-level readers (msgspec) see the content too."""
    outputs = _step(int_starts=True)
    packed = PackedAuxOutputs.pack(outputs)
    trusted = PackedAuxOutputs._trusted(
        list(packed), packed.token_starts, packed.offsets, packed.rows
    )
    assert list(trusted.items())  # a Python-level read: fills
    encode = msgspec.msgpack.encode
    assert encode(trusted, enc_hook=_numpy_hook) == encode(outputs, enc_hook=_numpy_hook)


@pytest.mark.parametrize("side", ["writer", "received"])
def test_dataclasses_asdict_of_model_runner_output(side: str) -> None:
    ours, theirs = _sides(_step(int_starts=False))[side]
    mine = dataclasses.asdict(ModelRunnerOutput([], {}, aux_output_connector_output=ours))
    upstream = dataclasses.asdict(ModelRunnerOutput([], {}, aux_output_connector_output=theirs))
    assert _plain(mine) == _plain(upstream)
    assert list(mine["aux_output_connector_output"]) == list(theirs)


@pytest.mark.parametrize("side", ["writer", "received"])
def test_copy_is_shallow_and_deepcopy_deep_as_for_a_dict(side: str) -> None:
    ours, theirs = _sides(_step(int_starts=False))[side]
    shallow, upstream_shallow = copy.copy(ours), copy.copy(theirs)
    assert list(shallow) == list(upstream_shallow)
    assert all(shallow[k] is ours[k] for k in ours)
    deep = copy.deepcopy(ours)
    assert _plain(deep) == _plain(copy.deepcopy(theirs))
    assert all(deep[k] is not ours[k] for k in ours)
    assert not any(np.shares_memory(deep[k].rows, ours[k].rows) for k in ours)
    for duplicate in (shallow, deep):  # copies still pickle, to the same content
        assert _plain(pickle.loads(pickle.dumps(duplicate, protocol=5))) == _plain(theirs)


@pytest.mark.parametrize("side", ["writer", "received"])
def test_equality_is_dicts(side: str) -> None:
    ours, theirs = _sides(_step(int_starts=True))[side]
    outputs = _sides(_step(int_starts=True))["writer"][1]
    plain = dict(ours)
    assert _result(ours.__eq__, plain) == ("ok", True)
    assert _result(lambda: ours == outputs) == _result(lambda: theirs == outputs)
    assert _result(lambda: ours != {}) == _result(lambda: theirs != {})


@pytest.mark.parametrize("side", ["writer", "received"])
def test_mutation_works_as_on_a_dict_and_pickling_follows_it(side: str) -> None:
    ours, theirs = _sides(_step(int_starts=True))[side]
    keys = list(theirs)
    popped = []
    for target in (ours, theirs):
        popped.append(_plain(target.pop(keys[0])))
        del target[keys[1]]
        target[keys[2]] = AuxRequestOutput(3, np.zeros((2, 4, 2), np.uint16))
        target.setdefault("new", AuxRequestOutput(9, np.ones((1, 4, 2), np.uint16)))
        target.update({keys[3]: AuxRequestOutput(4, np.full((3, 4, 2), 7, np.uint16))})
    assert popped[0] == popped[1]
    assert list(ours) == list(theirs) and _plain(ours) == _plain(theirs)
    received = pickle.loads(pickle.dumps(ours, protocol=5))
    assert isinstance(received, PackedAuxOutputs) and _plain(received) == _plain(theirs)
    requests = [Req(k, int(v.token_start) + 1 + len(v.rows)) for k, v in theirs.items()]
    assert_parity(theirs, received, requests + [Req(keys[0], 3)])
    # Content that no longer packs pickles as upstream's plain dict.
    ours["odd"] = theirs["odd"] = None  # type: ignore[assignment]
    received = pickle.loads(pickle.dumps(ours, protocol=5))
    assert type(received) is dict and _plain(received) == _plain(theirs)
    for target in (ours, theirs):
        assert target.popitem()[0] == "odd"
        target.clear()
    assert ours == theirs == {} and pickle.loads(pickle.dumps(ours)) == {}


def test_replaced_rows_before_pickling_are_what_is_sent() -> None:
    outputs = _step(int_starts=True)
    packed = PackedAuxOutputs.pack(outputs)
    key = next(iter(outputs))
    packed[key].rows = np.full((5, 4, 2), 9, np.uint16)  # the same object as outputs[key]
    received = pickle.loads(pickle.dumps(packed, protocol=5))
    assert _plain(received) == _plain(outputs)


class _PreHandshakeStep:
    """A step as prime_r3 0.1.0 before the handshake pickled it (commit 233e623's
    ``__reduce_ex__``): ``_rebuild(n, ids, ints, payload, dtype, token_shape)``, no version."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from prime_r3 import packed

        rows = np.zeros((self.n, 3, 2), np.uint16)
        ints = np.concatenate((np.arange(self.n), np.arange(self.n + 1))).astype(np.int64)
        ids = "\x00".join(f"r{i}" for i in range(self.n))
        return packed._rebuild, (self.n, ids, ints.tobytes(), rows.tobytes(), rows.dtype, (3, 2))


@pytest.mark.parametrize("n", [1, 3, 6])
def test_a_step_from_a_pre_handshake_worker_names_the_cause(n: int) -> None:
    """Not 'not enough values to unpack', and not 'format 3' (its n read as a version)."""
    from prime_r3.packed import PackedFormatError

    with pytest.raises(PackedFormatError, match="from before the packed format handshake"):
        pickle.loads(pickle.dumps(_PreHandshakeStep(n), protocol=5))
