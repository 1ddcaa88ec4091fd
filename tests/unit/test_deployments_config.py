"""The application's arguments: checked at start-up with clear messages, and the deployment options they give."""

from __future__ import annotations

import inspect
import logging
from pathlib import Path

import pytest
import yaml

from batching import BatcherConfig
from deployments.app import build_app
from deployments.config import ConfigError, ModelConfig, parse_app_config
from deployments.sizing import ingress_deployment_options, model_deployment_options

ROOT = Path(__file__).resolve().parents[2]


def serve_config_args() -> dict:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (application,) = config["applications"]
    assert application["import_path"] == "deployments.app:build_app"
    return application["args"]


def test_the_shipped_serve_config_parses() -> None:
    config = parse_app_config(serve_config_args())
    (model,) = config.models
    assert (model.name, model.backend, model.deployment_name) == ("all-MiniLM-L6-v2", "local", "embed-all-MiniLM-L6-v2")
    assert model.batcher == BatcherConfig(
        max_batch_size=64, max_wait_ms=25, scale_factor=40, max_concurrent_batches=2, max_batch_cost=8192
    )
    assert model.autoscaling["policy"]["policy_function"] == "deployments.autoscaling:QueueDepthPolicy"


def test_the_shipped_serve_config_builds_the_ingress_over_its_model() -> None:
    config = parse_app_config(serve_config_args())
    (model,) = config.models
    ingress = build_app(serve_config_args())._bound_deployment
    options = ingress_deployment_options(config)
    assert (ingress.name, ingress.max_ongoing_requests) == (options["name"], options["max_ongoing_requests"])
    assert ingress.init_kwargs == {"max_body_bytes": config.ingress.max_body_bytes, "batch": config.batch, "relayed": {}}
    (models,) = ingress.init_args
    assert list(models) == [model.name]
    bound = models[model.name]._bound_deployment
    options = model_deployment_options(model)
    assert (bound.name, bound.max_ongoing_requests) == (options["name"], options["max_ongoing_requests"])
    assert bound.ray_actor_options == options["ray_actor_options"]
    assert bound.init_args == (model,)


def test_serve_hands_build_app_the_args_which_it_checks_with_the_same_messages() -> None:
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    # Not Serve's typed builder (an AppConfig annotation): build_app reports a refusal itself (deployments.startup)
    assert not inspect.isclass(inspect.signature(build_app).parameters["args"].annotation)
    assert call_user_app_builder_with_args_if_necessary(build_app, serve_config_args()) is not None
    with pytest.raises(ValueError, match=r"models\[0\]\.backend: must be one of local, openai, not 'gpu'"):
        call_user_app_builder_with_args_if_necessary(build_app, {"models": [{"name": "a", "backend": "gpu"}]})


def test_every_problem_is_reported_with_where_it_is() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_app_config({
            "models": [
                {"name": "a", "backend": "gpu", "batching": {"max_batch": 3}},
                {"name": "b", "backend": "openai"},
                {"name": "c", "batching": {"max_batch_size": 0}},
                {"name": "d", "autoscaling": {"min_replicas": 3, "max_replicas": 1}},
            ],
            "extra": 1,
        })
    message = str(caught.value)
    assert "models[0].backend: must be one of local, openai" in message
    assert "models[0].batching: unknown setting(s) max_batch" in message
    assert "models[1].base_url" in message
    assert "models[2].batching: invalid BatcherConfig: max_batch_size must be >= 1" in message
    assert "models[3].autoscaling" in message and "max_replicas" in message
    assert "args: unknown setting(s) extra" in message


@pytest.mark.parametrize("args", [None, {}, {"models": []}, {"models": "x"}, [1]])
def test_missing_models_are_refused(args) -> None:
    with pytest.raises(ConfigError):
        parse_app_config(args)


def test_duplicate_model_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="used more than once"):
        parse_app_config({"models": [{"name": "m"}, {"name": "m"}]})


def test_max_batch_tokens_is_the_batchers_cost_budget() -> None:
    config = parse_app_config({"models": [{"name": "m", "batching": {"max_batch_tokens": 4096}}]})
    assert config.models[0].batcher.max_batch_cost == 4096
    with pytest.raises(ConfigError, match="not both"):
        parse_app_config({"models": [{"name": "m", "batching": {"max_batch_tokens": 1, "max_batch_cost": 2}}]})


def test_openai_entries_keep_their_backend_options() -> None:
    config = parse_app_config({"models": [{
        "name": "small", "backend": "openai", "base_url": "http://127.0.0.1:9/v1", "api_key_env": "KEY",
        "upstream_model": "text-embedding-3-small",
    }]})
    model = config.models[0]
    assert (model.base_url, model.api_key_env, model.upstream_model) == ("http://127.0.0.1:9/v1", "KEY", "text-embedding-3-small")
    assert model_deployment_options(model)["ray_actor_options"] == {"num_cpus": 0}


def test_max_ongoing_requests_lets_batches_fill_and_the_queue_fill_up() -> None:
    model = ModelConfig(name="m", backend="local", batcher=BatcherConfig(max_batch_size=64, max_concurrent_batches=2))
    assert model_deployment_options(model)["max_ongoing_requests"] == 10_000 + 128  # a full queue + batches in flight
    small_queue = ModelConfig(name="m", backend="local",
                              batcher=BatcherConfig(max_batch_size=64, max_concurrent_batches=2, max_queue_depth=100))
    assert model_deployment_options(small_queue)["max_ongoing_requests"] == 256  # still twice the floor
    assert model_deployment_options(small_queue)["max_queued_requests"] == 256


def test_a_replica_being_removed_has_time_to_drain_a_full_queue() -> None:
    default = ModelConfig(name="m", backend="local")
    assert model_deployment_options(default)["graceful_shutdown_timeout_s"] == pytest.approx(2 * 10_000 / 150)
    deep = ModelConfig(name="m", backend="local", batcher=BatcherConfig(max_queue_depth=60_000))
    assert model_deployment_options(deep)["graceful_shutdown_timeout_s"] == pytest.approx(800)
    shallow = ModelConfig(name="m", backend="local", batcher=BatcherConfig(max_queue_depth=100))
    assert model_deployment_options(shallow)["graceful_shutdown_timeout_s"] == 20  # never below Serve's default


def test_a_too_low_max_ongoing_requests_is_raised_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = ModelConfig(name="m", backend="local", batcher=BatcherConfig(max_batch_size=64, max_concurrent_batches=2),
                        max_ongoing_requests=10)
    with caplog.at_level(logging.WARNING):
        options = model_deployment_options(model)
    assert options["max_ongoing_requests"] == 128
    assert "max_ongoing_requests=10" in caplog.text


def test_autoscaling_or_a_fixed_replica_count() -> None:
    scaled = ModelConfig(name="m", backend="local", autoscaling={"min_replicas": 1, "max_replicas": 2})
    assert "num_replicas" not in model_deployment_options(scaled)
    assert model_deployment_options(scaled)["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 2}
    fixed = ModelConfig(name="m", backend="local", num_replicas=3)
    assert model_deployment_options(fixed)["num_replicas"] == 3


def test_the_ingress_admits_at_least_what_the_models_can_take() -> None:
    config = parse_app_config({"models": [
        {"name": "a", "batching": {"max_batch_size": 512, "max_concurrent_batches": 2}, "num_replicas": 2},
    ], "ingress": {"max_ongoing_requests": 100, "env_vars": {"EMBEDDINGS_API_KEYS": "k"}}})
    options = ingress_deployment_options(config)
    assert options["max_ongoing_requests"] == 2 * (10_000 + 1024)  # 2 replicas x (a full queue + batches in flight)
    assert options["ray_actor_options"] == {"num_cpus": 0, "runtime_env": {"env_vars": {"EMBEDDINGS_API_KEYS": "k"}}}


def test_an_ingress_per_node_on_a_cluster_leaves_room_before_its_replacement_starts() -> None:
    anywhere = ingress_deployment_options(parse_app_config({"models": [{"name": "a"}]}))
    assert "max_replicas_per_node" not in anywhere and anywhere["max_surge_percent"] == 100
    per_node = parse_app_config({"models": [{"name": "a"}],
                                 "ingress": {"num_replicas": 2, "max_replicas_per_node": 1}})
    options = ingress_deployment_options(per_node)
    assert options["max_replicas_per_node"] == 1
    assert options["max_surge_percent"] == 0  # a new ingress could not start on a node whose old one still runs
    with pytest.raises(ValueError, match="max_replicas_per_node"):
        parse_app_config({"models": [{"name": "a"}], "ingress": {"max_replicas_per_node": 0}})
