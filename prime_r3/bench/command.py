"""``prime-r3 bench``: flags, the arm run with progress, the report and the parity check."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

from prime_r3.bench import arms as arms_mod
from prime_r3.bench import parity, report
from prime_r3.bench.workload import BenchConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = BenchConfig()
    p.add_argument(
        "-n",
        "--concurrency",
        type=int,
        default=d.concurrency,
        help="concurrent requests in the closed loop",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="measured engine steps per arm")
    p.add_argument("--warmup", type=int, default=d.warmup, help="steps before the window")
    p.add_argument("--layers", type=int, default=d.layers, help="MoE layers")
    p.add_argument("--topk", type=int, default=d.topk, help="experts per token")
    p.add_argument(
        "--experts", type=int, default=d.experts, help="experts per layer; >256 gives uint16 rows"
    )
    p.add_argument("--prefix-len", type=int, default=d.prefix_len, help="shared prefix tokens")
    p.add_argument("--problem-len", type=int, default=d.problem_len, help="per-prompt tokens")
    p.add_argument(
        "--samples-per-prompt",
        type=int,
        default=d.samples_per_prompt,
        help="requests sharing each prompt (GRPO-style groups)",
    )
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help="output length cap")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="scheduler token budget per step",
    )
    p.add_argument(
        "--kv-fraction",
        type=float,
        default=d.kv_fraction,
        help="KV blocks as a fraction of full-length demand (small: it fills)",
    )
    p.add_argument("--kv-blocks", type=int, default=None, help="KV blocks (overrides fraction)")
    p.add_argument(
        "--async-scheduling",
        action="store_true",
        help="two batches in flight, as EngineCore's batch queue runs them",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="workload seed")
    p.add_argument(
        "--patches",
        default="",
        help="also run one arm per patch: comma list of names, or 'each' (every patch that "
        "applies to the installed vLLM)",
    )
    p.add_argument(
        "--without",
        default="",
        help="also run one arm per patch with every other patch on (r3_prime[-NAME]: what "
        "r3_prime loses without it): comma list of names, or 'each'",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run all arms this many times, round-robin; report medians",
    )
    p.add_argument(
        "--again",
        action="store_true",
        help="also run r3_prime a second time as its own arm (r3_prime_again, the A/A arm): "
        "what arms that cannot differ read",
    )
    p.add_argument(
        "--slices",
        type=int,
        default=0,
        help="interleave: start every arm at once and let them take turns, this many slices "
        "of the measured window each (order rotated per slice); the effect table pairs "
        "slices. 0 (default): one arm after another, whole",
    )
    p.add_argument("--no-parity", action="store_true", help="skip row hashing and parity")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON ('-': stdout)")
    p.add_argument("--plot", metavar="PNG", help="plot per-step engine CPU time of each arm")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        concurrency=args.concurrency,
        steps=args.steps,
        warmup=args.warmup,
        layers=args.layers,
        topk=args.topk,
        experts=args.experts,
        prefix_len=args.prefix_len,
        problem_len=args.problem_len,
        samples_per_prompt=args.samples_per_prompt,
        max_tokens=args.max_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_fraction=args.kv_fraction,
        kv_blocks=args.kv_blocks,
        async_scheduling=args.async_scheduling,
        seed=args.seed,
        parity=not args.no_parity,
    )


def check_parity(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Upstream R3 vs every prime_r3 arm; raises ParityError on the first mismatch."""
    base = results.get("r3_upstream")
    checked: dict[str, Any] = {}
    if base is None or "digests" not in base:
        return checked
    for name, result in results.items():
        if name.startswith("r3_prime") and "digests" in result:
            checked[name] = parity.compare(base, result, ("r3_upstream", name))
    return checked


BENCH_EXTRA = "pip install 'prime-r3[bench]'"


def applicable_patches() -> tuple[str | None, list[str], dict[str, str]]:
    """The installed vLLM, the registry patches that apply to it, and why the rest do not.

    Decided by the same guards ``apply()`` runs (``layer.status`` with no ``PRIME_R3*``
    selection), so the ``r3_prime`` arm is "every patch this release can take".
    """
    from prime_r3 import layer

    report = layer.status(environ={})
    applies = [
        o.name
        for o in report.outcomes
        if o.state in (layer.WOULD_APPLY, layer.APPLIED, layer.PENDING)
    ]
    skipped = {o.name: o.reason for o in report.outcomes if o.state == layer.SKIPPED}
    return report.vllm_version, applies, skipped


class Progress:
    """A tqdm bar on a terminal; elsewhere (CI logs, pipes) a plain line every few seconds,
    so a log gets a handful of lines instead of thousands of carriage-return frames."""

    def __init__(self, total: int, stream: TextIO, every_s: float = 5.0) -> None:
        self.total = total
        self.stream = stream
        self.every_s = every_s
        self.done = 0
        self.arm = ""
        self._bar: Any = None
        self._start = self._last = time.monotonic()
        if stream.isatty() and importlib.util.find_spec("tqdm") is not None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="step", file=stream)

    def update(self, arm: str, steps: int) -> None:
        self.done += steps
        if self._bar is not None:
            self._bar.set_description(arm)
            self._bar.update(steps)
            return
        now = time.monotonic()
        if arm != self.arm or now - self._last >= self.every_s or self.done >= self.total:
            self.arm, self._last = arm, now
            print(
                f"prime-r3 bench: {arm}: {self.done}/{self.total} steps, {now - self._start:.0f} s",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _select(
    requested: str, applies: Sequence[str], skipped: dict[str, str], known: Sequence[str]
) -> list[str] | str:
    """The patches named by ``--patches`` or ``--without``, or a one-line error."""
    if requested == "each":
        return list(applies)
    names = list(dict.fromkeys(n for n in requested.split(",") if n))  # one arm per name
    unknown = [n for n in names if n not in known]
    if unknown:
        return f"unknown patch(es) {', '.join(unknown)}; known: {', '.join(known)}"
    blocked = [f"{n} ({skipped.get(n, 'not applicable')})" for n in names if n not in applies]
    if blocked:
        return "cannot apply to the installed vLLM: " + "; ".join(blocked)
    return names


def main(args: argparse.Namespace) -> int:
    from prime_r3.patches import REGISTRY

    cfg = config_from_args(args)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print(f"prime-r3 bench: --plot needs matplotlib: {BENCH_EXTRA}", file=sys.stderr)
        return 2
    if not 0 <= args.slices <= cfg.steps:
        print(
            f"prime-r3 bench: --slices {args.slices}: must be in 0..{cfg.steps} (--steps)",
            file=sys.stderr,
        )
        return 2
    version, applies, skipped = applicable_patches()
    known = [s.name for s in REGISTRY]
    per_patch = _select(args.patches, applies, skipped, known)
    if isinstance(per_patch, str):
        print(f"prime-r3 bench: --patches {args.patches}: {per_patch}", file=sys.stderr)
        return 2
    left_out = _select(args.without, applies, skipped, known)
    if isinstance(left_out, str):
        print(f"prime-r3 bench: --without {args.without}: {left_out}", file=sys.stderr)
        return 2
    arms = arms_mod.default_arms(applies, per_patch, left_out, again=args.again)
    print(
        f"prime-r3 bench on vllm {version}: {len(arms)} arms x {cfg.total_steps} steps "
        f"({cfg.warmup} warm-up + {cfg.steps} measured), "
        f"{cfg.concurrency} concurrent, {cfg.num_kv_blocks} KV blocks, "
        f"{cfg.layers}x{cfg.topk} routing ({'async' if cfg.async_scheduling else 'sync'} "
        "scheduling)",
        file=sys.stderr,
    )
    header = _patch_header(version, applies, skipped)
    print(header, file=sys.stderr)
    repeats = max(args.repeat, 1)
    orders = arm_orders(arms, repeats)
    progress = Progress(repeats * len(arms) * cfg.total_steps, sys.stderr)
    rounds = []
    try:
        # Round-robin repeats, so slow drift in other load on the box hits every arm alike,
        # each round in another order (see arm_orders).
        for number, order in enumerate(orders, 1):
            if repeats > 1:
                print(f"prime-r3 bench: {_order_line(number, order)}", file=sys.stderr)
            if args.slices > 0:
                res = arms_mod.run_interleaved(
                    order, cfg, args.slices, lambda arm, n: progress.update(arm.name, n)
                )
            else:
                res = arms_mod.run_arms(order, cfg, lambda arm, n: progress.update(arm.name, n))
            rounds.append({arm.name: res[arm.name] for arm in arms if arm.name in res})
    finally:
        progress.close()
    results = rounds[0]
    summaries = report.combine(
        [{name: report.summarize(r, cfg) for name, r in res.items()} for res in rounds]
    )
    report.add_ratios(summaries)
    status = 0
    try:
        checked = {}
        for res in rounds if cfg.parity else []:
            checked = check_parity(res)
        parity_note = {"ok": True, "checked": checked}
    except parity.ParityError as error:
        parity_note = {"ok": False, "error": str(error)}
        status = 1
    if any(r.get("error") for r in results.values()):
        status = 1
    out = sys.stderr if args.json == "-" else sys.stdout  # keep stdout pure JSON
    print(header, file=out)
    print(report.table(summaries), file=out)
    print(_parity_line(parity_note), file=out)
    if repeats > 1:
        print("arm order per round:", file=out)
        for number, order in enumerate(orders, 1):
            print(f"  {_order_line(number, order)}", file=out)
    slices = max(args.slices, 1)  # whole rounds are one slice each
    pairs = []
    for res in rounds:
        cuts = {n: report.per_slice(r, cfg, slices) for n, r in res.items()}
        for k in range(slices):
            pairs.append({n: {ph: v[k] for ph, v in c.items()} for n, c in cuts.items() if c})
    effect_rows = report.effects(pairs)
    if effect_rows:
        print(report.effects_table(effect_rows), file=out)
    fast_path = _fast_path_lines(results)
    if fast_path:
        print(fast_path, file=out)
    if args.json:
        text = report.to_json(
            cfg,
            summaries,
            parity_note,
            {"vllm": version, "applied": applies, "skipped": skipped},
            [[arm.name for arm in order] for order in orders],
            effect_rows,
            pairs,
        )
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.plot:
        report.plot(results, cfg, args.plot)
    return status


def arm_orders(arms: Sequence[arms_mod.Arm], repeats: int) -> list[list[arms_mod.Arm]]:
    """The order the arms run in, per round: round ``k`` starts ``k`` arms further on.

    Why: with one fixed order the last arm of every round ran ~12% slow in every column,
    sched and transp too, which most per-patch arms do not touch: a position effect, not
    the patch's. Rotating puts each arm at another position in each round (with at least
    as many arms as rounds, never twice at the same one), so the per-arm medians over
    rounds no longer charge one arm with the position. The baselines (r3_off,
    r3_upstream, r3_prime) rotate with the rest. Deterministic, so a run can be repeated
    as it was; the report prints the order each round used.
    """
    arms = list(arms)
    if not arms:
        return [[] for _ in range(repeats)]
    return [arms[k % len(arms) :] + arms[: k % len(arms)] for k in range(repeats)]


def _order_line(number: int, order: Sequence[arms_mod.Arm]) -> str:
    return f"round {number}: " + ", ".join(arm.name for arm in order)


def _fast_path_lines(results: dict[str, dict[str, Any]]) -> str:
    """Per arm and counting patch: requests its fast path took vs upstream's code, and
    packed_outputs' handshake (steps sent packed vs withheld, by reason), in the window."""
    lines = []
    for arm, result in results.items():
        if c := result.get("handshake"):
            # Withheld steps go per request (upstream's form): the packed path's fallback.
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(c["withheld_reasons"].items()) if v)
            lines.append(
                f"  {arm} packed_outputs: {c['declared_steps']} steps declared packed / "
                f"{c['withheld_steps']} withheld ({reasons or 'none withheld'})"
            )
        for patch, c in (result.get("fast_path") or {}).items():
            reasons = ", ".join(f"{k} {v}" for k, v in sorted(c["fallback_reasons"].items()) if v)
            lines.append(
                f"  {arm} {patch}: {c['fast_requests']} fast / {c['fallback_requests']} "
                f"upstream requests over {c['steps']} steps ({reasons or 'no fallback'})"
            )
    return (
        "fast path vs upstream (first round, measured window):\n" + "\n".join(lines)
        if lines
        else ""
    )


def _parity_line(note: dict[str, Any]) -> str:
    if not note["ok"]:
        return f"PARITY FAILED: {note['error']}"
    if not note["checked"]:
        return "parity: not checked"
    parts = [
        f"{name}: {c['finished_requests']} finished + {c['in_flight_requests']} in flight / "
        f"{c['rows']} rows identical "
        f"({c['preempted_requests']} preempted, {c['prefix_hit_requests']} prefix-hit)"
        for name, c in note["checked"].items()
    ]
    return "parity vs r3_upstream:\n  " + "\n  ".join(parts)


def _patch_header(version: str | None, applies: Sequence[str], skipped: dict[str, str]) -> str:
    lines = [f"vllm {version}: r3_prime = {', '.join(applies) or 'no patch'}"]
    lines += [f"  skipped on vllm {version}: {name}: {why}" for name, why in skipped.items()]
    return "\n".join(lines)
