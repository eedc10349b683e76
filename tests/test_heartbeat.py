"""MLflow runs of killed executions do not stay RUNNING: heartbeats, the next execution closing
stale runs, and a registry that never shows or keeps a failed run's version as champion.
A SQLite store (fast); tests/test_tracking.py covers the server."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from diffusionrl import serving, tracking
from diffusionrl.tracking import heartbeat as hb

from .conftest import tiny_config


@pytest.fixture(scope="module")
def uri(tmp_path_factory):
    return f"sqlite:///{tmp_path_factory.mktemp('heartbeat')}/mlflow.db"


def config(uri: str, experiment: str, *extra: str):
    return tiny_config(f"tracking.uri={uri}", f"tracking.experiment={experiment}", *extra)


def status(c, run) -> str:
    return c.get_run(run.info.run_id).info.status


def test_a_new_execution_closes_the_runs_of_a_killed_one(uri):
    c = tracking.client(uri)
    exp = tracking.ensure_experiment(uri, "killed")
    now = time.time()
    hour_ago_ms = int((now - 7200) * 1000)

    def run(execution, stage="workflow", heartbeat=None, start_ms=None, **tags):
        tags = {tracking.STAGE_TAG: stage, "flyte_execution_id": execution, **tags}
        if heartbeat is not None:
            tags[hb.HEARTBEAT_TAG] = str(int(heartbeat))
        return c.create_run(exp, start_time=start_ms, tags=tags)

    killed = run("killed", heartbeat=now - 3600)
    killed_train = run("killed", "train", heartbeat=now - 3500, **{tracking.PARENT_TAG: killed.info.run_id})
    live = run("live", heartbeat=now - 60, start_ms=hour_ago_ms)
    live_prepare = run("live", "prepare", start_ms=hour_ago_ms)  # no heartbeat of its own: its execution is alive
    legacy = run("legacy", start_ms=hour_ago_ms)  # killed before its first heartbeat: judged by its start
    foreign = c.create_run(exp, start_time=hour_ago_ms)  # not made by this code: left alone

    new = tracking.start_workflow_run(config(uri, "killed"), {"flyte_execution_id": "new"})

    for r in (killed, killed_train):
        assert status(c, r) == "FAILED"
        failure = c.get_run(r.info.run_id).data.tags["failure"]
        assert failure.startswith(f"no heartbeat since {hb.utc(int(now - 3500))}")  # the execution's newest
        assert "marked FAILED by execution new" in failure
    assert "no heartbeat since" in c.get_run(legacy.info.run_id).data.tags["failure"]
    assert status(c, legacy) == "FAILED"
    for r in (live, live_prepare, foreign):
        assert status(c, r) == "RUNNING" and "failure" not in c.get_run(r.info.run_id).data.tags
    fresh = c.get_run(new.run_id)
    assert fresh.info.status == "RUNNING" and abs(float(fresh.data.tags[hb.HEARTBEAT_TAG]) - now) < 60


def test_a_live_execution_taken_for_dead_is_revived_by_its_next_heartbeat(uri):
    c = tracking.client(uri)
    exp = tracking.ensure_experiment(uri, "revive")
    run = c.create_run(exp, tags={tracking.STAGE_TAG: "workflow", "flyte_execution_id": "slow",
                                  hb.HEARTBEAT_TAG: hb.stamp()})
    later = time.time() + 3600  # an hour without a heartbeat
    assert hb.fail_stale_runs(uri, exp, "other", ttl=1800, now=later) == [run.info.run_id]
    assert status(c, run) == "FAILED"
    assert hb.Heartbeat(uri, [run.info.run_id])()
    back = c.get_run(run.info.run_id)
    assert back.info.status == "RUNNING" and "failure" not in back.data.tags
    assert "alive after being marked 'no heartbeat since" in back.data.tags["revived"]


def test_metric_logger_beats_the_stage_and_workflow_runs_at_most_every_n_seconds(uri):
    run = tracking.start_workflow_run(config(uri, "logger"), {"flyte_execution_id": "logging"})
    stage = tracking.stage_run(run, "train")
    c = tracking.client(uri)
    logger = tracking.MetricLogger(uri, stage, heartbeat_every=3600)

    def age_heartbeats():
        for rid in (run.run_id, stage):
            c.set_tag(rid, hb.HEARTBEAT_TAG, "1000")

    def heartbeats():
        return [float(c.get_run(rid).data.tags[hb.HEARTBEAT_TAG]) for rid in (run.run_id, stage)]

    traj = SimpleNamespace(images=None)
    age_heartbeats()
    logger.on_step(None, 1, traj, {"perf/step_time": 1.0})
    assert all(abs(t - time.time()) < 60 for t in heartbeats())
    age_heartbeats()
    logger.on_step(None, 2, traj, {"perf/step_time": 1.0})
    assert heartbeats() == [1000.0, 1000.0]  # within the hour: no second heartbeat


def test_a_failed_runs_version_is_never_champion(uri, tmp_path, capsys):
    name = "heartbeat-model"
    cfg = config(uri, "registry", f"tracking.registered_model={name}")
    exp = tracking.ensure_experiment(uri, "registry")
    c = tracking.client(uri)
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.txt").write_text("w")

    def register(score: float):
        run_id = c.create_run(exp, tags={tracking.STAGE_TAG: "workflow"}).info.run_id
        run = tracking.TrackingRun(uri, exp, run_id, f"exec-{run_id[:6]}")
        reg = serving.register(run, cfg, SimpleNamespace(model_uri=str(model)), score, "same-eval",
                                {"base_model_digest": "base"})
        return run_id, reg

    def fail(run_id):
        c.set_tag(run_id, "failure", "no heartbeat since 2026-01-01 00:00:00 UTC")
        c.set_terminated(run_id, status="FAILED")

    _, v1 = register(0.5)
    bad_run, v2 = register(0.9)
    assert v1.promoted and v2.promoted
    fail(bad_run)  # its execution was killed after registering

    shown = serving.show(uri, name)
    assert shown["champion"] is None and f"v{v2.version}: its run {bad_run} FAILED" in shown["champion_ignored"]
    v2_shown = next(v for v in shown["versions"] if v["version"] == v2.version)
    assert "champion" not in v2_shown["aliases"] and v2_shown["ignored_aliases"] == ["champion"]
    assert v2_shown["run_status"] == "FAILED"
    assert serving.main(["show", "--name", name, "--tracking-uri", uri]) == 0
    assert json.loads(capsys.readouterr().out)["champion"] is None

    # The next decision compares with the champion before the failed one (v1, 0.5), not with 0.9.
    good_run, v3 = register(0.6)
    assert v3.promoted and v3.previous_champion == v1.version
    assert f"passed over v{v2.version}: its run {bad_run} FAILED" in v3.decision
    assert serving.show(uri, name)["champion"] == v3.version

    # Not better than the valid champion: @champion leaves the failed run's version for v1.
    fail(good_run)
    _, v4 = register(0.4)
    assert not v4.promoted and v4.previous_champion == v1.version
    assert str(c.get_model_version_by_alias(name, "champion").version) == v1.version
    assert serving.show(uri, name)["champion"] == v1.version


def test_metric_logger_flushes_when_due_and_at_checkpoints_and_the_end(uri):
    run = tracking.start_workflow_run(config(uri, "flushing"), {"flyte_execution_id": "flushing"})
    stage = tracking.stage_run(run, "train")
    c = tracking.client(uri)
    logger = tracking.MetricLogger(uri, stage, flush_every_s=3600)
    traj = SimpleNamespace(images=None)

    def logged():
        return [m.step for m in c.get_metric_history(stage, "perf/step_time")]

    logger.on_step(None, 1, traj, {"perf/step_time": 1.0})
    logger.on_step(None, 2, traj, {"perf/step_time": 1.0})
    assert logged() == [] and len(logger.buffer) == 2  # not due yet
    logger.on_checkpoint(None, None)
    assert logged() == [1, 2] and not logger.buffer
    logger.on_step(None, 3, traj, {"perf/step_time": 1.0})
    logger.on_end(SimpleNamespace(out_dir="."))
    assert logged() == [1, 2, 3]
    logger.flush_every_s = 0.0  # every step is due
    logger.on_step(None, 4, traj, {"perf/step_time": 1.0})
    assert logged() == [1, 2, 3, 4]
