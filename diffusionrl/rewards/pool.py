"""Score rewards on a pool of Ray CPU actors, with the call signature of ``MixtureReward``.

``pool(images, prompts, metadata) -> (total [B], {name: RewardResult})``. A batch is cut into one
contiguous shard per actor; shards are scored concurrently and put back in order. Each actor builds
the ``MixtureReward`` of ``reward_cfg.weights`` once. An actor that dies (crash, OOM, a node lost) is
restarted by Ray (``max_restarts=-1``: each call bounds the retries, not the run) and its shard scored
again by Ray (``max_task_retries``), at most ``max_retries`` times per shard per call.
``score_async`` starts a batch and returns a handle, so the caller can work while it is scored.

Nothing waits forever (``diffusionrl.raycluster``): the actors' CPUs are checked against the cluster
before they are created (``reward.num_actors`` more than it holds fails at once, naming both), the
start is bounded by ``$DIFFUSIONRL_RAY_START_TIMEOUT_S`` and a batch by ``$DIFFUSIONRL_RAY_TIMEOUT_S``
(``RayTimeout``, retryable).
"""

from __future__ import annotations

import os
import time

import numpy as np

from diffusionrl import raycluster
from diffusionrl.raycluster import ensure_ray

from .base import RewardResult, set_reward_threads
from .mixture import MixtureReward
from .registry import prompt_check


class _RewardActor:
    """One Ray actor holding a MixtureReward (made remote in ``RewardActorPool._actor_class``)."""

    def __init__(self, reward_cfg, threads: int, slot: int | None = None):
        # Before any reward is built: onnxruntime (OCR) and torch read their thread counts once.
        if slot is not None:
            pin_to_cores(slot, threads)
        set_reward_threads(threads)
        self.scorer = MixtureReward(reward_cfg.weights, reward_cfg)

    def ready(self) -> int:
        return os.getpid()

    def score(self, images, prompts, metadata):
        return self.scorer(images, prompts, metadata)


def pin_to_cores(slot: int, threads: int) -> set[int]:
    """Pin this process to ``threads`` of the cores it may use, the ``slot``-th such group (wrapping
    around): actor k of a pool on one node runs on its own cores, so its threads neither migrate
    nor land on a neighbour's core. Returns the cores (unchanged where affinity is unsupported)."""
    if not hasattr(os, "sched_setaffinity"):
        return set()
    cores = sorted(os.sched_getaffinity(0))
    mine = {cores[(slot * threads + j) % len(cores)] for j in range(threads)}
    os.sched_setaffinity(0, mine)
    return mine


# A node that offers this custom resource is meant for reward actors (the train task's `reward-cpu`
# worker group; `ray start --resources '{"reward-cpu": 1}'`): when the cluster has one, every actor
# asks for a sliver of it, so actors go to those nodes and leave the GPU nodes' CPUs to the trainer.
REWARD_NODE_RESOURCE = "reward-cpu"


def reward_actor_options(cpus_per_actor: float, max_retries: int = 2) -> dict:
    """Ray options of a reward actor on the cluster at hand: a dead actor is restarted, its calls retried
    ``max_retries`` times each."""
    import ray

    options: dict = {"num_cpus": cpus_per_actor, "max_restarts": -1, "max_task_retries": int(max_retries)}
    if ray.cluster_resources().get(REWARD_NODE_RESOURCE, 0) > 0:
        options["resources"] = {REWARD_NODE_RESOURCE: 0.001}
    return options


def merge_parts(shard_parts: list[dict[str, RewardResult]], sizes: list[int]) -> dict[str, RewardResult]:
    """Concatenate scores, sum failures, average info weighted by shard size."""
    merged: dict[str, RewardResult] = {}
    for name in shard_parts[0]:
        results = [parts[name] for parts in shard_parts]
        keys = {k for r in results for k in r.info}
        info = {}
        for key in sorted(keys):
            pairs = [(r.info[key], n) for r, n in zip(results, sizes) if key in r.info and n > 0]
            if pairs:
                info[key] = float(sum(v * n for v, n in pairs) / sum(n for _, n in pairs))
        merged[name] = RewardResult(
            np.concatenate([r.scores for r in results]), sum(r.failures for r in results), info
        )
    return merged


class PendingScore:
    """A batch being scored; ``result()`` waits (Ray retries a shard whose actor died) and returns
    ``(total, parts)``."""

    def __init__(self, pool: RewardActorPool, images, prompts, metadata):
        self.pool = pool
        bounds = np.linspace(0, len(prompts), min(pool.num_actors, len(prompts)) + 1).astype(int)
        self.shards = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
        self.inputs = [(images[s], list(prompts[s]), list(metadata[s])) for s in self.shards]
        self.results: list = [None] * len(self.shards)
        self.refs = {pool.actors[k].score.remote(*self.inputs[k]): k for k in range(len(self.shards))}

    def done(self) -> bool:
        import ray

        if not self.refs:
            return True
        ready, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def result(self) -> tuple[np.ndarray, dict[str, RewardResult]]:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        timeout_s = raycluster.seconds(raycluster.TIMEOUT_ENV)
        deadline = time.monotonic() + timeout_s
        while self.refs:
            ready, _ = ray.wait(list(self.refs), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise raycluster.RayTimeout(
                    f"reward scoring: {len(self.refs)} of {len(self.shards)} shards not scored within "
                    f"{timeout_s:g} s (${raycluster.TIMEOUT_ENV}); a reward actor is stuck or the cluster is "
                    "overloaded")
            (ref,) = ready
            k = self.refs.pop(ref)
            try:
                self.results[k] = ray.get(ref)  # ready: returns at once
            except (RayActorError, ActorUnavailableError) as exc:
                raise RuntimeError(
                    f"reward actor for shard {k} (samples {self.shards[k].start}-{self.shards[k].stop - 1}) "
                    f"died and its {self.pool.max_retries} retries (max_task_retries) failed too: {exc}"
                ) from exc
        if not self.shards:  # empty batch
            return np.zeros(0, np.float32), {n: RewardResult(np.zeros(0, np.float32)) for n in self.pool.weights}
        total = np.concatenate([t for t, _ in self.results]).astype(np.float32)
        parts = merge_parts([p for _, p in self.results], [s.stop - s.start for s in self.shards])
        return total, parts


class RewardActorPool:
    """``reward_cfg.num_actors`` Ray CPU actors scoring the weighted rewards of ``reward_cfg``."""

    def __init__(
        self,
        reward_cfg,
        num_actors: int | None = None,
        cpus_per_actor: float = 1.0,
        threads_per_actor: int | None = None,
        max_retries: int = 2,
        pin_cores: bool = False,
    ):
        """``threads_per_actor``: intra-op threads of each actor's OCR/torch (default ``max(1, cpus_per_actor)``,
        so actors do not fight over cores); ``max_retries``: Ray's retries of a shard whose actor died, per call;
        ``pin_cores``: pin actor k to its own ``threads_per_actor`` cores (``pin_to_cores``; for a
        node that runs nothing but the pool: on a shared one, pinning cannot move off a busy core)."""
        import ray

        self.reward_cfg = reward_cfg
        self.weights = dict(reward_cfg.weights)
        self.num_actors = int(num_actors if num_actors is not None else reward_cfg.num_actors)
        if self.num_actors < 1:
            raise ValueError(f"RewardActorPool needs num_actors >= 1, got {self.num_actors} (0 scores in-process)")
        self.cpus_per_actor = cpus_per_actor
        self.threads = int(threads_per_actor or max(1, int(cpus_per_actor)))
        self.max_retries = max_retries
        self.pin_cores = pin_cores
        self.actors = []
        self.started_ray = ensure_ray(num_cpus=max(1, int(np.ceil(self.num_actors * cpus_per_actor))))
        try:  # a pool that fails to start stops its actors and the local Ray it started
            options = reward_actor_options(cpus_per_actor, max_retries)
            # Before any actor exists: Ray would queue the ones that do not fit, forever and silently.
            admission = raycluster.admit(
                f"reward.num_actors={self.num_actors}", {"CPU": cpus_per_actor}, self.num_actors,
                "lower reward.num_actors or add nodes",
                on_nodes_with=REWARD_NODE_RESOURCE if "resources" in options else None)
            self._remote = ray.remote(**options)(_RewardActor)
            self.actors = [self._new_actor(k) for k in range(self.num_actors)]
            self._wait_ready(range(self.num_actors), admission)  # an unknown reward name fails here, in the actors
        except BaseException:
            self.close()
            raise
        # Each reward's own prompt check (None: it has none), run on each whole batch before it is cut.
        self.prompt_checks = {name: check for name in self.weights if (check := prompt_check(name)) is not None}

    def _new_actor(self, k: int):
        return self._remote.remote(self.reward_cfg, self.threads, k if self.pin_cores else None)

    def _wait_ready(self, indices, admission: raycluster.Admission) -> None:
        try:
            raycluster.started([self.actors[i].ready.remote() for i in indices], admission)
        except (raycluster.RayTimeout, raycluster.RayResourcesUnavailable):
            raise
        except Exception as exc:  # a reward that cannot be built: say so here, not at the first batch
            raise RuntimeError(f"reward actors for {self.weights} failed to start: {exc}") from exc

    def score_async(self, images, prompts, metadata) -> PendingScore:
        """Start scoring a batch; ``.result()`` on the returned handle gives ``(total, parts)``."""
        if len(images) != len(prompts):
            raise ValueError(f"reward pool: {len(images)} images but {len(prompts)} prompts")
        metadata = list(metadata) if metadata is not None else [{}] * len(prompts)
        for name, check in self.prompt_checks.items():  # data errors name the batch row, not a shard's row
            check(prompts, metadata, source=f"{name} reward batch")
        return PendingScore(self, images, prompts, metadata)

    def __call__(self, images, prompts, metadata) -> tuple[np.ndarray, dict[str, RewardResult]]:
        return self.score_async(images, prompts, metadata).result()

    def close(self) -> None:
        """Stop the actors (and the local Ray this pool started)."""
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        self.actors = []
        self.started_ray = raycluster.release_ray(self.started_ray)
