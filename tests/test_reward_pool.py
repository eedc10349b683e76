"""Reward scoring on Ray CPU actors equals in-process scoring, and survives a killed actor."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ray = pytest.importorskip("ray")

from diffusionrl.config import RewardConfig  # noqa: E402
from diffusionrl.rewards import MixtureReward, make_scorer, reward_metrics  # noqa: E402
from diffusionrl.rewards.base import RewardResult  # noqa: E402
from diffusionrl.rewards.ocr import render_text_image  # noqa: E402
from diffusionrl.rewards.pool import RewardActorPool, merge_parts  # noqa: E402

TEXTS = ["OPEN", "Hello World", "TAXI 42", "Fresh Bread", "COFFEF"]
CFG = RewardConfig(weights={"ocr": 1.0, "jpeg_compressibility": 0.5}, num_actors=2)


@pytest.fixture(scope="module")
def batch():
    images = np.stack([render_text_image(t, size=256, font_size=32) for t in TEXTS])
    prompts = [f'a sign that says "{t}"' for t in TEXTS[:-1]] + ['a mug that says "COFFEE"']
    return images, prompts, [{} for _ in TEXTS]


@pytest.fixture(scope="module")
def pool():
    started_here = not ray.is_initialized()
    scorer = make_scorer(CFG)
    assert isinstance(scorer, RewardActorPool) and len(scorer.actors) == 2
    yield scorer
    scorer.close()
    if started_here and ray.is_initialized():
        ray.shutdown()


def assert_same(a, b):
    (total_a, parts_a), (total_b, parts_b) = a, b
    np.testing.assert_allclose(total_a, total_b, rtol=1e-6)
    assert parts_a.keys() == parts_b.keys()
    for name in parts_a:
        np.testing.assert_allclose(parts_a[name].scores, parts_b[name].scores, rtol=1e-6)
        assert parts_a[name].failures == parts_b[name].failures
        assert parts_a[name].info == pytest.approx(parts_b[name].info)


def test_pinned_actors_score_like_in_process_on_their_own_cores(batch):
    """pin_cores: actor k runs on core group k (wrapping around the cores this process may use).
    (Before the module's pool exists: this pool starts and stops its own Ray.)"""
    import subprocess
    import sys

    pinned = RewardActorPool(CFG, num_actors=2, pin_cores=True)
    try:
        assert_same(pinned(*batch), MixtureReward(CFG.weights, CFG)(*batch))
    finally:
        pinned.close()
    code = ("import os; from diffusionrl.rewards.pool import pin_to_cores; "
            "cores = sorted(os.sched_getaffinity(0)); mine = pin_to_cores({slot}, 1); "
            "assert mine == set(os.sched_getaffinity(0)) == {{cores[{slot} % len(cores)]}}, (mine, cores)")
    for slot in (0, 1, 2):  # in a child process: pinning is for the rest of a process's life
        proc = subprocess.run([sys.executable, "-c", code.format(slot=slot)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_pool_that_cannot_be_admitted_stops_the_ray_it_started(monkeypatch):
    """The admission check fails (here forced: the cluster the pool sized cannot hold its actors): the pool
    raises it and leaves no Ray of its own running, so a later pool in the process sizes a new one.
    (Before the module's pool exists, as the test above.)"""
    from diffusionrl import raycluster

    assert not ray.is_initialized()

    def refuse(*_args, **_kwargs):
        raise raycluster.RayResourcesUnavailable("reward.num_actors=2 x 1 CPU needs 2 CPUs; lower reward.num_actors")

    monkeypatch.setattr(raycluster, "admit", refuse)
    with pytest.raises(raycluster.RayResourcesUnavailable, match="lower reward.num_actors"):
        RewardActorPool(CFG, num_actors=2)
    assert not ray.is_initialized(), "the Ray the pool started outlived its failed start"


def test_pool_equals_in_process(pool, batch):
    local = MixtureReward(CFG.weights, CFG)
    expected = local(*batch)
    got = pool(*batch)
    assert_same(got, expected)
    assert got[0].dtype == np.float32 and got[0].shape == (5,)
    np.testing.assert_allclose(got[1]["ocr"].scores, [1, 1, 1, 1, 1 - 1 / 6], atol=1e-6)
    metrics = reward_metrics(*got)
    assert metrics["rollout/reward/ocr_failures"] == 0.0 and metrics["rollout/reward/num_samples"] == 5.0


def test_async_and_small_batches(pool, batch):
    images, prompts, meta = batch
    pending = pool.score_async(images, prompts, meta)
    assert_same(pending.result(), MixtureReward(CFG.weights, CFG)(images, prompts, meta))
    one = pool(images[:1], prompts[:1], meta[:1])  # fewer samples than actors
    assert one[0].shape == (1,) and one[1]["ocr"].scores[0] == 1.0
    empty = pool(images[:0], [], [])
    assert empty[0].shape == (0,) and set(empty[1]) == {"ocr", "jpeg_compressibility"}


def test_failures_summed_across_shards(pool, batch):
    images, prompts, meta = batch
    corrupt = [img for img in images]
    corrupt[0] = np.zeros((4, 4), np.float32)
    corrupt[4] = np.zeros((4, 4), np.float32)
    total, parts = pool(np.array(corrupt, dtype=object), prompts, meta)
    assert parts["ocr"].failures == 2
    assert parts["ocr"].scores[0] == 0.0 and parts["ocr"].scores[4] == 0.0


def crash(actor) -> None:
    """What a crash or an OOM kill is to Ray: the actor's process dies, the actor may be restarted."""
    ray.kill(actor, no_restart=False)


def test_killed_actor_is_restarted_and_batch_scored(pool, batch):
    expected = MixtureReward(CFG.weights, CFG)(*batch)
    old_pid = ray.get(pool.actors[0].ready.remote())
    crash(pool.actors[0])
    assert_same(pool(*batch), expected)
    assert ray.get(pool.actors[0].ready.remote()) != old_pid  # Ray restarted it in a new process
    assert_same(pool(*batch), expected)  # and the new actor keeps working


def test_kill_during_overlapping_batches(pool, batch):
    expected = MixtureReward(CFG.weights, CFG)(*batch)
    first, second = pool.score_async(*batch), pool.score_async(*batch)
    crash(pool.actors[1])
    assert_same(first.result(), expected)
    assert_same(second.result(), expected)
    assert_same(pool(*batch), expected)


def test_data_error_raises_through_the_pool(pool, batch):
    images, prompts, meta = batch
    with pytest.raises(ValueError, match="row 4 .*'no quoted text'"):
        pool(images, prompts[:-1] + ["no quoted text"], meta)


def test_merge_parts_weights_info_by_shard_size():
    a = {"r": RewardResult(np.ones(3), 1, {"exact": 1.0})}
    b = {"r": RewardResult(np.zeros(1), 2, {"exact": 0.0})}
    merged = merge_parts([a, b], [3, 1])["r"]
    np.testing.assert_array_equal(merged.scores, [1, 1, 1, 0])
    assert merged.failures == 3 and merged.info["exact"] == pytest.approx(0.75)

