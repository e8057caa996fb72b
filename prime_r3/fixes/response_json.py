"""response_json: ``/inference/v1/generate``'s JSON body without re-escaping the routed experts.

The route (``api_router.generate`` of ``vllm.entrypoints.scale_out.token_in_token_out``)
answers a non-streaming request with ``JSONResponse(content=response.model_dump())``;
Starlette's ``render`` is ``json.dumps(..., ensure_ascii=False, allow_nan=False,
separators=(",", ":")).encode("utf-8")``, which walks each ~8 MB routed-experts string
character by character for escapes, then copies the result to UTF-8: ~120 ms of
event-loop time per 16k x 46 x 8 response on this machine.

We replace the name ``JSONResponse`` in that module (the route looks it up at call time)
with a wrapper that builds the same class's subclass, whose ``render``:

* takes each ``choices[i]["routed_experts"]`` string of at least 64 KiB that is ASCII
  and whose bytes pass ``pybase64.b64decode(validate=True)`` in 1 MiB slices (so only
  ``A-Z a-z 0-9 + / =``, none of which JSON escapes: ``json.dumps`` renders it as ``"``
  + string + ``"``);
* renders a shallow copy of the content, each such string replaced by a unique
  placeholder, with upstream's ``render`` (so every other byte is upstream's);
* puts each string's bytes where its placeholder's quoted text is (found exactly once,
  in order).

The body is upstream's byte for byte: the same ``json.dumps`` of the same values, the
strings' JSON being themselves in quotes. Content without such strings, a string that
is not base64, or a placeholder found other than once, goes to upstream's ``render``
unchanged (the last two counted in ``COUNTERS``). The content is never modified.

Off the event loop: for content with such strings, the subclass's ``__init__`` runs
Starlette's ``Response.__init__`` (status, media type, background, then the render) with
the render split in two. ``prepare`` (in the constructor, so upstream's render errors
raise there, where the route's decorators see them) renders the skeleton; ``splice``
(the base64 check and the copies) is deferred with ``init_headers`` to the response's
ASGI ``__call__``, which runs it on response_b64's worker thread (``off_loop_executor``),
then sets body and headers from the status and media type the response had when
constructed, drops the content, and runs Starlette's ``__call__``. Reading ``body`` or
``raw_headers`` (or ``headers``), or setting ``body`` or ``raw_headers``, before that
splices at once, on the caller's thread, as upstream's constructor would have rendered.
Either way the response sends upstream's status, headers and body. The three Starlette
methods are anchored.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from typing import Any, NamedTuple

from prime_r3.fixes.response_b64 import off_loop_executor
from prime_r3.fixes.response_rows import Counters
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

API_ROUTER = "vllm.entrypoints.scale_out.token_in_token_out.api_router"
#: Strings shorter than this are rendered by upstream's json.dumps (cheap enough).
MIN_SPLICE = 1 << 16
#: Base64 is checked this many characters at a time (a multiple of 4).
_SLICE = 1 << 20


COUNTERS = Counters("strings", "off_loop")


def _long_strings(content: Any) -> list[tuple[int, str]]:
    """(choice index, string) of each routed-experts string worth splicing."""
    if type(content) is not dict:
        return []
    choices = content.get("choices")
    if type(choices) is not list:
        return []
    found = []
    for i, choice in enumerate(choices):
        if type(choice) is dict:
            value = choice.get("routed_experts")
            if type(value) is str and len(value) >= MIN_SPLICE:
                found.append((i, value))
    return found


class Splice(NamedTuple):
    """A body rendered but for its long strings: each ``mark`` (quoted) is found once."""

    skeleton: bytes
    marks: list[bytes]
    strings: list[str]


def prepare(content: Any, upstream_render: Any) -> bytes | Splice:
    """Upstream's ``render(content)`` bytes, or its body with placeholders for the long
    ASCII strings (``splice`` puts them in). Raises where upstream's render raises."""
    strings = _long_strings(content)
    if not strings or not all(value.isascii() for _, value in strings):
        return upstream_render(content)
    token = secrets.token_hex(8)
    skeleton = dict(content)
    choices = skeleton["choices"] = list(content["choices"])
    marks = []
    for k, (i, _) in enumerate(strings):
        mark = f"prime-r3-splice-{token}-{k}"
        choices[i] = {**choices[i], "routed_experts": mark}
        marks.append(f'"{mark}"'.encode("ascii"))
    body = upstream_render(skeleton)
    if any(body.count(mark) != 1 for mark in marks):
        COUNTERS.add_fallback("placeholder")
        return upstream_render(content)
    return Splice(body, marks, [value for _, value in strings])


def splice(prepared: Splice, content: Any, upstream_render: Any) -> bytes:
    """The body of ``prepared`` with each string in its placeholder's place, or upstream's
    ``render(content)`` where a string is not base64 (it cannot raise: the rest of the
    content rendered, and the strings are ASCII)."""
    import binascii

    import pybase64

    encoded = []
    for value in prepared.strings:
        data = value.encode("ascii")
        view = memoryview(data)
        try:  # in slices (a multiple of 4 long): no decoded copy of the whole kept
            for at in range(0, len(view), _SLICE):
                pybase64.b64decode(view[at : at + _SLICE], validate=True)
        except (binascii.Error, ValueError):
            COUNTERS.add_fallback("not_base64")
            return upstream_render(content)
        encoded.append(data)
    pieces = []
    rest = prepared.skeleton
    for mark, data in zip(prepared.marks, encoded, strict=True):
        before, _, rest = rest.partition(mark)
        pieces += (before, b'"', data, b'"')
    pieces.append(rest)
    with COUNTERS._lock:
        COUNTERS.fast += 1
        COUNTERS.strings += len(encoded)
    return b"".join(pieces)


def render(content: Any, upstream_render: Any) -> bytes:
    """Upstream's ``render(content)`` bytes, with long base64 strings spliced in."""
    prepared = prepare(content, upstream_render)
    return prepared if isinstance(prepared, bytes) else splice(prepared, content, upstream_render)


def _json_response(params: Mapping[str, Any]) -> WrapperFn:
    subclasses: dict[type, type] = {}

    def subclass_of(cls: type) -> type:
        made = subclasses.get(cls)
        if made is None:

            def upstream_render(self: Any) -> Any:
                return super(made, self).render

            def spliced_render(self: Any, content: Any) -> bytes:
                return render(content, upstream_render(self))

            def deferred_init(
                self: Any,
                content: Any,
                status_code: int = 200,
                headers: Any = None,
                media_type: str | None = None,
                background: Any = None,
            ) -> None:
                if not _long_strings(content):  # nothing worth a thread: upstream's init
                    super(made, self).__init__(
                        content, status_code, headers, media_type, background
                    )
                    return
                # Starlette's Response.__init__ (anchored), its last two lines deferred
                # but for the part of the render that can raise (the skeleton).
                self.status_code = status_code
                if media_type is not None:
                    self.media_type = media_type
                self.background = background
                prepared = prepare(content, upstream_render(self))
                if isinstance(prepared, bytes):
                    self.body = prepared
                    self.init_headers(headers)
                    return
                state = (self.status_code, self.media_type)
                self.__dict__[_PENDING] = (prepared, content, headers, state)

            def rendered_on_use(self: Any, name: str) -> Any:
                if name not in ("body", "raw_headers") or _PENDING not in self.__dict__:
                    raise AttributeError(name)
                _render_now(self)
                return getattr(self, name)

            def set_after_render(self: Any, name: str, value: Any) -> None:
                if name in ("body", "raw_headers") and _PENDING in self.__dict__:
                    _render_now(self)  # upstream's constructor had set them already
                object.__setattr__(self, name, value)

            def _render_now(self: Any) -> None:
                pending = self.__dict__.pop(_PENDING)
                _finish(self, pending, splice(pending[0], pending[1], upstream_render(self)))

            async def rendered_off_loop(self: Any, scope: Any, receive: Any, send: Any) -> None:
                pending = self.__dict__.get(_PENDING)
                if pending is not None:
                    loop = asyncio.get_running_loop()
                    body = await loop.run_in_executor(
                        off_loop_executor(), splice, pending[0], pending[1], upstream_render(self)
                    )
                    if self.__dict__.get(_PENDING) is pending:  # not rendered meanwhile
                        del self.__dict__[_PENDING]
                        _finish(self, pending, body)
                        with COUNTERS._lock:
                            COUNTERS.off_loop += 1
                    del pending, body  # the content is not kept while sending
                await super(made, self).__call__(scope, receive, send)

            made = type(
                cls.__name__,
                (cls,),
                {
                    "render": spliced_render,
                    "__init__": deferred_init,
                    "__getattr__": rendered_on_use,
                    "__setattr__": set_after_render,
                    "__call__": rendered_off_loop,
                    "__module__": __name__,
                },
            )
            subclasses[cls] = made
        return made

    def spliced_json_response(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        if not isinstance(wrapped, type):
            return wrapped(*args, **kwargs)
        return subclass_of(wrapped)(*args, **kwargs)

    return spliced_json_response


#: Where a deferred response keeps (splice, content, headers, (status, media type) at
#: construction) until it renders.
_PENDING = "_prime_r3_pending"
_UNSET = object()


def _finish(response: Any, pending: tuple[Any, ...], body: bytes) -> None:
    """The deferred end of Starlette's ``Response.__init__``: the body, then the headers,
    made from the status and media type the response had when it was constructed."""
    _, _, headers, (status, media) = pending
    inst = response.__dict__
    now = inst.get("status_code", _UNSET), inst.get("media_type", _UNSET)
    inst["body"], inst["status_code"], inst["media_type"] = body, status, media
    try:
        response.init_headers(headers)
    finally:
        for name, value in zip(("status_code", "media_type"), now, strict=True):
            if value is _UNSET:
                inst.pop(name, None)
            else:
                inst[name] = value


# Verified source fingerprints (scripts/fingerprint.py): Starlette's JSONResponse (the
# same Starlette in every env) and the route, for vLLM 0.31.0, 0.32.0 and 0.33.0.
_JSON_RESPONSE = frozenset({"5280bda6fcf35120"})
_GENERATE = frozenset({"4cc721e81423386a", "4816236e36f18b98"})
_RESPONSE_INIT = frozenset({"8a5615e9cc22eee9"})
_RESPONSE_CALL = frozenset({"91cb62a22d306d7d"})
_INIT_HEADERS = frozenset({"71a7a41a05e2f3b9"})
STARLETTE = "starlette.responses"

SPEC = PatchSpec(
    name="response_json",
    summary="API server: /inference/v1/generate body with routed experts spliced, not re-escaped",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.API_SERVER}),
    targets=(Target(API_ROUTER, "JSONResponse", _JSON_RESPONSE, _json_response),),
    anchors=(
        Anchor(API_ROUTER, "generate", _GENERATE),
        # The deferred render repeats Response.__init__'s first lines and runs its last
        # two (render, init_headers) before Response.__call__ sends.
        Anchor(STARLETTE, "Response.__init__", _RESPONSE_INIT),
        Anchor(STARLETTE, "Response.__call__", _RESPONSE_CALL),
        Anchor(STARLETTE, "Response.init_headers", _INIT_HEADERS),
    ),
    notes="Body byte-identical to upstream's render.",
)
