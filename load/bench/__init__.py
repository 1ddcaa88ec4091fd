"""Benchmarks run as ``python -m load.bench <scenario> [options]``.

Each scenario is a module here exposing ``add_arguments(parser)`` and ``run(args) -> dict``, registered in
``load/bench/__main__.py``; results go to ``load/results/`` through ``load.bench.report``.
"""
