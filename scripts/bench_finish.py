"""A finished long response's routed-experts work in the API server: upstream vs prime_r3.

    prime-r3 bench finish [--responses 40] [--tokens 16384] [--rounds 5] [--json PATH]

What one finished ``/inference/v1/generate`` response costs the API server for its routed
experts, measured with vLLM's real code in a fresh interpreter per arm and round (arms
rotated, medians): the serving module's ``numpy2base64`` of the request's rows, the real
``GenerateTokensChoice`` / ``GenerateTokensResponse`` models, and the route's
``JSONResponse(content=response.model_dump())`` rendered to its body. With prime_r3
(``response_b64``, ``response_json``) the same names are the overlay's; the body is read
(``.body``), so a deferred render runs on the calling thread. Each response has rows of
its own (``--tokens`` x 46 x 8 uint8, made before timing, dropped with the response).

Arms: ``off`` (R3 off: the same responses without routed experts, ``PRIME_R3=0``),
``upstream`` (``PRIME_R3=0``), ``prime`` (prime_r3 applied), and on request
``prime_again`` (``prime`` once more, the A/A arm), ``prime-response_b64`` and
``prime-response_json`` (every patch but that one: what it buys). Per arm: process CPU (user +
system) per response, minor page faults per response, and the sha256 of the bodies
(``upstream`` and ``prime`` identical in every round). The R3 increment is each R3 arm
less ``off`` (the token ids' validation and JSON, the rest of the model).

What this leaves out, which the wave (``prime-r3 bench wave``) counts: the output
processor's finish (upstream concatenates one chunk per step; ``response_rows`` hands its
buffer out), sending the body, and a hundred responses' allocations at once.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchkit  # noqa: E402

LAYERS, TOPK = 46, 8
ARMS = {
    "off": {"PRIME_R3": "0"},
    "upstream": {"PRIME_R3": "0"},
    "prime": {},
    "prime_again": {},  # the A/A arm: what arms that cannot differ read
    "prime-response_b64": {"PRIME_R3_PATCHES": "all,-response_b64"},
    "prime-response_json": {"PRIME_R3_PATCHES": "all,-response_json"},
}
DEFAULT_ARMS = ("off", "upstream", "prime")


def child(responses: int, tokens: int, r3: bool) -> dict[str, Any]:
    """One arm in this interpreter: the per-response figures as a JSON row."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import numpy as np

    import prime_r3

    prime_r3.apply(log=False)
    import vllm
    from vllm.entrypoints.scale_out.token_in_token_out import api_router, protocol, serving

    from prime_r3.fixes import response_b64

    for name in response_b64.SERVING_MODULES:  # as the API server has them
        importlib.import_module(name)

    rng = np.random.default_rng(0)
    table = rng.integers(0, 128, size=(tokens, LAYERS, TOPK), dtype=np.uint8)
    token_ids = [int(t) for t in rng.integers(1, 32000, size=tokens)]
    digest = hashlib.sha256()

    def one(k: int, rows: Any) -> None:
        choice = protocol.GenerateTokensChoice(
            index=0,
            logprobs=None,
            finish_reason="length",
            stop_reason=None,
            token_ids=token_ids,
            routed_experts=serving.numpy2base64(rows) if r3 else None,
        )
        response = protocol.GenerateTokensResponse(
            request_id=f"req-{k}", created=0, model="m", choices=[choice]
        )
        digest.update(api_router.JSONResponse(content=response.model_dump()).body)

    one(-1, table.copy())  # warm-up: imports, first allocations
    # Each response's own rows (R3 arms), made before timing; each goes with its response.
    fresh = [np.roll(table, k, axis=0) if r3 else None for k in range(responses)]
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.process_time()
    for k in range(responses):
        one(k, fresh[k])
        fresh[k] = None
    cpu = time.process_time() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {
        "cpu_ms": cpu / responses * 1e3,
        "faults": (after.ru_minflt - before.ru_minflt) / responses,
        "sha256": digest.hexdigest(),
        "r3": r3,
        "applied": [p for p in benchkit.applied_patches() if "(" not in p],
        "spliced": _spliced(),
        "package": str(Path(prime_r3.__file__).resolve().parent),
        "vllm": str(Path(vllm.__file__).parent.absolute()),
    }


#: What each arm must have run: the patches applied in the child.
EXPECTED = {
    "off": [],
    "upstream": [],
    "prime": ["response_b64", "response_json"],
    "prime_again": ["response_b64", "response_json"],
    "prime-response_b64": ["response_json"],
    "prime-response_json": ["response_b64"],
}


def _spliced() -> int:
    """Strings ``response_json`` spliced in this process (0 where it is not applied)."""
    from prime_r3.fixes import response_json

    return int(response_json.COUNTERS.strings)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="prime-r3 bench finish", description=__doc__.split("\n")[0])
    p.add_argument("--responses", type=int, default=40, help="responses per arm and round")
    p.add_argument("--tokens", type=int, default=16384, help="rows per response")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"from {','.join(ARMS)}")
    p.add_argument("--json", default=None)
    p.add_argument("--child", type=int, choices=(0, 1), help=argparse.SUPPRESS)  # R3
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.responses, args.tokens, bool(args.child))))
        return 0
    arms = list(dict.fromkeys(a.strip() for a in args.arms.split(",") if a.strip()))
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise SystemExit(f"--arms {args.arms!r}: choose one or more of {', '.join(ARMS)}")
    if args.responses < 1 or args.tokens < 1 or args.rounds < 1:
        raise SystemExit("--responses, --tokens and --rounds must be at least 1")
    for name in [k for k in os.environ if k.startswith("PRIME_R3")]:
        del os.environ[name]  # each arm's own settings only (ARMS)
    sizes = ["--responses", str(args.responses), "--tokens", str(args.tokens)]
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in benchkit.rotated(arms, r):
            argv = ["--child", "0" if arm == "off" else "1", *sizes]
            row = benchkit.run_child(__file__, argv, str(benchkit.ROOT), arm, env=ARMS[arm])
            splices = "response_json" in EXPECTED[arm]
            if sorted(row["applied"]) != EXPECTED[arm] or splices != (row["spliced"] > 0):
                raise SystemExit(
                    f"the {arm} arm ran {row['applied']} ({row['spliced']} strings spliced); "
                    f"expected {EXPECTED[arm]}: it measured other code"
                )
            results[arm].append(row)
        print(f"round {r} done", file=sys.stderr, flush=True)
    print(
        f"finish: {args.responses} responses x {args.tokens} x {LAYERS} x {TOPK} uint8 per arm, "
        f"{args.rounds} rounds (medians; arms rotated)"
    )
    print(f"{'arm':16} {'cpu ms/resp':>12} {'faults/resp':>12}")
    med = {arm: benchkit.medians(rows, ("cpu_ms", "faults")) for arm, rows in results.items()}
    for arm in arms:
        print(f"{arm:16} {med[arm]['cpu_ms']:12.2f} {med[arm]['faults']:12.0f}")
    if "upstream" in med and "prime" in med:
        pairs = list(zip(results["upstream"], results["prime"], strict=True))
        ratios = [a["cpu_ms"] / b["cpu_ms"] for a, b in pairs]
        print(
            f"  upstream/prime cpu, median of per-round ratios {statistics.median(ratios):.2f}x "
            f"(per round {', '.join(f'{x:.2f}' for x in ratios)})"
        )
        off = [row["cpu_ms"] for row in results["off"]] if "off" in results else []
        increments = [
            (a["cpu_ms"] - o) / (b["cpu_ms"] - o)
            for (a, b), o in zip(pairs, off, strict=False)  # none without the off arm
            if b["cpu_ms"] > o
        ]
        if increments:
            print(
                f"  R3 increment (arm - off) {med['upstream']['cpu_ms'] - med['off']['cpu_ms']:.2f}"
                f" -> {med['prime']['cpu_ms'] - med['off']['cpu_ms']:.2f} ms; upstream/prime "
                f"median of per-round ratios {statistics.median(increments):.2f}x"
            )
    for arm in [a for a in arms if a.startswith("prime") and a != "prime" and "prime" in arms]:
        pairs = list(zip(results[arm], results["prime"], strict=True))
        ratios = [a["cpu_ms"] / b["cpu_ms"] for a, b in pairs]
        extra = [a["cpu_ms"] - b["cpu_ms"] for a, b in pairs]
        print(
            f"  {arm}/prime cpu, median of per-round ratios {statistics.median(ratios):.3f}x "
            f"({statistics.median(extra):+.2f} ms per response; per round "
            f"{', '.join(f'{x:.3f}' for x in ratios)})"
        )
    digests = {row["sha256"] for rows in results.values() for row in rows if row["r3"]}
    if "upstream" in arms and "prime" in arms:
        print(f"  R3 bodies identical in every arm and round: {len(digests) == 1}")
    benchkit.print_applied(arms, results)
    benchkit.write_json(args.json, "finish", vars(args), results)
    return 0 if len(digests) <= 1 else 1  # one R3 body per round and arm, all the same


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
