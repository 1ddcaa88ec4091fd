"""``python -m load.bench <scenario> [options]``: one subcommand per scenario module in ``load/bench/``."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from .report import add_results_dir_argument
from .serving import use_serve_env

# Scenario name -> module. A module exposes ``add_arguments(parser)`` and ``run(args) -> dict``; its docstring's
# first line is the subcommand's help. Every scenario takes ``--results-dir`` and ``--quick`` (a tiny run: its
# ``QUICK`` settings, see ``options.chosen_settings``). Adding a scenario is one line here.
SCENARIOS: dict[str, str] = {
    "overhead": "load.bench.overhead",
    "seed-table": "load.bench.seed_table",
    "sweep": "load.bench.sweep",
    "priority": "load.bench.priority",
    "e2e": "load.bench.e2e",
    "local": "load.bench.local",
    "bulk": "load.bench.bulk",
    "bulk-rerun": "load.bench.bulk_rerun",
    "backlog": "load.bench.backlog",
    "peers": "load.bench.peers",
    "cluster": "load.bench.cluster",
    "quota": "load.bench.quota",
    "batch": "load.bench.batch",
    "tenants": "load.bench.tenants",
    "tenant-limits": "load.bench.tenant_limits",
    "tune": "load.bench.tune",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m load.bench", description=__doc__)
    common = argparse.ArgumentParser(add_help=False)
    add_results_dir_argument(common)
    common.add_argument("--quick", action="store_true", help="a tiny run for CI smoke tests")
    subcommands = parser.add_subparsers(dest="scenario", required=True, metavar="scenario")
    for name, module_name in SCENARIOS.items():
        module = importlib.import_module(module_name)
        summary = (module.__doc__ or name).strip().splitlines()[0]
        sub = subcommands.add_parser(
            name,
            parents=[common],
            help=summary.replace("%", "%%"),  # argparse formats help strings with %
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


# Scenarios that start Ray as a cluster's nodes do, without serve.env (docs/cluster.md): `cluster`,
# and those of ON_NODES on more than one node.
WITHOUT_SERVE_ENV = {"cluster"}
ON_NODES = {"quota", "tenant-limits"}


def starts_a_cluster(argv: Sequence[str]) -> bool:
    if argv[:1] and argv[0] in ON_NODES:
        nodes = argparse.ArgumentParser(add_help=False)
        nodes.add_argument("--nodes", type=int, default=1)
        return nodes.parse_known_args(argv[1:])[0].nodes > 1
    return bool(argv[:1]) and argv[0] in WITHOUT_SERVE_ENV


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The others run Ray as `serve run` does; this must precede the scenarios' imports of Ray Serve.
    if argv[:1] and not starts_a_cluster(argv):
        use_serve_env(blocking_handles=True)
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
