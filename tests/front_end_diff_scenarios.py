"""The API server's response code (09-11's files) on one vLLM tree, with ``PRIME_R3=0``.

    python -m tests.front_end_diff_scenarios OUT.pickle

Run by ``tests/test_front_end_diffs.py`` twice: on the installed release and on a copy
patched with ``patches/`` (first on ``PYTHONPATH``). Every result is plain data, so the
two runs compare with ``==``:

* ``rows``: vLLM's real ``OutputProcessor`` driven with ``EngineCoreOutput``s carrying
  routed experts (a prompt's rows, then one row per step; uint8, uint16, int64 rows;
  DELTA, CUMULATIVE and FINAL_ONLY requests; stop strings that drop tokens past them
  in a step, through a stand-in detokenizer as vLLM's own tests use; an abort; arrays
  of another dtype, row shape or layout midway, empty and 0-d arrays): each finished
  output's routed experts (dtype, shape, bytes, flags, whether it owns its data) or
  the error, and each output's token ids;
* ``b64``: ``numpy2base64`` of arrays of every kind (the string, or the error);
* ``json``: ``/inference/v1/generate``'s route function (``api_router.generate``
  without its decorators) answering with a real response model (long and short
  base64 routed experts, strings JSON escapes, non-ASCII, NaN): the body or the
  error; then the class of response it built rendering contents of other shapes.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np


def _error(error: BaseException) -> tuple[str, str, str]:
    return ("error", type(error).__name__, str(error))


def _array(value: Any) -> Any:
    if value is None:
        return None
    flags = value.flags
    return (
        "array",
        type(value).__name__,
        value.dtype.str,
        value.shape,
        value.tobytes(),
        flags.c_contiguous,
        flags.writeable,
        flags.owndata,
    )


# -- rows: the real OutputProcessor ----------------------------------------------------


def _detokenizer(request: Any) -> Any:
    """vLLM's test stand-in (tests/detokenizer/...): token id -> one character."""
    from vllm.v1.engine.detokenizer import BaseIncrementalDetokenizer

    class CharDetokenizer(BaseIncrementalDetokenizer):
        def decode_next(self, next_token_id: int) -> str:
            return chr(next_token_id)

    return CharDetokenizer(request)


def _request(request_id: str, prompt_len: int, kind: Any, stop: list[str] | None) -> Any:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    params = SamplingParams(max_tokens=1 << 20, output_kind=kind, stop=stop)
    return EngineCoreRequest(
        request_id,
        [97] * prompt_len,
        None,
        params,
        None,
        0.0,
        None,
        None,
        None,
        external_req_id=request_id,
    )


def _rows(rng: np.random.Generator, n: int, dtype: Any, shape: tuple[int, ...]) -> Any:
    return rng.integers(0, 120, size=(n, *shape)).astype(dtype)


def _run_requests(case: dict[str, Any]) -> list[Any]:
    """One OutputProcessor, the case's requests step by step; what came out."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    rng = np.random.default_rng(case["seed"])
    processor = OutputProcessor(None, log_stats=False)
    requests = case["requests"]
    for name, spec in requests.items():
        kind = getattr(RequestOutputKind, spec.get("kind", "DELTA"))
        request = _request(name, spec["prompt"], kind, spec.get("stop"))
        processor.add_request(request, None)
        if spec.get("stop"):
            processor.request_states[name].detokenizer = _detokenizer(request)
    seen: list[Any] = []
    for step in range(case["steps"]):
        outputs = []
        for name, spec in requests.items():
            if name not in processor.request_states:
                continue
            if spec.get("abort_at") == step:
                processor.abort_requests([name], internal=True)
                seen.append((step, name, "aborted"))
                continue
            tokens = spec.get("tokens", {}).get(step, [98 + step % 20])
            make = spec.get("odd", {}).get(step)
            if step == 0:
                rows = _rows(rng, spec["prompt"] + len(tokens) - 1, spec["dtype"], spec["shape"])
            else:
                rows = _rows(rng, len(tokens), spec["dtype"], spec["shape"])
            if make is not None:
                rows = make(rows)
            last = step == spec["finish_at"]
            outputs.append(
                EngineCoreOutput(
                    request_id=name,
                    new_token_ids=list(tokens),
                    routed_experts=rows,
                    finish_reason=FinishReason.LENGTH if last else None,
                )
            )
        try:
            result = processor.process_outputs(outputs)
        except Exception as error:  # noqa: BLE001 - the error is the result compared
            seen.append((step, "process_outputs", _error(error)))
            break
        for output in result.request_outputs:
            for completion in output.outputs:
                seen.append(
                    (
                        step,
                        output.request_id,
                        completion.index,
                        list(completion.token_ids),
                        completion.finish_reason,
                        completion.stop_reason,
                        _array(completion.routed_experts),
                    )
                )
    return seen


def _stop_tokens(text: str) -> list[int]:
    return [ord(c) for c in text]


ROW_CASES: dict[str, dict[str, Any]] = {
    "decode": {
        "seed": 0,
        "steps": 60,
        "requests": {
            f"r{i}": {
                "prompt": 5 + 7 * i,
                "dtype": np.uint8,
                "shape": (46, 8),
                "finish_at": 10 + 9 * i,
                "kind": ("DELTA", "CUMULATIVE", "FINAL_ONLY")[i % 3],
            }
            for i in range(6)
        },
    },
    "dtypes": {
        "seed": 1,
        "steps": 12,
        "requests": {
            "u16": {"prompt": 30, "dtype": np.uint16, "shape": (4, 2), "finish_at": 11},
            "i64": {"prompt": 3, "dtype": np.int64, "shape": (1, 1), "finish_at": 7},
            "flat": {"prompt": 4, "dtype": np.int32, "shape": (), "finish_at": 5},
        },
    },
    "stop_strings": {
        "seed": 2,
        "steps": 6,
        "requests": {
            # "cd" arrives with tokens after it in one step: those are dropped.
            "mid": {
                "prompt": 4,
                "dtype": np.uint8,
                "shape": (3, 2),
                "finish_at": 99,
                "stop": ["cd"],
                "tokens": {1: _stop_tokens("xy"), 2: _stop_tokens("abcdef")},
            },
            # The stop string ends a multi-token step: nothing dropped.
            "end": {
                "prompt": 2,
                "dtype": np.uint16,
                "shape": (3, 2),
                "finish_at": 99,
                "stop": ["zz"],
                "tokens": {3: _stop_tokens("qzz")},
            },
            # The whole step's tokens but one dropped, on the request's first output.
            "first": {
                "prompt": 6,
                "dtype": np.uint8,
                "shape": (3, 2),
                "finish_at": 99,
                "stop": ["k"],
                "tokens": {0: _stop_tokens("kabc")},
            },
        },
    },
    "abort": {
        "seed": 3,
        "steps": 8,
        "requests": {
            "gone": {
                "prompt": 9,
                "dtype": np.uint8,
                "shape": (2, 2),
                "finish_at": 7,
                "abort_at": 4,
            },
            "kept": {"prompt": 2, "dtype": np.uint8, "shape": (2, 2), "finish_at": 7},
        },
    },
    "odd_arrays": {
        "seed": 4,
        "steps": 8,
        "requests": {
            "promoted": {
                "prompt": 3,
                "dtype": np.uint8,
                "shape": (2, 3),
                "finish_at": 6,
                "odd": {3: lambda r: r.astype(np.int16)},
            },
            "fortran": {
                "prompt": 3,
                "dtype": np.uint8,
                "shape": (2, 3),
                "finish_at": 6,
                "odd": {0: np.asfortranarray, 4: np.asfortranarray},
            },
            "strided": {
                "prompt": 3,
                "dtype": np.uint8,
                "shape": (2, 3),
                "finish_at": 6,
                "odd": {2: lambda r: np.repeat(r, 2, axis=0)[::2]},
            },
            "swapped": {
                "prompt": 3,
                "dtype": np.int32,
                "shape": (2, 3),
                "finish_at": 6,
                "odd": {1: lambda r: r.astype(">i4")},
            },
            "empty": {
                "prompt": 3,
                "dtype": np.uint8,
                "shape": (2, 3),
                "finish_at": 6,
                "odd": {2: lambda r: r[:0], 3: lambda r: r[:0]},
            },
            "empty_first": {
                "prompt": 1,
                "dtype": np.float32,
                "shape": (2,),
                "finish_at": 3,
                "odd": {0: lambda r: r[:0]},
            },
            "masked": {
                "prompt": 2,
                "dtype": np.uint8,
                "shape": (2, 3),
                "finish_at": 4,
                "odd": {2: lambda r: np.ma.masked_array(r)},
            },
        },
    },
    # np.concatenate refuses these; upstream raises when the request finishes.
    "row_shape_changes": {
        "seed": 5,
        "steps": 5,
        "requests": {
            "bad": {
                "prompt": 3,
                "dtype": np.uint8,
                "shape": (2, 3),
                "finish_at": 4,
                "odd": {2: lambda r: r.reshape(len(r), 3, 2)},
            },
        },
    },
    "zero_dim": {
        "seed": 6,
        "steps": 3,
        "requests": {
            "scalar_first": {
                "prompt": 2,
                "dtype": np.uint8,
                "shape": (),
                "finish_at": 2,
                "odd": {0: lambda r: r[0]},
            },
        },
    },
    "zero_dim_later": {
        "seed": 7,
        "steps": 3,
        "requests": {
            "scalar_later": {
                "prompt": 1,
                "dtype": np.uint8,
                "shape": (),
                "finish_at": 2,
                "odd": {1: lambda r: r[0]},
            },
        },
    },
}


def scenario_rows() -> dict[str, Any]:
    return {name: _run_requests(case) for name, case in ROW_CASES.items()}


# -- b64: numpy2base64 -----------------------------------------------------------------

B64_CASES = {
    "routed_experts": lambda: np.random.default_rng(0).integers(0, 128, (3000, 46, 8), np.uint8),
    "uint16_rows": lambda: np.random.default_rng(1).integers(0, 300, (700, 46, 8), np.uint16),
    "empty_rows": lambda: np.zeros((0, 46, 8), np.uint8),
    "zero_dim": lambda: np.array(7, np.int32),
    "float": lambda: np.random.default_rng(2).random((3, 4)),
    "float16": lambda: np.arange(9, dtype=np.float16),
    "complex": lambda: np.arange(4, dtype=np.complex64) * 1j,
    "bool": lambda: np.array([True, False, True]),
    "big_endian": lambda: np.arange(12, dtype=">i4").reshape(3, 4),
    "fortran": lambda: np.asfortranarray(np.arange(12).reshape(3, 4)),
    "transposed": lambda: np.arange(12).reshape(3, 4).T,
    "strided": lambda: np.arange(20)[::3],
    "bytes": lambda: np.array([b"ab", b"c"]),
    "unicode": lambda: np.array(["é", "ab"]),
    "structured": lambda: np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")]),
    "masked": lambda: np.ma.masked_array([1, 2, 3], mask=[0, 1, 0]),
    "matrix_like_subclass": lambda: np.arange(6).reshape(2, 3).view(np.recarray),
    "datetime": lambda: np.array(["2026-01-01"], dtype="datetime64[D]"),
    "object": lambda: np.array([object()]),
    "zero_size_dims": lambda: np.zeros((2, 0, 3), np.float16),
    "many_dims": lambda: np.zeros((1,) * 32, np.uint8),
}


def scenario_b64() -> dict[str, Any]:
    from vllm.utils.serial_utils import numpy2base64

    found: dict[str, Any] = {}
    for name, make in B64_CASES.items():
        try:
            found[name] = ("ok", numpy2base64(make()))
        except Exception as error:  # noqa: BLE001
            found[name] = _error(error)
    return found


# -- json: the generate route ----------------------------------------------------------


def _b64(n: int, seed: int = 0) -> str:
    import pybase64

    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    return pybase64.b64encode(raw).decode("ascii")


def _choice(index: int, routed_experts: str | None, **extra: Any) -> dict[str, Any]:
    return {
        "index": index,
        "token_ids": list(range(index, index + 40)),
        "finish_reason": "length",
        "routed_experts": routed_experts,
        **extra,
    }


RESPONSES = {
    "one_long": {"choices": [_choice(0, _b64(200_000))]},
    "mixed_choices": {
        "request_id": "r-é\u2028",
        "choices": [
            _choice(0, _b64(200_000, 1), stop_reason='a"\n\\'),
            _choice(1, _b64(30)),
            _choice(2, _b64(100_000, 2)),
            _choice(3, None),
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 160, "total_tokens": 163},
        "kv_transfer_params": {"x": [1.5e-7, 2, "é"], "y": None},
    },
    "short_only": {"choices": [_choice(0, _b64(300))]},
    "not_base64": {"choices": [_choice(0, 'x"' * 40_000), _choice(1, "é" * 70_000)]},
    "base64_with_newline": {"choices": [_choice(0, _b64(60_000)[:-1] + "\n")]},
    "no_routed_experts": {"choices": [_choice(0, None)]},
    "nan": {"choices": [_choice(0, _b64(100_000))], "kv_transfer_params": {"v": float("nan")}},
}

OTHER_CONTENT = {
    "error_body": {"error": {"code": 400, "message": "bad"}},
    "a_list": [1, 2],
    "choices_not_a_list": {"choices": "none"},
    "no_choices": {"a": _b64(100_000)},
    "empty_choices": {"choices": []},
    "non_string_key": {"choices": [{"routed_experts": _b64(100_000)}], 1: 2},
    "choice_with_non_string_key": {
        "choices": [{"routed_experts": _b64(100_000), 3: "x"}, {"routed_experts": _b64(80_000)}]
    },
    "choice_not_a_dict": {"choices": [{"routed_experts": _b64(100_000)}, [1], None]},
    "control_characters": {"choices": [{}, {"routed_experts": _b64(70_000), "x": "\x00\x1f"}]},
    "unserialisable": {"choices": [{"routed_experts": _b64(100_000), "o": object()}]},
    "nan_in_a_choice": {"choices": [{"routed_experts": _b64(100_000), "f": float("inf")}]},
}


def _response_model() -> Any:
    from vllm.entrypoints.scale_out.token_in_token_out import api_router, protocol

    if hasattr(protocol, "GenerateTokensResponse"):
        return protocol.GenerateTokensResponse
    return api_router.GenerateResponse  # 0.31


def _route_body(content: dict[str, Any]) -> tuple[Any, Any]:
    """The route's response to a request whose handler returns ``content``'s model."""
    from vllm.entrypoints.scale_out.token_in_token_out import api_router

    response = _response_model().model_validate({"request_id": "r", "created": 0, **content})

    class Handler:
        async def serve_tokens(self, request: Any, raw_request: Any) -> Any:
            return response

    raw_request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace()))
    raw_request.app.state.serving_tokens = Handler()
    route = inspect.unwrap(api_router.generate)
    try:
        made = asyncio.run(route(None, raw_request))
    except Exception as error:  # noqa: BLE001
        return _error(error), None
    return ("ok", made.status_code, made.body, made.media_type), type(made)


def scenario_json() -> dict[str, Any]:
    found: dict[str, Any] = {"route": {}, "render": {}}
    classes = set()
    for name, content in RESPONSES.items():
        found["route"][name], made = _route_body(content)
        classes.add(made)
    classes.discard(None)
    (response_class,) = classes  # the route builds one class for every model
    found["response_class"] = f"{response_class.__module__}.{response_class.__qualname__}"
    for name, content in {**RESPONSES, **OTHER_CONTENT}.items():
        try:
            found["render"][name] = ("ok", response_class(content=content).body)
        except Exception as error:  # noqa: BLE001
            found["render"][name] = _error(error)
    return found


def main() -> None:
    import vllm
    from vllm.entrypoints.scale_out.token_in_token_out import api_router, serving
    from vllm.v1.engine import output_processor

    out = Path(sys.argv[1])
    results = {
        "vllm_file": vllm.__file__,
        # What 09-11 add, present only on the patched tree.
        "added": {
            "RoutedExpertsRows": hasattr(output_processor, "RoutedExpertsRows"),
            "_routed_experts_base64": hasattr(serving, "_routed_experts_base64"),
            "GenerateJSONResponse": hasattr(api_router, "GenerateJSONResponse"),
        },
        "rows": scenario_rows(),
        "b64": scenario_b64(),
        "json": scenario_json(),
    }
    out.write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    main()
