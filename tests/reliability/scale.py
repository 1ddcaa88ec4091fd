"""How big each scenario runs: ``ci`` (seconds of load, the default) or ``full`` (the figures in docs/reliability.md).

Choose with ``RELIABILITY_SCALE=full`` (pytest) or ``python -m tests.reliability.run <scenario> --scale full``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SCALE_ENV = "RELIABILITY_SCALE"


@dataclass(frozen=True)
class Scale:
    name: str
    rate_per_s: float  # requests offered per second in the upstream-fault, replica and redeploy scenarios
    baseline_s: float  # calm load before the fault
    fault_s: float  # the fault window (continuous faults, overload)
    recovery_s: float  # calm load after the fault
    down_s: float  # how long the upstream is down
    churn_s: float  # load after a replica is killed, or while the app is redeployed
    overload_s: float  # how long 5x capacity is offered
    fuzz_examples: int  # hypothesis examples per fuzz property


CI = Scale("ci", rate_per_s=20, baseline_s=1.0, fault_s=3.0, recovery_s=2.5, down_s=3.0, churn_s=12.0,
           overload_s=3.0, fuzz_examples=150)
FULL = Scale("full", rate_per_s=40, baseline_s=5.0, fault_s=30.0, recovery_s=10.0, down_s=10.0, churn_s=30.0,
             overload_s=30.0, fuzz_examples=2000)
SCALES = {scale.name: scale for scale in (CI, FULL)}


def current_scale() -> Scale:
    name = os.environ.get(SCALE_ENV, "ci").strip().lower() or "ci"
    if name not in SCALES:
        raise ValueError(f"{SCALE_ENV} must be one of {', '.join(SCALES)}, not {name!r}")
    return SCALES[name]
