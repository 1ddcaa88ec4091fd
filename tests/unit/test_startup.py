"""What ``build_app`` tells the person who typed ``serve run``: serve.env's settings missing from Ray's environment,
and a config refused before anything is deployed (each model's directory included)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from deployments import startup
from deployments.app import build_app
from deployments.config import ConfigError
from deployments.model.backends.model_dir import packaged_model_path
from deployments.startup import (SERVE_ENV_FILE, UNSET_COSTS, ignores, is_serve_run, refuse, serve_env_settings,
                                 serve_env_warning, serves_something)

SHIPPED = serve_env_settings()


def test_the_shipped_serve_env_is_read_and_holds_every_setting_whose_cost_is_named() -> None:
    assert SERVE_ENV_FILE.name == "serve.env" and SHIPPED is not None
    assert set(UNSET_COSTS) <= set(SHIPPED)
    assert "RAY_AUTH_MODE" in SHIPPED  # a second shell that sources it can run `serve status`


def test_nothing_is_said_when_ray_has_all_of_serve_env() -> None:
    assert serve_env_warning(dict(SHIPPED)) is None
    changed = {**SHIPPED, "RAY_SERVE_HAPROXY_NBTHREAD": "4"}  # another value is a choice, not a miss
    assert serve_env_warning(changed) is None


def test_without_serve_env_the_warning_names_what_is_off_and_what_it_costs() -> None:
    warning = serve_env_warning({"PATH": "/usr/bin"})
    assert warning is not None and warning.startswith("WARNING: Ray was started without")
    assert f"{len(SHIPPED)} of serve.env's {len(SHIPPED)} settings" in warning
    assert "RAY_SERVE_ENABLE_HA_PROXY is unset: HAProxy is off" in warning and "about half the throughput" in warning
    assert "RAY_SERVE_THROUGHPUT_OPTIMIZED is unset" in warning
    assert "also unset: " in warning and "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" in warning
    assert "set -a && . ./serve.env && set +a && serve run serve_config.yaml" in warning


def test_only_the_missing_settings_are_named(tmp_path: Path) -> None:
    env_file = tmp_path / "serve.env"
    env_file.write_text("# a comment\nRAY_SERVE_ENABLE_HA_PROXY=1\nSOME_OTHER=2\nKEPT=3\n")
    warning = serve_env_warning({"KEPT": "3"}, env_file)
    assert "2 of serve.env's 3 settings" in warning
    assert "RAY_SERVE_ENABLE_HA_PROXY is unset" in warning and "also unset: SOME_OTHER " in warning
    assert "KEPT" not in warning and "THROUGHPUT_OPTIMIZED" not in warning
    assert serve_env_warning({"RAY_SERVE_ENABLE_HA_PROXY": "0", "SOME_OTHER": "", "KEPT": "3"}, env_file) is None


def test_an_installed_package_without_serve_env_checks_the_key_settings_by_name(tmp_path: Path) -> None:
    absent = tmp_path / "nowhere" / "serve.env"
    assert serve_env_settings(absent) is None
    warning = serve_env_warning({}, absent)
    assert "without serve.env's settings" in warning
    assert all(f"{name} is unset" in warning for name in UNSET_COSTS) and "also unset" not in warning
    assert serve_env_warning(dict.fromkeys(UNSET_COSTS, "x"), absent) is None


def test_build_app_prints_the_warning_to_stderr(capsys, monkeypatch) -> None:
    for name in SHIPPED:
        monkeypatch.delenv(name, raising=False)
    build_app({"models": [{"name": "m"}]})
    assert "RAY_SERVE_ENABLE_HA_PROXY is unset" in capsys.readouterr().err
    for name, value in SHIPPED.items():
        monkeypatch.setenv(name, value)
    build_app({"models": [{"name": "m"}]})
    assert "WARNING" not in capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["/srv/.venv/bin/python", "/srv/.venv/bin/serve", "run", "serve_config.yaml"], True),
    (["serve", "run", "serve_config.yaml"], True),
    (["/srv/.venv/bin/python", "/srv/.venv/bin/serve", "status"], False),
    (["python", "-m", "pytest", "run"], False),
    (["/srv/.venv/bin/python", "/srv/observe", "run"], False),
    ([""], False),
])
def test_only_the_serve_run_command_is_recognised(argv, expected) -> None:
    assert is_serve_run(argv) is expected


def test_a_process_ignoring_sigint_is_told_so_as_a_background_job_started_by_a_script_is() -> None:
    """Such a `serve run` is stopped with SIGTERM instead, which it does not ignore."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert ignores(os.getpid(), signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert previous is signal.SIG_IGN or not ignores(os.getpid(), signal.SIGINT)
    assert not ignores(os.getpid(), signal.SIGTERM)
    assert not ignores(2**22 + 7, signal.SIGINT)  # no such process


def _status(*replica_states: dict) -> SimpleNamespace:
    deployments = {f"d{i}": SimpleNamespace(replica_states=states) for i, states in enumerate(replica_states)}
    return SimpleNamespace(applications={"app": SimpleNamespace(deployments=deployments)})


def test_a_refused_redeploy_leaves_a_serving_version_alone() -> None:
    assert not serves_something(SimpleNamespace(applications={}))
    assert not serves_something(_status({}, {"STARTING": 1}))
    assert serves_something(_status({"STARTING": 1}, {"RUNNING": 1}))


def test_a_refusal_outside_serves_build_task_prints_and_stops_nothing(capsys, monkeypatch) -> None:
    monkeypatch.setattr(startup.os, "kill", lambda *args: pytest.fail("nothing may be signalled"))
    refuse(ConfigError("invalid application config:\n  - models[0]: bad"))
    err = capsys.readouterr().err
    assert "ERROR: the application config is refused, so the application is not deployed" in err
    assert "models[0]: bad" in err


@pytest.fixture()
def model_copy(tmp_path: Path) -> Path:
    return Path(shutil.copytree(packaged_model_path(), tmp_path / "model"))


def _refused(capsys, **entry) -> str:
    with pytest.raises(ConfigError) as caught:
        build_app({"models": [{"name": "ok"}, {"name": "m", **entry}]})
    assert "ERROR: the application config is refused" in capsys.readouterr().err
    return str(caught.value)


def test_a_model_directory_the_backend_refuses_is_refused_before_deploying(capsys, model_copy: Path) -> None:
    pooling = model_copy / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "pooling_mode": "bogus"}))
    message = _refused(capsys, model_path=str(model_copy))
    assert message.startswith("invalid application config:\n  - models[1] (m): ")
    assert "pooling_mode bogus is not served" in message and "models[0]" not in message


def test_a_missing_model_directory_and_impossible_options_are_refused(capsys, tmp_path: Path) -> None:
    assert "modules.json: not found" in _refused(capsys, model_path=str(tmp_path / "nothing-here"))
    assert "matryoshka_dims [512] exceed the model's 384 dimensions" in _refused(capsys, matryoshka_dims=[512])
    assert "'nope'" in _refused(capsys, default_prompt_name="nope")


def test_serve_hands_build_app_the_args_so_its_refusal_is_reported(capsys) -> None:
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    with pytest.raises(ConfigError, match=r"models\[0\]: unknown setting\(s\) max_batch_sise"):
        call_user_app_builder_with_args_if_necessary(build_app, {"models": [{"name": "a", "max_batch_sise": 8}]})
    assert "unknown setting(s) max_batch_sise" in capsys.readouterr().err
