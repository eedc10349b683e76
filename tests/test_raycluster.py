"""Ray requests the cluster cannot hold fail at once naming the resource (or, when it autoscales,
after a bounded wait), and a stuck Ray call raises a retryable ``RayTimeout``. One local Ray of 1 CPU;
every test finishes in seconds."""

from __future__ import annotations

import time

import numpy as np
import pytest

from diffusionrl import raycluster
from diffusionrl.config import RewardConfig
from tests.conftest import tiny_config

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def one_cpu():
    if ray.is_initialized():  # another module's Ray: this module needs its own, of 1 CPU
        ray.shutdown()
    raycluster.start_local_ray(1, log_to_driver=False)  # on loopback, as a run starts it
    yield
    ray.shutdown()


@pytest.fixture
def fixed_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(raycluster.AUTOSCALING_ENV, raising=False)


def free_cpus(wait_s: float = 10.0) -> float:
    """Free CPUs once killed actors have released theirs."""
    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    return ray.available_resources().get("CPU", 0)


def test_reward_actors_beyond_the_cluster_fail_at_once(one_cpu, fixed_cluster):
    from diffusionrl.rewards.pool import RewardActorPool

    t0 = time.monotonic()
    with pytest.raises(raycluster.RayResourcesUnavailable) as err:
        RewardActorPool(RewardConfig(weights={"jpeg_compressibility": 1.0}, num_actors=4))
    assert time.monotonic() - t0 < 10
    assert str(err.value) == ("reward.num_actors=4 x 1 CPU needs 4 CPUs; the Ray cluster has 1 (CPU: 1.0): "
                              "lower reward.num_actors or add nodes")
    assert free_cpus() == 1  # nothing was left queued


def test_an_autoscaling_cluster_is_waited_for_within_a_bound(one_cpu, monkeypatch):
    from diffusionrl.rewards.pool import RewardActorPool

    monkeypatch.setenv(raycluster.AUTOSCALING_ENV, "1")
    monkeypatch.setenv(raycluster.AUTOSCALE_WAIT_ENV, "1")
    t0 = time.monotonic()
    with pytest.raises(raycluster.RayResourcesUnavailable, match="after waiting 1 s for the autoscaler"):
        RewardActorPool(RewardConfig(weights={"jpeg_compressibility": 1.0}, num_actors=3))
    assert time.monotonic() - t0 < 15
    assert free_cpus() == 1  # the pending actors were killed, not left asking for nodes


def test_placement_groups_beyond_the_cluster_fail_at_once(one_cpu, fixed_cluster):
    from ray.util.placement_group import placement_group_table

    from diffusionrl.distributed.placement import build_placement

    cfg = tiny_config("train.world_size=2", "train.rollout_engines=1")
    t0 = time.monotonic()
    with pytest.raises(raycluster.RayResourcesUnavailable) as err:
        build_placement(cfg.train)
    assert time.monotonic() - t0 < 10
    assert str(err.value).startswith("train.world_size=2 x 1 CPU needs 2 CPUs; the Ray cluster has 1 (CPU: 1.0)")
    assert "lower train.world_size or train.cpus_per_bundle" in str(err.value)
    assert not placement_group_table()  # none was created


def test_a_placement_group_holds_cpus_reward_actors_cannot_use(one_cpu, fixed_cluster):
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"CPU": 1.0}])
    ray.get(pg.ready(), timeout=30)
    try:
        with pytest.raises(raycluster.RayResourcesUnavailable, match="1 of them reserved by placement groups"):
            raycluster.admit("reward.num_actors=1", {"CPU": 1.0}, 1, "lower reward.num_actors or add nodes")
    finally:
        remove_placement_group(pg)
    raycluster.admit("reward.num_actors=1", {"CPU": 1.0}, 1, "")  # removed, it holds nothing


def test_a_stuck_call_raises_a_retryable_timeout(one_cpu, fixed_cluster, monkeypatch):
    from diffusionrl.rewards.pool import RewardActorPool

    @ray.remote(num_cpus=0)
    class Stuck:
        def score(self, *args):
            time.sleep(600)

    pool = RewardActorPool(RewardConfig(weights={"jpeg_compressibility": 1.0}, num_actors=1))
    stuck = Stuck.remote()
    try:
        pool.actors = [stuck]
        monkeypatch.setenv(raycluster.TIMEOUT_ENV, "0.5")
        images = np.zeros((2, 8, 8, 3), np.uint8)
        t0 = time.monotonic()
        with pytest.raises(raycluster.RayTimeout, match=r"1 of 1 shards not scored within 0\.5 s") as err:
            pool(images, ["a", "b"], [{}, {}])
        assert time.monotonic() - t0 < 5
        assert isinstance(err.value, TimeoutError)  # what the train task retries
        with pytest.raises(TimeoutError, match="no answer within 0.5 s"):
            raycluster.get([stuck.score.remote()], "a stuck call")
    finally:
        ray.kill(stuck)
        pool.close()


def test_timeouts_come_from_the_environment(monkeypatch):
    monkeypatch.delenv(raycluster.TIMEOUT_ENV, raising=False)
    assert raycluster.seconds(raycluster.TIMEOUT_ENV) == raycluster.DEFAULTS[raycluster.TIMEOUT_ENV]
    monkeypatch.setenv(raycluster.TIMEOUT_ENV, "12.5")
    assert raycluster.seconds(raycluster.TIMEOUT_ENV) == 12.5
    monkeypatch.setenv(raycluster.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=r"\$DIFFUSIONRL_RAY_TIMEOUT_S='soon' is not a number"):
        raycluster.seconds(raycluster.TIMEOUT_ENV)
