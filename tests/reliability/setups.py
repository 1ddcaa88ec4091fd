"""Each scenario's application and upstream, as context managers shared by the fixtures and the CLI runner."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from . import cluster
from .scenarios import (CHURN_UPSTREAM, CLIENT_KEYS, FAULTS_UPSTREAM, OVERLOAD_UPSTREAM, SCALE_UPSTREAM, Target,
                        churn_app_args, faults_app_args, overload_app_args, scale_app_args, write_secrets)
from .upstream_process import upstream_process

FAULTS_APP, OVERLOAD_APP, CHURN_APP, SCALE_APP = "rel-faults", "rel-overload", "rel-churn", "rel-scale"


@contextmanager
def faults_target(service_url: str, secrets_dir: Path) -> Iterator[Target]:
    """``rel-faults`` (and ``rel-badkey``, an upstream key the upstream refuses) behind an upstream that needs a
    key and refuses poisoned inputs; client keys required. Every secret comes from a file."""
    secrets = write_secrets(secrets_dir)
    with upstream_process(**FAULTS_UPSTREAM) as upstream:
        args = faults_app_args(upstream, secrets)
        cluster.deploy(FAULTS_APP, f"/{FAULTS_APP}", args)
        try:
            yield Target(service_url, FAULTS_APP, f"/{FAULTS_APP}", "rel-faults", upstream, CLIENT_KEYS[0], args)
        finally:
            cluster.delete(FAULTS_APP)


@contextmanager
def overload_target(service_url: str) -> Iterator[Target]:
    with upstream_process(**OVERLOAD_UPSTREAM) as upstream:
        args = overload_app_args(upstream)
        cluster.deploy(OVERLOAD_APP, f"/{OVERLOAD_APP}", args)
        try:
            yield Target(service_url, OVERLOAD_APP, f"/{OVERLOAD_APP}", "rel-overload", upstream, None, args)
        finally:
            cluster.delete(OVERLOAD_APP)


@contextmanager
def churn_target(service_url: str, replicas: int = 2) -> Iterator[Target]:
    with upstream_process(**CHURN_UPSTREAM) as upstream:
        args = churn_app_args(upstream, replicas)
        cluster.deploy(CHURN_APP, f"/{CHURN_APP}", args)
        try:
            yield Target(service_url, CHURN_APP, f"/{CHURN_APP}", "rel-churn", upstream, None, args)
        finally:
            cluster.delete(CHURN_APP)


@contextmanager
def scale_target(service_url: str) -> Iterator[Target]:
    """``rel-scale``: one autoscaling replica in front of a 100 ms upstream (its model is named as the app is)."""
    with upstream_process(**SCALE_UPSTREAM) as upstream:
        args = scale_app_args(upstream, SCALE_APP)
        cluster.deploy(SCALE_APP, f"/{SCALE_APP}", args)
        try:
            yield Target(service_url, SCALE_APP, f"/{SCALE_APP}", SCALE_APP, upstream, None, args)
        finally:
            cluster.delete(SCALE_APP)
