"""Run reliability scenarios outside pytest, at CI or full scale, and record their figures.

    python -m tests.reliability.run all --scale full          # every scenario, as in docs/reliability.md
    python -m tests.reliability.run errors-500 overload       # some, at CI scale

Each scenario starts what it needs (its own Ray instance on loopback, the simulated upstream in a subprocess, the
application), prints one Markdown row of the docs/reliability.md table and writes its figures to
``tests/reliability/results/<scenario>-<scale>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from tests.integration.helpers import start_ray_and_serve, stop_ray_and_serve

from . import scenarios
from .scale import SCALES, Scale
from .scenarios import Result, Target
from .setups import churn_target, faults_target, overload_target

RESULTS = Path(__file__).resolve().parent / "results"
SCENARIOS = (*scenarios.UPSTREAM_FAULTS, "overload", "replica-loss", "redeploy")
HEADER = ("| scenario | load | faults | requests (inputs) | ok | clear errors | lost | misrouted | late | "
          "billed / needed (sent) | recovery | command |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def run(names: list[str], scale: Scale, dump: Path | None = None) -> list[Result]:
    results = []
    service = start_ray_and_serve()
    try:
        with ExitStack() as stack:
            targets: dict[str, Target] = {}

            def target(kind: str, factory: Callable[[], object]) -> Target:
                if kind not in targets:
                    targets[kind] = stack.enter_context(factory())
                return targets[kind]

            for name in names:
                started = time.monotonic()
                if name in scenarios.UPSTREAM_FAULTS:
                    secrets = Path(stack.enter_context(tempfile.TemporaryDirectory()))
                    result = scenarios.upstream_fault(
                        target("faults", lambda: faults_target(service.url, secrets)), scale, name)
                elif name == "overload":
                    result = scenarios.overload(target("overload", lambda: overload_target(service.url)), scale)
                elif name in ("replica-loss", "redeploy"):
                    churn = target("churn", lambda: churn_target(service.url, replicas=2))
                    if name == "replica-loss":
                        result = scenarios.replica_loss(churn, scale)
                    else:
                        if len(scenarios.cluster.replicas(churn.app_name, churn.deployment)) != 2:
                            scenarios.cluster.deploy(churn.app_name, churn.prefix, churn.args)
                        scenarios.cluster.wait_for_running_replicas(churn.app_name, churn.deployment, 2)
                        result = scenarios.redeploy(churn, scale)
                else:
                    raise SystemExit(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)} or all")
                result.extra["wall_s"] = round(time.monotonic() - started, 1)
                write(result)
                if dump is not None:
                    write_outcomes(result, dump)
                results.append(result)
                print(row(result), flush=True)
    finally:
        stop_ray_and_serve()
    return results


def write(result: Result) -> None:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{result.scenario}-{result.scale}.json"
    path.write_text(json.dumps(result.to_json(), indent=2, sort_keys=True) + "\n")


def write_outcomes(result: Result, directory: Path) -> None:
    """One JSON line per request (start, latency, kind, status, message), for a timeline of the run."""
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / f"{result.scenario}-{result.scale}.jsonl").open("w") as out:
        for o in result.outcomes:
            out.write(json.dumps({"start": round(o.start, 3), "latency": round(o.latency, 3), "kind": o.kind,
                                  "status": o.status, "code": o.code, "inputs": len(o.plan.inputs),
                                  "priority": o.plan.priority, "timeout_s": o.plan.timeout_s, "late": o.late,
                                  "message": o.message[:200]}) + "\n")


def row(result: Result) -> str:
    c = result.counts
    errors = ", ".join(f"{count}x {status}" for status, count in result.statuses.items()) or "0"
    recovery = "never (within the run)" if result.recovery_s is None else f"normal after {result.recovery_s:g} s"
    if result.scenario == "replica-loss":
        recovery = f"replaced after {result.extra['replaced_after_s']} s; {recovery}"
    elif result.scenario == "redeploy":
        recovery = f"serve.run took {result.extra['redeploy_s']} s; {recovery}"
    command = f"`python -m tests.reliability.run {result.scenario} --scale {result.scale}`"
    billed = f"{result.billed} / {result.needed} ({result.sent_clean})"
    if result.abandoned:
        billed += f", {result.abandoned} in abandoned calls"
    return (f"| {result.scenario} | {result.load} | {result.faults} | {result.requests} ({result.inputs}) | {c['ok']} "
            f"| {c['clear']} ({errors}) | {c['lost']} | {c['misrouted']} | {c['late']} | {billed} | {recovery} "
            f"| {command} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", help=f"{', '.join(SCENARIOS)}, or all")
    parser.add_argument("--scale", choices=sorted(SCALES), default="ci")
    parser.add_argument("--dump", type=Path, help="also write every request's outcome (JSON lines) to this directory")
    args = parser.parse_args(argv)
    names = list(SCENARIOS) if args.scenarios == ["all"] else args.scenarios
    print(HEADER, flush=True)
    results = run(names, SCALES[args.scale], args.dump)
    failed = [r.scenario for r in results if r.counts["lost"] or r.counts["misrouted"] or r.counts["unclear"]]
    if failed:
        print(f"requests lost, misrouted or answered unclearly in: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
