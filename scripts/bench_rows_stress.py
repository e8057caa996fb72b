"""Thousands of long R3 requests in flight through vLLM's real ``OutputProcessor``.

    prime-r3 bench rows-stress [--requests 10000] [--rounds 1] [--abort 0.1] [--json PATH]

The API server's output loop (``AsyncLLM``'s path: every request with its real
``RequestOutputCollector``, ``RequestOutputKind.FINAL_ONLY`` as an RL client asks) at the
scale of issue 36: ``--requests`` requests added to vLLM's real ``OutputProcessor``
(its real constructor), then fed ``EngineCoreOutputs`` step by step (the prompt's rows
first, then one row per request and step, each chunk an array of its own as the client
decodes it), so that every request's rows pass ``--past`` (256 KiB; response_rows folds
them into a mapping from its ``MAPPED_FROM``, 16 KiB) while all are in flight. Each
request ends at a seeded random step (rows
between just past ``--past`` and ``--spread`` more), so requests finish in random order,
the outputs of a step in a random order too; ``--abort`` of them (those that run past the
step where all have passed ``--past``) are aborted at a random step after it through
``abort_requests``, as a client disconnect does. Every finished or aborted request's
``routed_experts`` is hashed (dtype, shape, bytes) and dropped, as the API server sends it
and drops it; ``--keep-finished`` keeps them all to the end instead (an offline
``LLM.generate``), which fills response_rows' cap on handed-out mappings.

Arms, each in a fresh interpreter per round (``scripts/benchkit.py``; arms rotated over
rounds): ``upstream`` (``PRIME_R3=0``) and ``prime`` (the overlay, response_rows
applied; ``--cap N`` sets its ``MAX_IN_FLIGHT`` and ``MAX_HANDED_OUT`` to N, so a small
run meets the caps). Per arm, sampled in the loop's own thread after every
``--sample-every`` steps and the step where all rows pass ``--past`` (the same points in
both arms): RSS and Pss (``/proc/self/smaps_rollup``; also the peak's rise above the
arm's start, before any request, which leaves out what the overlay's import adds), the
process's map count (lines of ``/proc/self/maps``) and response_rows' own counts of
mappings in flight and handed out; besides: ``ru_maxrss`` (the kernel's exact peak),
the map count at the end, errors (an exception in the loop, or a finished request
without its rows or with a wrong row count), wall time of the run and CPU time spent in
the output processor (``add_request``, ``process_outputs``, ``abort_requests``: the API
server's part; building the steps, taking and hashing the outputs and sampling are left
out). Printed: medians over rounds per arm, ``prime/upstream``, the spread (min-max over
rounds), and the parity line: every request's hash identical in every
arm and round. Exit 1 on a parity mismatch or an error.

Memory: about ``--requests`` x ``--past`` x 1.1 of rows per arm (10,000 requests: ~2.9 GB
for prime, more for upstream's one array per step); arms run one after the other.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchkit  # noqa: E402

ARMS = {"upstream": {"PRIME_R3": "0"}, "prime": {}}


@dataclass(frozen=True)
class Plan:
    """The workload, the same in every arm: request ``i`` is added as ``ids[i]`` in a
    seeded random order, delivers ``prompt`` rows at step 0 and one row at each later
    step, and ends at ``ends[i]`` (finished, ``FinishReason.LENGTH``) or, if
    ``aborts[i]`` > 0, is aborted after step ``aborts[i]`` (< ``ends[i]``)."""

    ids: list[str]
    ends: list[int]
    aborts: list[int]
    prompt: int
    row_shape: tuple[int, int]
    experts: int
    seed: int
    crossing: int  # the first step after which every request's rows are past ``--past``

    @property
    def steps(self) -> int:
        return max(self.ends) + 1


def make_plan(
    requests: int,
    past: int,
    layers: int,
    topk: int,
    experts: int = 128,
    prompt: int = 16,
    spread: float = 0.25,
    abort: float = 0.1,
    seed: int = 0,
) -> Plan:
    import numpy as np

    itemsize = 1 if experts <= 256 else 2
    row_bytes = layers * topk * itemsize
    rows_past = past // row_bytes + 1  # rows whose bytes are past ``past``
    if rows_past <= prompt:
        raise ValueError(f"--past {past}: the prompt's {prompt} rows already pass it")
    crossing = rows_past - prompt  # after this step every request has rows_past rows
    rng = np.random.default_rng(seed)
    most = max(crossing, int(crossing + rows_past * spread))
    ends = [int(x) for x in rng.integers(crossing, most + 1, size=requests)]
    aborts = [0] * requests
    for i in range(requests):
        if ends[i] > crossing and rng.random() < abort:
            aborts[i] = int(rng.integers(crossing, ends[i]))
    order = rng.permutation(requests)
    ids = [f"req-{int(k)}" for k in order]
    return Plan(ids, ends, aborts, prompt, (layers, topk), experts, seed, crossing)


def _rollup() -> tuple[int, int]:
    """RSS and Pss of this process, bytes (``/proc/self/smaps_rollup``)."""
    rss = pss = 0
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    return rss, pss


def map_count() -> int:
    """The process's mappings as the kernel counts them against ``vm.max_map_count``."""
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


def rows_vmas() -> int:
    """VMAs of response_rows' mappings as the kernel shows them: private read-write VMAs
    advised ``MADV_NOHUGEPAGE`` (``nh``) that are not a thread's stack (glibc advises those
    too, above a ``---p`` guard page); neighbours may merge into one VMA."""
    vmas: list[list[Any]] = []  # [permissions, nh]
    with open("/proc/self/smaps") as f:
        for line in f:
            if line[0] in "0123456789abcdef":
                vmas.append([line.split()[1], False])
            elif line.startswith("VmFlags:"):
                vmas[-1][1] = "nh" in line.split()
    return sum(
        1
        for below, (perms, nh) in zip([None, *vmas], vmas, strict=False)
        if nh and perms == "rw-p" and not (below and below[0] == "---p" and below[1])
    )


def _digest(rows: Any) -> str:
    h = hashlib.sha256(f"{rows.dtype.str}{rows.shape}".encode())
    h.update(rows)  # C-contiguous: its bytes
    return h.hexdigest()[:24]


def drive(
    plan: Plan,
    sample_every: int = 1,
    keep_finished: bool = False,
    on_sample: Any = None,
) -> dict[str, Any]:
    """Run ``plan`` through a real ``OutputProcessor`` in this process; return the
    per-request digests, errors, samples and times (see the module docstring).
    ``on_sample(step)`` runs at each sample point (tests check the mappings there)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor, RequestOutputCollector

    from prime_r3.fixes import response_rows

    dtype = np.uint8 if plan.experts <= 256 else np.uint16
    params = SamplingParams(
        max_tokens=1 << 20, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
    )
    processor = OutputProcessor(None, log_stats=False)
    queues: dict[str, Any] = {}
    n = len(plan.ids)
    expected_rows = [
        plan.prompt + (plan.aborts[i] or plan.ends[i]) for i in range(n)
    ]  # rows each request's output must carry
    digests: dict[str, str] = {}
    errors: list[str] = []
    kept: list[Any] = []
    samples: list[list[float]] = []  # [step, rss, pss, maps, in_flight, handed_out]

    def sample(step: int) -> None:
        rss, pss = _rollup()
        samples.append(
            [step, rss, pss, map_count(), len(response_rows._IN_FLIGHT),
             len(response_rows._HANDED_OUT)]
        )  # fmt: skip
        if on_sample is not None:
            on_sample(step)

    def collect(i: int) -> None:
        rid = plan.ids[i]
        output = queues.pop(rid).get_nowait()
        if output is None or not output.finished:
            errors.append(f"{rid}: no final output")
            return
        rows = output.outputs[0].routed_experts
        if rows is None or rows.shape != (expected_rows[i], *plan.row_shape):
            shape = None if rows is None else rows.shape
            errors.append(f"{rid}: rows {shape}, expected {expected_rows[i]} rows")
            return
        digests[rid] = _digest(rows)
        if keep_finished:
            kept.append(rows)

    ran = True
    start_maps = map_count()
    sample(-1)
    wall0 = time.perf_counter()
    cpu = 0.0
    try:
        for rid in plan.ids:
            request = EngineCoreRequest(
                rid, [1] * plan.prompt, None, params, None, 0.0, None, None, None,
                external_req_id=rid,
            )  # fmt: skip
            queues[rid] = RequestOutputCollector(RequestOutputKind.FINAL_ONLY, rid)
            t0 = time.process_time()
            processor.add_request(request, None, queue=queues[rid])
            cpu += time.process_time() - t0
        active = list(range(n))
        for step in range(plan.steps):
            width = plan.prompt if step == 0 else 1
            rng = np.random.default_rng([plan.seed, step])
            snapshot = rng.integers(
                0, plan.experts, (len(active) * width, *plan.row_shape), dtype=dtype
            )
            order = rng.permutation(len(active))  # this step's outputs in a random order
            outputs = []
            for j in order.tolist():
                i = active[j]
                outputs.append(
                    EngineCoreOutput(
                        request_id=plan.ids[i],
                        new_token_ids=[7],
                        routed_experts=snapshot[j * width : (j + 1) * width].copy(),
                        finish_reason=FinishReason.LENGTH if plan.ends[i] == step else None,
                    )
                )
            del snapshot
            aborted = [i for i in active if step and plan.aborts[i] == step]
            finished = [i for i in active if plan.ends[i] == step]
            t0 = time.process_time()
            result = processor.process_outputs(outputs)
            del outputs
            if result.request_outputs or result.reqs_to_abort:
                errors.append(f"step {step}: outputs not sent to their collectors")
            if aborted:
                processor.abort_requests([plan.ids[i] for i in aborted], internal=False)
            cpu += time.process_time() - t0
            for i in finished + aborted:
                collect(i)
            if finished or aborted:
                gone = set(finished) | set(aborted)
                active = [i for i in active if i not in gone]
            if step % sample_every == 0 or step in (plan.crossing, plan.steps - 1):
                sample(step)
    except Exception as error:  # noqa: BLE001 - any error in vLLM's loop is the finding
        import traceback

        errors.append("".join(traceback.format_exception_only(error)).strip())
        ran = False
    wall = time.perf_counter() - wall0
    missing = [rid for rid in plan.ids if rid not in digests]
    if missing and ran:
        errors.append(f"{len(missing)} request(s) without an output, e.g. {missing[0]}")
    left = len(processor.request_states)
    if left:
        errors.append(f"{left} request state(s) left in the output processor")
    kept.clear()
    sample(plan.steps)
    return {
        "digests": digests,
        "errors": errors,
        "samples": samples,
        "start_maps": start_maps,
        "wall_s": wall,
        "cpu_s": cpu,
        "finished": sum(1 for i in range(n) if not plan.aborts[i] and plan.ids[i] in digests),
        "aborted": sum(1 for i in range(n) if plan.aborts[i] and plan.ids[i] in digests),
    }


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One arm in this (fresh) interpreter: its JSON row."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import prime_r3

    prime_r3.apply(log=False)
    import vllm

    from prime_r3.fixes import response_rows

    if args.cap:
        response_rows.MAX_IN_FLIGHT = response_rows.MAX_HANDED_OUT = args.cap
    plan = _plan(args)
    response_rows.COUNTERS.reset()
    run = drive(plan, args.sample_every, args.keep_finished)
    samples = run.pop("samples")
    base = samples[0]
    rows = samples[1:-1] or samples
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {
        **run,
        "base_rss": base[1],
        "base_pss": base[2],
        "base_maps": base[3],
        "peak_rss": max(s[1] for s in rows),
        "peak_pss": max(s[2] for s in rows),
        "rss_rise": max(s[1] for s in rows) - base[1],
        "maxrss": usage.ru_maxrss * 1024,
        "max_maps": max(s[3] for s in samples),
        "end_maps": samples[-1][3],
        "max_in_flight": max(s[4] for s in samples),
        "max_handed_out": max(s[5] for s in samples),
        "rows_vmas_end": rows_vmas(),
        "cap_in_flight": response_rows.MAX_IN_FLIGHT,
        "cap_handed_out": response_rows.MAX_HANDED_OUT,
        "counters": response_rows.COUNTERS.snapshot(),
        "applied": [p for p in benchkit.applied_patches() if "(" not in p],
        "package": str(Path(prime_r3.__file__).resolve().parent),
        "vllm": str(Path(vllm.__file__).parent.absolute()),
    }


def _plan(args: argparse.Namespace) -> Plan:
    return make_plan(
        args.requests, args.past, args.layers, args.topk, args.experts, args.prompt,
        args.spread, args.abort, args.seed,
    )  # fmt: skip


GB = 1e9
#: (column, label, scale, format) of the table.
COLUMNS = (
    ("peak_rss", "peak RSS GB", GB, "{:.3f}"),
    ("peak_pss", "peak Pss GB", GB, "{:.3f}"),
    ("maxrss", "maxrss GB", GB, "{:.3f}"),
    ("base_rss", "start RSS GB", GB, "{:.3f}"),
    ("rss_rise", "peak - start RSS GB", GB, "{:.3f}"),
    ("max_maps", "max maps", 1, "{:.0f}"),
    ("end_maps", "end maps", 1, "{:.0f}"),
    ("wall_s", "wall s", 1, "{:.1f}"),
    ("cpu_s", "loop CPU s", 1, "{:.1f}"),
)


def report(arms: list[str], results: dict[str, list[dict[str, Any]]], plan: Plan) -> int:
    """Print the table, the ratios, the caps and the parity line; the exit status."""
    med = {arm: benchkit.medians(rows, [c for c, *_ in COLUMNS]) for arm, rows in results.items()}
    width = max(len(label) for _, label, *_ in COLUMNS)
    print(f"{'':{width}} " + " ".join(f"{arm:>22}" for arm in arms) + "  prime/upstream")
    for column, label, scale, fmt in COLUMNS:
        cells = []
        for arm in arms:
            values = [r[column] / scale for r in results[arm]]
            cell = fmt.format(med[arm][column] / scale)
            if len(values) > 1:
                cell += f" ({fmt.format(min(values))}-{fmt.format(max(values))})"
            cells.append(f"{cell:>22}")
        ratio = ""
        if "upstream" in med and "prime" in med and med["upstream"][column]:
            ratio = f"{med['prime'][column] / med['upstream'][column]:.3f}"
        print(f"{label:{width}} " + " ".join(cells) + f"  {ratio:>14}")
    status = 0
    for arm in arms:
        rows = results[arm]
        errors = sum(len(r["errors"]) for r in rows)
        first = next((r["errors"][0] for r in rows if r["errors"]), "")
        maps = [r["max_maps"] - r["base_maps"] for r in rows]
        line = (
            f"  {arm}: {rows[0]['finished']} finished + {rows[0]['aborted']} aborted, "
            f"errors {errors}{': ' + first if first else ''}; maps above the start: max "
            f"{max(maps)}"
        )
        if arm == "prime":
            cap = rows[0]["cap_in_flight"] + rows[0]["cap_handed_out"]
            line += (
                f" (cap {rows[0]['cap_in_flight']} in flight + {rows[0]['cap_handed_out']} "
                f"handed out: {'within' if max(maps) <= cap else 'ABOVE'}); response_rows "
                f"mappings in flight max {max(r['max_in_flight'] for r in rows)}, handed out "
                f"max {max(r['max_handed_out'] for r in rows)}; counters (first round) "
                f"{rows[0]['counters']}"
            )
            status |= int(max(maps) > cap)
        print(line)
        status |= int(errors > 0)
    if "upstream" in med and "prime" in med:
        for column in ("peak_rss", "peak_pss"):
            pairs = zip(results["upstream"], results["prime"], strict=True)
            ratios = [p[column] / u[column] for u, p in pairs]
            benchkit.print_per_round(f"prime/upstream {column}", ratios)
    reference = results[arms[0]][0]["digests"]
    mismatch = ""
    for arm in arms:
        for k, row in enumerate(results[arm]):
            if row["digests"] != reference:
                rid = next((r for r in plan.ids if row["digests"].get(r) != reference.get(r)), "?")
                mismatch = mismatch or f"{arm} round {k}: {rid} differs from {arms[0]} round 0"
    if mismatch:
        print(f"PARITY FAILED: {mismatch}")
        status = 1
    else:
        print(
            f"  parity: {len(reference)} requests' routed_experts identical in every arm "
            f"and round ({', '.join(arms)} x {len(results[arms[0]])})"
        )
    benchkit.print_applied(arms, results)
    return status


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="prime-r3 bench rows-stress", description=__doc__.split("\n")[0]
    )
    p.add_argument("--requests", type=int, default=10_000, help="requests in flight")
    p.add_argument("--past", type=int, default=1 << 18, help="rows bytes every request passes")
    p.add_argument("--spread", type=float, default=0.25, help="rows beyond --past, at most")
    p.add_argument("--layers", type=int, default=46)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=128, help=">256: uint16 rows")
    p.add_argument("--prompt", type=int, default=16, help="prompt rows (the first chunk)")
    p.add_argument("--abort", type=float, default=0.1, help="fraction aborted")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--arms", default=",".join(ARMS), help=f"from {','.join(ARMS)}")
    p.add_argument("--sample-every", type=int, default=1, help="steps between samples")
    p.add_argument("--cap", type=int, default=0, help="response_rows' two caps (0: its own)")
    p.add_argument("--keep-finished", action="store_true", help="keep every output's rows")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    arms = list(dict.fromkeys(a.strip() for a in args.arms.split(",") if a.strip()))
    if not arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms {args.arms!r}: choose from {', '.join(ARMS)}")
    if min(args.requests, args.rounds, args.sample_every) < 1:
        raise SystemExit("--requests, --rounds and --sample-every must be at least 1")
    plan = _plan(args)
    for name in [k for k in os.environ if k.startswith("PRIME_R3")]:
        del os.environ[name]  # each arm's own settings only (ARMS)
    child_argv = ["--child", *_forwarded(argv)]
    results: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm in benchkit.rotated(arms, r):
            try:
                row = benchkit.run_child(
                    __file__, child_argv, str(benchkit.ROOT), arm, env=ARMS[arm]
                )
            except subprocess.CalledProcessError as failed:
                print(f"the {arm} arm failed:\n{failed.stderr[-4000:]}", file=sys.stderr)
                return 1
            applied = "response_rows" in row["applied"]
            if applied != (arm == "prime"):
                raise SystemExit(f"the {arm} arm ran {row['applied']}: it measured other code")
            results[arm].append(row)
            print(
                f"round {r} {arm}: {row['wall_s']:.0f} s, peak RSS {row['peak_rss'] / GB:.3f} GB",
                file=sys.stderr,
                flush=True,
            )
    rows_each = [plan.prompt + e for e in plan.ends]
    print(
        f"rows-stress: {args.requests} requests in flight, {plan.row_shape[0]} x "
        f"{plan.row_shape[1]} rows of {'uint8' if plan.experts <= 256 else 'uint16'}, "
        f"{min(rows_each)}-{max(rows_each)} rows each (past {args.past} B after step "
        f"{plan.crossing}), {sum(1 for a in plan.aborts if a)} aborted, {plan.steps} steps, "
        f"{args.rounds} round(s) (medians, min-max; arms rotated)"
    )
    status = report(arms, results, plan)
    summary = {
        arm: [{k: v for k, v in row.items() if k != "digests"} for row in rows]
        for arm, rows in results.items()
    }
    benchkit.write_json(args.json, "rows-stress", vars(args), summary)
    return status


def _forwarded(argv: list[str]) -> list[str]:
    """The workload's flags for the child (not ``--json``, ``--rounds`` or ``--arms``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.split("=")[0] in ("--json", "--rounds", "--arms"):
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
