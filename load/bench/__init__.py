"""Benchmarks run as ``python -m load.bench <scenario> [options]``.

Each scenario is a module here exposing ``add_arguments(parser)`` and ``run(args) -> dict``, registered in
``load/bench/__main__.py``, with its settings in a frozen ``Settings`` dataclass and a ``QUICK`` one
(``options.chosen_settings``); results go to ``--results-dir`` (default outside the tree; ``load/results/`` holds the
committed ones) through ``report.write_report``. Scenarios import no other scenario: what several use is in
``harness`` (the strategy benchmarks), ``serving`` (the full-service ones), ``bulk_job``, ``shipped_service``,
``upstream_process``, and outside ``load/bench/`` in ``load.loadgen`` (the load generator) and ``load.stats``
(medians, percentiles).
"""
