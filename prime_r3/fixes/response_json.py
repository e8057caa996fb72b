"""response_json: ``/inference/v1/generate``'s JSON body without re-escaping the routed experts.

The route (``api_router.generate`` of ``vllm.entrypoints.scale_out.token_in_token_out``)
answers a non-streaming request with ``JSONResponse(content=response.model_dump())``;
Starlette's ``render`` is ``json.dumps(..., ensure_ascii=False, allow_nan=False,
separators=(",", ":")).encode("utf-8")``, which walks each ~8 MB routed-experts string
character by character for escapes, then copies the result to UTF-8: ~120 ms of
event-loop time per 16k x 46 x 8 response on this machine.

We replace the name ``JSONResponse`` in that module (the route looks it up at call time)
with a wrapper that builds the same class's subclass, whose ``render``:

* takes each ``choices[i]["routed_experts"]`` string of at least 64 KiB that is valid
  base64 (``pybase64.b64decode(validate=True)``: only ``A-Z a-z 0-9 + / =``, none of
  which JSON escapes, so ``json.dumps`` renders it as ``"`` + string + ``"``);
* renders a shallow copy of the content, each such string replaced by a unique
  placeholder, with upstream's ``render`` (so every other byte is upstream's);
* puts each string's bytes where its placeholder's quoted text is (found exactly once,
  in order).

The body is upstream's byte for byte: the same ``json.dumps`` of the same values, the
strings' JSON being themselves in quotes. Content without such strings, a string that
is not base64, or a placeholder found other than once, goes to upstream's ``render``
unchanged (the last two counted in ``COUNTERS``). The content is never modified.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

from prime_r3.fixes.response_rows import Counters
from prime_r3.spec import Anchor, PatchSpec, Process, Target, WrapperFn

API_ROUTER = "vllm.entrypoints.scale_out.token_in_token_out.api_router"
#: Strings shorter than this are rendered by upstream's json.dumps (cheap enough).
MIN_SPLICE = 1 << 16


COUNTERS = Counters("strings")


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


def render(content: Any, upstream_render: Any) -> bytes:
    """Upstream's ``render(content)`` bytes, with long base64 strings spliced in."""
    import binascii

    import pybase64

    strings = _long_strings(content)
    if not strings:
        return upstream_render(content)
    for _, value in strings:
        try:
            pybase64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            COUNTERS.add_fallback("not_base64")
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
    pieces = []
    rest = body
    for mark, (_, value) in zip(marks, strings, strict=True):
        if body.count(mark) != 1:
            COUNTERS.add_fallback("placeholder")
            return upstream_render(content)
        before, found, rest = rest.partition(mark)
        if not found:
            COUNTERS.add_fallback("placeholder")
            return upstream_render(content)
        pieces += (before, b'"', value.encode("ascii"), b'"')
    pieces.append(rest)
    with COUNTERS._lock:
        COUNTERS.fast += 1
        COUNTERS.strings += len(strings)
    return b"".join(pieces)


def _json_response(params: Mapping[str, Any]) -> WrapperFn:
    subclasses: dict[type, type] = {}

    def subclass_of(cls: type) -> type:
        made = subclasses.get(cls)
        if made is None:

            def spliced_render(self: Any, content: Any) -> bytes:
                return render(content, super(made, self).render)

            made = type(cls.__name__, (cls,), {"render": spliced_render, "__module__": __name__})
            subclasses[cls] = made
        return made

    def spliced_json_response(wrapped, instance, args, kwargs):  # noqa: ANN001, ANN202
        if not isinstance(wrapped, type):
            return wrapped(*args, **kwargs)
        return subclass_of(wrapped)(*args, **kwargs)

    return spliced_json_response


# Verified source fingerprints (scripts/fingerprint.py): Starlette's JSONResponse (the
# same Starlette in every env) and the route, for vLLM 0.31.0, 0.32.0 and 0.33.0.
_JSON_RESPONSE = frozenset({"5280bda6fcf35120"})
_GENERATE = frozenset({"4cc721e81423386a", "4816236e36f18b98"})

SPEC = PatchSpec(
    name="response_json",
    summary="API server: /inference/v1/generate body with routed experts spliced, not re-escaped",
    vllm_range=">=0.31,<0.34",
    processes=frozenset({Process.API_SERVER}),
    targets=(Target(API_ROUTER, "JSONResponse", _JSON_RESPONSE, _json_response),),
    anchors=(Anchor(API_ROUTER, "generate", _GENERATE),),
    notes="Body byte-identical to upstream's render.",
)
