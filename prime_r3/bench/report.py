"""Turn per-step meters into the steady-window summary, the table, JSON and the plot."""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np

from prime_r3.bench.workload import BenchConfig


def summarize(result: dict[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    """Means over the steady window (steps after warm-up), in ms per step."""
    if result.get("error") and not result.get("per_step"):
        return {"error": result["error"]}
    steps = {k: np.asarray(v)[cfg.warmup :] for k, v in result["per_step"].items()}
    n = len(steps["wall"])
    if n == 0:
        return {"error": result.get("error") or "no steady-window steps"}

    def ms(name: str) -> float:
        return float(steps[name].mean() * 1e3)

    gc_counts = np.asarray(result["gc_counts"], dtype=np.int64).reshape(-1, 3)[cfg.warmup :]
    # vLLM's share of the work: the main thread minus the model stand-in, plus the writer.
    engine = steps["cpu"] - steps["model"] - steps["client"] + steps["writer"]
    window = result["window"]
    return {
        "error": result.get("error"),
        "steps": n,
        "steps_per_s": float(n / steps["wall"].sum()),
        "wall_ms": ms("wall"),
        "engine_cpu_ms": float(engine.mean() * 1e3),
        # Steps/s if the engine were bound by its own CPU work alone (robust to other load).
        "cpu_bound_steps_per_s": float(1.0 / engine.mean()) if engine.mean() > 0 else 0.0,
        "sched_ms": ms("sched"),
        "aux_ms": ms("aux"),
        "aux_begin_ms": ms("aux_begin"),
        "aux_prepare_ms": ms("aux_prepare"),
        "aux_process_ms": ms("aux_process"),
        "transport_ms": ms("transport"),
        "writer_ms": ms("writer"),
        "model_ms": ms("model"),
        "client_ms": ms("client"),
        "gc_ms": ms("gc"),
        "gc_collections": gc_counts.sum(axis=0).tolist(),
        "preemptions": window["preemptions"],
        "prefix_hit_tokens": window["prefix_hit_tokens"],
        "finished": window["finished"],
        "store_slots": result["store_slots"],
        "store_size": result["store_size"],
        "store_evictions": window["evictions"],
        "store_peak_referenced": result["store_peak_referenced"],
        "active_patches": result.get("active_patches", []),
    }


def combine(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Median of every timing over repeated rounds; counts come from the first round."""
    combined: dict[str, dict[str, Any]] = {}
    for arm, first in rounds[0].items():
        merged = dict(first)
        for key in first:
            if key.endswith("_ms") or key.startswith(("steps_per_s", "cpu_bound")):
                values = [r[arm][key] for r in rounds if key in r.get(arm, {})]
                merged[key] = float(np.median(values))
        if len(rounds) > 1 and "engine_cpu_ms" in first:
            merged["engine_cpu_ms_rounds"] = [r[arm].get("engine_cpu_ms") for r in rounds]
        combined[arm] = merged
    return combined


def add_ratios(summaries: dict[str, dict[str, Any]], baseline: str = "r3_off") -> None:
    """Engine CPU per step and steps/s of each arm relative to R3 off."""
    base = summaries.get(baseline, {})
    for summary in summaries.values():
        if "engine_cpu_ms" in summary and "engine_cpu_ms" in base:
            summary["cpu_vs_off"] = summary["engine_cpu_ms"] / base["engine_cpu_ms"]
            summary["steps_per_s_vs_off"] = summary["steps_per_s"] / base["steps_per_s"]


#: Where each patch acts in this benchmark: the per-step phases (``loop.PHASES`` and the
#: writer thread) whose CPU time it changes. Its effect is measured there, where the rest
#: of the step's noise does not reach, and stated as a share of the whole step.
ACTS_IN = {
    "engine_gc": ("gc",),
    "packed_outputs": ("sched", "aux_process", "transport"),
    "store_eviction": ("writer",),
    "store_headroom": ("writer",),
    "store_growth": ("writer",),
    "batched_commit": ("aux_process", "transport"),
    "batched_take": ("transport",),
}
_SLICED = ("engine", "sched", "aux_process", "transport", "writer", "gc")


def per_slice(result: dict[str, Any], cfg: BenchConfig, slices: int) -> dict[str, list[float]]:
    """Per slice of the window (as ``arms.slice_starts`` cuts it): ms per step of the
    whole engine step (``engine``) and of each phase a patch acts in."""
    per_step = result.get("per_step")
    if not per_step or result.get("error"):
        return {}
    steps = {k: np.asarray(v) for k, v in per_step.items()}
    steps["engine"] = steps["cpu"] - steps["model"] - steps["client"] + steps["writer"]
    bounds = [cfg.warmup + (cfg.steps * k) // slices for k in range(slices + 1)]
    return {
        name: [float(steps[name][a:b].mean() * 1e3) for a, b in itertools.pairwise(bounds)]
        for name in _SLICED
    }


def effects(
    pairs: list[dict[str, dict[str, float]]], base: str = "r3_prime"
) -> list[dict[str, Any]]:
    """What leaving each patch out costs, paired with ``base`` in each round (or slice).

    ``pairs``: per round or slice, per arm, ms per step of ``engine`` and of the phases.
    For ``r3_prime[-NAME]``, a pair's effect is the CPU of the phases NAME acts in
    (``ACTS_IN``) without it minus with it, over ``base``'s whole step: what the patch
    buys, as a share of R3-on CPU per step, measured where it acts. ``whole`` is the
    whole step's ratio (every phase's noise in it). The A/A arm (``r3_prime_again``)
    gets one row per phase set: what arms that cannot differ read there. Medians over
    pairs, with quartiles.
    """
    rows = []
    phase_sets = sorted(set(ACTS_IN.values()))
    arms = dict.fromkeys(arm for pair in pairs for arm in pair)  # an arm missing from one pair
    for arm in arms:
        if arm.startswith("r3_prime[-"):
            name = arm[len("r3_prime[-") : -1]
            sets = [(name, ACTS_IN.get(name, ("engine",)))]
        elif arm == "r3_prime_again":
            sets = [("(A/A)", phases) for phases in phase_sets]
        else:
            continue
        for label, phases in sets:
            share, whole = [], []
            for pair in pairs:
                a, b = pair.get(arm), pair.get(base)
                if not a or not b or not b.get("engine"):
                    continue
                extra = sum(a[ph] for ph in phases) - sum(b[ph] for ph in phases)
                share.append(extra / b["engine"])
                whole.append(a["engine"] / b["engine"])
            if not share:
                continue
            rows.append(
                {
                    "patch": label,
                    "arm": arm,
                    "phases": list(phases),
                    "share": float(np.median(share)),
                    "share_q": [float(np.percentile(share, q)) for q in (25, 75)],
                    "whole": float(np.median(whole)),
                    "whole_q": [float(np.percentile(whole, q)) for q in (25, 75)],
                    "pairs": len(share),
                }
            )
    return rows


def effects_table(rows: list[dict[str, Any]]) -> str:
    """One line per patch: what removing it costs, where it acts and on the whole step."""
    lines = [
        "what each patch buys: CPU of the phases it acts in, without it minus with every "
        "patch, as % of r3_prime's step; and the whole step, without / with (medians of "
        "paired rounds or slices, [quartiles])",
        f"{'patch':>16} {'acts in':>32} {'effect there':>13} {'quartiles':>17} "
        f"{'whole step':>10} {'quartiles':>15} pairs",
    ]
    for row in rows:
        share = f"[{row['share_q'][0]:+.1%}, {row['share_q'][1]:+.1%}]"
        whole = f"[{row['whole_q'][0]:.3f}, {row['whole_q'][1]:.3f}]"
        lines.append(
            f"{row['patch']:>16} {'+'.join(row['phases']):>32} {row['share']:>+13.1%} "
            f"{share:>17} {row['whole']:>10.3f} {whole:>15} {row['pairs']:>5}"
        )
    return "\n".join(lines)


_COLUMNS = (
    ("arm", "{}", 26),
    ("steps/s", "{:.1f}", 8),
    ("cpu ms", "{:.2f}", 7),
    ("x off", "{:.3f}", 6),
    ("sched", "{:.2f}", 6),
    ("aux", "{:.2f}", 6),
    ("transp", "{:.2f}", 6),
    ("writer", "{:.2f}", 6),
    ("gc ms", "{:.2f}", 6),
    ("gc 0/1/2", "{}", 12),
    ("store used/slots", "{}", 17),
    ("evict", "{}", 7),
    ("peak ref", "{}", 8),
    ("preempt", "{}", 7),
    ("hit tok", "{}", 8),
)


def table(summaries: dict[str, dict[str, Any]]) -> str:
    """Fixed-width table, one row per arm."""
    head = " ".join(f"{name:>{width}}" for name, _, width in _COLUMNS)
    lines = [head, "-" * len(head)]
    for arm, s in summaries.items():
        if "engine_cpu_ms" not in s:
            lines.append(f"{arm:>26} FAILED: {s.get('error')}")
            continue
        values = (
            arm,
            s["steps_per_s"],
            s["engine_cpu_ms"],
            s.get("cpu_vs_off", float("nan")),
            s["sched_ms"],
            s["aux_ms"],
            s["transport_ms"],
            s["writer_ms"],
            s["gc_ms"],
            "/".join(str(c) for c in s["gc_collections"]),
            f"{s['store_size']}/{s['store_slots']}",
            s["store_evictions"],
            s["store_peak_referenced"],
            s["preemptions"],
            s["prefix_hit_tokens"],
        )
        cells = [f"{fmt.format(v):>{w}}" for (_, fmt, w), v in zip(_COLUMNS, values, strict=True)]
        lines.append(" ".join(cells))
        if s.get("error"):
            lines.append(f"{'':>26} stopped early: {s['error']}")
    return "\n".join(lines)


def to_json(
    cfg: BenchConfig,
    summaries: dict[str, Any],
    parity: dict[str, Any],
    patches: dict[str, Any] | None = None,
    orders: list[list[str]] | None = None,
    effect_rows: list[dict[str, Any]] | None = None,
    pairs: list[dict[str, Any]] | None = None,
) -> str:
    """The run as JSON; ``patches`` names the vLLM release and what applied there,
    ``orders`` the arm names in the order each round ran them."""
    document = {
        "config": cfg.to_dict(),
        "patches": patches,
        "arms": summaries,
        "parity": parity,
        "arm_order_per_round": orders,
        "effects": effect_rows or [],
        "pairs": pairs or [],
    }
    return json.dumps(document, indent=2)


def plot(results: dict[str, dict[str, Any]], cfg: BenchConfig, path: str) -> None:
    """Per-step engine CPU time of each arm (rolling mean), warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    window = 10
    for arm, result in results.items():
        per_step = result.get("per_step")
        if not per_step:
            continue
        engine = (np.asarray(per_step["cpu"]) - np.asarray(per_step["model"])) + np.asarray(
            per_step["writer"]
        )
        smooth = np.convolve(engine * 1e3, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(len(smooth)) + window - 1, smooth, label=arm, lw=1.2)
    ax.axvspan(0, cfg.warmup, color="0.9", label="warm-up")
    ax.set_xlabel("engine step")
    ax.set_ylabel(f"engine CPU ms / step ({window}-step mean)")
    ax.set_title(f"prime-r3 bench: {cfg.concurrency} concurrent, {cfg.layers}x{cfg.topk} routing")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
