"""Queue-depth autoscaling: as many replicas as it takes to keep each one's queue near a target depth.

Each ``EmbeddingModel`` replica reports ``queue_depth`` (items waiting in its batchers) through
``record_autoscaling_stats``; Serve's controller averages each replica's reports over ``look_back_period_s`` and
passes them to this policy in ``ctx.aggregated_metrics``. The decision is

    desired = ceil(total queue depth / target_queue_depth_per_replica), within [min_replicas, max_replicas]

where the total also counts requests waiting at handles for a free replica slot. Serve then applies its usual
smoothing to the decision (``upscaling_factor`` / ``downscaling_factor``, ``upscale_delay_s`` /
``downscale_delay_s``) and the bounds. In ``autoscaling_config``:

```yaml
policy:
  policy_function: deployments.autoscaling:QueueDepthPolicy
  policy_kwargs: {target_queue_depth_per_replica: 64}
```
Serve pickles this module by value into its controller, so it imports nothing from the rest of the project.
"""

from __future__ import annotations

import math
from typing import Any

QUEUE_DEPTH_METRIC = "queue_depth"


class QueueDepthPolicy:
    def __init__(
        self,
        target_queue_depth_per_replica: float = 64.0,
        metric: str = QUEUE_DEPTH_METRIC,
        include_handle_queue: bool = True,
    ) -> None:
        if not target_queue_depth_per_replica > 0:
            raise ValueError("target_queue_depth_per_replica must be > 0")
        self.target = float(target_queue_depth_per_replica)
        self.metric = metric
        self.include_handle_queue = include_handle_queue

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        depths = (ctx.aggregated_metrics or {}).get(self.metric) or {}
        if not depths:
            # No replica has reported yet (starting, or none running): keep the current target.
            return ctx.target_num_replicas, {}
        total = float(sum(depths.values()))
        if self.include_handle_queue:
            total += float(ctx.total_queued_requests or 0.0)
        desired = math.ceil(total / self.target - 1e-9)
        bounded = max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, desired))
        return bounded, {"total_queue_depth": total}


def queue_depth_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """``QueueDepthPolicy`` with its defaults, for configs that name a function rather than a class."""
    return QueueDepthPolicy()(ctx)
