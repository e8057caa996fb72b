"""response_b64: the routed experts' base64 ``.npy`` string without the BytesIO copies.

Replaces ``vllm.utils.serial_utils.numpy2base64`` where the serving modules look it up
(``/inference/v1/generate``, ``/v1/completions``, ``/v1/chat/completions``). Upstream
saves the array with ``np.save`` into a ``BytesIO`` (header, then one ``tobytes`` copy
of the data per 16 MiB) and base64s the buffer; for a 16k x 46 x 8 response that is
~8 MB of copies and ~40 ms on the event loop per finished request.

The fast case (an exact ``np.ndarray``, C-contiguous, a numeric dtype of native or no
byte order, so ``np.save`` writes the C-order bytes after its header): the header is
numpy's own (``_write_array_header`` of ``header_data_from_array_1_0``, the two calls
``write_array`` makes, into a small ``BytesIO``), the data is copied once, next to it,
from the array's buffer, and the whole is base64'd by pybase64 (vLLM's encoder) to a
``str`` directly. The string is the one upstream returns: base64 of the same bytes.

Every other array (object or user dtypes, Fortran order, non-contiguous, a subclass,
swapped byte order) goes to upstream's function, counted in ``COUNTERS`` by reason.

Off the event loop (``/inference/v1/generate``): ``ServingTokens``'
``serve_tokens_full_generator`` and ``serve_tokens_stream_generator`` get their
``result_generator`` through ``encoded_off_loop``, which passes every output on
unchanged and, before passing on a finished one, encodes its fast-case arrays of at
least 64 KiB on the patches' one worker thread (``off_loop_executor``; pybase64 releases
the GIL) and remembers
each string by its array (identity, through a weak reference: an entry goes when its
array does, so a string lives no longer than the array it encodes). Our
``numpy2base64`` returns the remembered string for that very array, else encodes as
above. The string is the same function's of the same array (an array is never written
between its finish and its response), so the bytes are upstream's; what moves is when
and where it is computed. When a wave finishes, each request's serving coroutine then
resumes as its encoding completes instead of all of them encoding in one loop pass.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import os
import threading
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import Any

from prime_r3.fixes.response_rows import Counters
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

#: The serving modules that ``from vllm.utils.serial_utils import numpy2base64``.
SERVING_MODULES = (
    "vllm.entrypoints.scale_out.token_in_token_out.serving",
    "vllm.entrypoints.openai.completion.serving",
    "vllm.entrypoints.openai.chat_completion.serving",
)
NUMPY_FORMAT = "numpy.lib._format_impl"
SERVING = SERVING_MODULES[0]
#: Arrays smaller than this are encoded inline (a thread hop would cost more).
OFF_LOOP_MIN = 1 << 16


COUNTERS = Counters("off_loop")


def _why_not_fast(array: Any, np: Any) -> str:
    """Why ``np.save`` would not write this array as header + C-order bytes ("" if it would)."""
    if type(array) is not np.ndarray:
        return "not_ndarray"
    dtype = array.dtype
    if dtype.hasobject or not getattr(type(dtype), "_legacy", False):
        return "dtype"
    if dtype.byteorder not in ("=", "|"):
        return "byteorder"
    if not array.flags.c_contiguous:
        return "layout"
    return ""


#: id(array) -> (weak reference to the array, its string), made off the loop.
_ENCODED: dict[int, tuple[weakref.ref, str]] = {}


def encode(array: Any, upstream: Any) -> str:
    """``numpy2base64(array)``: a string made off the loop, the fast case or ``upstream``."""
    import numpy as np

    entry = _ENCODED.get(id(array))
    if entry is not None and entry[0]() is array:
        del _ENCODED[id(array)]
        with COUNTERS._lock:
            COUNTERS.fast += 1
            COUNTERS.off_loop += 1
        return entry[1]
    reason = _why_not_fast(array, np)
    if reason:
        COUNTERS.add_fallback(reason)
        return upstream(array)
    with COUNTERS._lock:
        COUNTERS.fast += 1
    return _encode_fast(array)


def _encode_fast(array: Any) -> str:
    import numpy as np
    import pybase64
    from numpy.lib import _format_impl as npy

    with io.BytesIO() as head:
        npy._write_array_header(head, npy.header_data_from_array_1_0(array), None)
        header = head.getbuffer()
        size = len(header)
        out = bytearray(size + array.nbytes)
        out[:size] = header
        del header
    if array.nbytes:
        memoryview(out)[size:] = array.reshape(-1).view(np.uint8).data
    return pybase64.b64encode_as_string(out)


def _remember(array: Any, string: str) -> None:
    key = id(array)
    _ENCODED[key] = (weakref.ref(array, lambda _, key=key: _ENCODED.pop(key, None)), string)


async def encoded_off_loop(results: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``results`` unchanged; a finished output's large arrays encoded off the loop first."""
    import numpy as np

    loop = asyncio.get_running_loop()
    async for result in results:
        if getattr(result, "finished", False):
            arrays = [
                array
                for output in getattr(result, "outputs", ())
                if (array := getattr(output, "routed_experts", None)) is not None
                and not _why_not_fast(array, np)
                and array.nbytes >= OFF_LOOP_MIN
            ]
            if arrays:
                strings = await loop.run_in_executor(off_loop_executor(), _encode_all, arrays)
                for array, string in zip(arrays, strings, strict=True):
                    _remember(array, string)
        yield result


_EXECUTOR: list[concurrent.futures.ThreadPoolExecutor] = []
_EXECUTOR_LOCK = threading.Lock()


def off_loop_executor() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread the front-end patches encode and render on (made on first use).

    One thread, not the loop's default executor: a wave's encodings and renders queue
    behind each other instead of several threads contending with the event loop for the
    GIL and the cores at once, and vLLM's own uses of the default executor never wait
    behind them."""
    with _EXECUTOR_LOCK:
        if not _EXECUTOR:
            _EXECUTOR.append(
                concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prime_r3-response")
            )
        return _EXECUTOR[0]


def _forget_executor_in_child() -> None:
    """A forked child has no worker thread: it makes its own on first use."""
    global _EXECUTOR_LOCK
    _EXECUTOR.clear()
    _EXECUTOR_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_executor_in_child)


def _encode_all(arrays: list[Any]) -> list[str]:
    return [_encode_fast(array) for array in arrays]


def _serve_tokens(params: Mapping[str, Any]) -> WrapperFn:
    def through_off_loop_encoding(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        if len(args) >= 2:
            args = (args[0], encoded_off_loop(args[1]), *args[2:])
        elif "result_generator" in kwargs:
            kwargs = {**kwargs, "result_generator": encoded_off_loop(kwargs["result_generator"])}
        else:
            COUNTERS.add_fallback("serve_call")
        return wrapped(*args, **kwargs)

    return through_off_loop_encoding


def _numpy2base64(params: Mapping[str, Any]) -> WrapperFn:
    def fast_numpy2base64(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        if len(args) != 1 or kwargs:
            COUNTERS.add_fallback("call")
            return wrapped(*args, **kwargs)
        return encode(args[0], wrapped)

    return fast_numpy2base64


# Verified source fingerprints (scripts/fingerprint.py): numpy2base64 is the same in
# vLLM 0.31.0, 0.32.0 and 0.33.0; numpy's helpers are numpy 2.3's (every env's).
_NUMPY2BASE64 = frozenset({"8de18844279eb9c8"})
_FULL = frozenset({"2d57866fbba380d8", "e77955d24193e7a6", "bc68d73461734b7a"})
_STREAM = frozenset({"1fe28cb30deb1600", "f95313827a774964", "2db9cf548cac2528"})
_WRITE_ARRAY = frozenset({"ba974512d4cc61e2"})
_WRITE_ARRAY_HEADER = frozenset({"6a077f71c524a5cd"})
_HEADER_DATA = frozenset({"54c17ea1523a344f"})

SPEC = PatchSpec(
    name="response_b64",
    summary="API server: routed experts' base64 .npy from header + one copy, off the loop",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.API_SERVER}),
    targets=(
        *(Target(m, "numpy2base64", _NUMPY2BASE64, _numpy2base64) for m in SERVING_MODULES),
        Target(SERVING, "ServingTokens.serve_tokens_full_generator", _FULL, _serve_tokens),
        Target(SERVING, "ServingTokens.serve_tokens_stream_generator", _STREAM, _serve_tokens),
    ),
    anchors=(
        # What upstream's np.save runs (``asanyarray`` then ``write_array``; np.save
        # itself is a C dispatcher, not anchorable): its header and data order are ours.
        Anchor(NUMPY_FORMAT, "write_array", _WRITE_ARRAY),
        Anchor(NUMPY_FORMAT, "_write_array_header", _WRITE_ARRAY_HEADER),
        Anchor(NUMPY_FORMAT, "header_data_from_array_1_0", _HEADER_DATA),
    ),
    notes="String identical to upstream's (base64 of the same .npy bytes).",
)
