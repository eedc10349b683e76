"""What the tasks do for a cluster that a local run cannot show: a pod-local MLflow store fails the
first task, the on_config_change input, secrets exposed under their variables."""

from __future__ import annotations

import pytest

from diffusionrl.config import ConfigError


def test_a_pod_local_tracking_store_fails_on_a_cluster_only(monkeypatch):
    from tasks import common

    monkeypatch.delenv("FLYTE_INTERNAL_EXECUTION_ID", raising=False)
    common.require_shared_store("sqlite:///runs/mlflow/mlflow.db")  # a local run: fine
    monkeypatch.setenv("FLYTE_INTERNAL_EXECUTION_ID", "abc123")
    monkeypatch.setattr(common, "flyte_execution_id", lambda: "proj-dev-abc123")
    for uri in ("sqlite:////root/runs/mlflow/mlflow.db", "/root/mlruns", "file:///root/mlruns"):
        with pytest.raises(ValueError, match=r"is a file inside this pod.*tracking.uri"):
            common.require_shared_store(uri)
    common.require_shared_store("http://mlflow.ns.svc:5000")
    common.require_shared_store("postgresql://user@db/mlflow")


def test_on_config_change_is_fail_or_record():
    from tasks.common import config_change_allowed

    assert config_change_allowed("fail") is False and config_change_allowed("record") is True
    with pytest.raises(ConfigError, match=r"on_config_change='yes' is not one of \['fail', 'record'\]"):
        config_change_allowed("yes")


def test_secrets_reach_their_variables_wherever_flyte_put_them(monkeypatch):
    from flytekit import current_context

    from tasks.resources import SECRETS, load_secrets

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("_FSEC_HF_TOKEN", "hf_from_flyte")  # flytekit's secrets manager reads this
    assert current_context().secrets.get("hf", "token") == "hf_from_flyte"
    load_secrets([SECRETS["hf"]])
    import os

    assert os.environ["HF_TOKEN"] == "hf_from_flyte"
    monkeypatch.setenv("HF_TOKEN", "already-set")
    load_secrets([SECRETS["hf"]])
    assert os.environ["HF_TOKEN"] == "already-set"  # an injected variable wins


def test_the_train_task_starts_ray_on_a_cluster_only(monkeypatch):
    """Locally the train task starts no Ray of its own (the library starts one when the config
    needs it); on a cluster it joins the KubeRay job's Ray as flytekit's Ray task does."""
    import ray
    from flytekit import FlyteContextManager
    from flytekit.core.context_manager import ExecutionState
    from flytekitplugins.ray.task import RayFunctionTask

    from tasks.grpo import train
    from tasks.resources import OnDemandRayTask

    assert isinstance(train, OnDemandRayTask) and train.task_type == "ray"
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    ctx = FlyteContextManager.current_context()
    for mode, expected in ((ExecutionState.Mode.LOCAL_WORKFLOW_EXECUTION, 0), (ExecutionState.Mode.TASK_EXECUTION, 1)):
        state = ctx.execution_state.with_params(mode=mode)
        with FlyteContextManager.with_context(ctx.with_execution_state(state)):
            train.pre_execute(None)
        assert len(calls) == expected, mode
    assert "address" in calls[0] and RayFunctionTask.pre_execute is not OnDemandRayTask.pre_execute


def test_config_literal_types_are_computed_once_and_equal_flytekits():
    from dataclasses import dataclass

    from flytekit.core.type_engine import DataclassTransformer, TypeEngine

    from diffusionrl.config import Config, DataConfig
    from tasks import flyte_types

    for cls in (Config, DataConfig):
        first = TypeEngine.to_literal_type(cls)
        assert TypeEngine.to_literal_type(cls) is first  # kept
        assert first == flyte_types._original(DataclassTransformer(), cls)  # what flytekit computes
        assert first.metadata and first.structure.dataclass_type  # schema and field types are there

    @dataclass
    class Other:
        x: int = 1

    assert TypeEngine.to_literal_type(Other) is not TypeEngine.to_literal_type(Other)  # not ours: not kept
