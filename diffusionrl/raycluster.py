"""Ray: check what a stage asks for against the cluster before waiting on it, and never wait forever.

Ray queues an actor or a placement group the cluster cannot hold and waits for resources, silently
and without end. So before creating actors the request is compared with the cluster
(``admit``): one that can never fit fails at once naming the resource and the config key
(``RayResourcesUnavailable``); on a cluster that autoscales the wait for new nodes is bounded and
said in the log. Every ``ray.get`` / ``ray.wait`` the training waits on has a timeout that raises
``RayTimeout`` (a ``TimeoutError``: the train task retries it).

Environment (read at each call, so a test or a task can set them):

- ``DIFFUSIONRL_RAY_TIMEOUT_S`` (default 3600): the longest wait for one call on the hot path
  (a reward batch, a rollout or a train step on the trainer ranks).
- ``DIFFUSIONRL_RAY_START_TIMEOUT_S`` (default 900): actors or placement groups that fit the cluster
  to start (a trainer rank loads its model here).
- ``DIFFUSIONRL_RAY_AUTOSCALE_WAIT_S`` (default 900): how long an autoscaling cluster may take to add
  the nodes a request needs.
- ``DIFFUSIONRL_RAY_AUTOSCALING``: ``1`` or ``0`` says whether the cluster autoscales; unset, a
  cluster joined through ``$RAY_ADDRESS`` (KubeRay, ``ray start``) is taken to autoscale and a
  Ray this process started is not.

A run needs Ray for reward actors or trainer ranks: ``ensure_ray`` joins the cluster ``$RAY_ADDRESS``
names, else starts one. A Ray this process starts (``start_local_ray``) serves this process alone, so
every server of it (GCS, raylet, workers, agents) listens on 127.0.0.1 only; a cluster is joined as
it was configured.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

TIMEOUT_ENV = "DIFFUSIONRL_RAY_TIMEOUT_S"
START_TIMEOUT_ENV = "DIFFUSIONRL_RAY_START_TIMEOUT_S"
AUTOSCALE_WAIT_ENV = "DIFFUSIONRL_RAY_AUTOSCALE_WAIT_S"
AUTOSCALING_ENV = "DIFFUSIONRL_RAY_AUTOSCALING"
DEFAULTS = {TIMEOUT_ENV: 3600.0, START_TIMEOUT_ENV: 900.0, AUTOSCALE_WAIT_ENV: 900.0}
# Resources a request never names (bookkeeping, memory, per-node and placement-group markers).
_HIDDEN = re.compile(r"^(node:|accelerator_type:|memory$|object_store_memory$|.+_group_[0-9]*_?[0-9a-f]+$)")


class RayTimeout(TimeoutError):
    """A Ray call did not answer in time (retryable: the train task turns a TimeoutError into a retry)."""


class RayResourcesUnavailable(RuntimeError):
    """The cluster cannot hold what the config asks for (not retryable: change the config or the cluster)."""


LOOPBACK = "127.0.0.1"


def start_local_ray(num_cpus: int, **kwargs) -> None:
    """``ray.init`` of a Ray for this process alone, with every server on loopback.

    A Ray node listens on its node IP, and only on 127.0.0.1 when that is its node IP; without it
    the GCS, the raylet, each worker and the agents listen on every interface (``::``, ``0.0.0.0``).
    ``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough: Ray replaces a loopback address
    with the host's reachable one (``ray._private.services.resolve_ip_for_localhost``) unless
    multi-node clusters are off, its switch for macOS and Windows
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``), which Ray reads once, when it is imported (flytekit's
    Ray plugin imports it early). So the switch is off for the call: in the environment of the
    processes ``ray.init`` starts and in Ray's constant for this one, both restored afterwards (a
    single-node Ray needs nothing it governs). ``kwargs`` go to ``ray.init``."""
    import ray
    from ray._private import ray_constants

    env = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    saved, saved_env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(env)
    os.environ[env], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address=LOOPBACK, **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(env, None)
        else:
            os.environ[env] = saved_env


def ensure_ray(num_cpus: int) -> bool:
    """Start a local Ray with ``num_cpus`` CPUs unless one is running; True if this call started it.
    A local Ray listens on 127.0.0.1 only (``start_local_ray``)."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):  # a running cluster (KubeRay, `ray start`): join it, do not size it
        ray.init()
        return False
    start_local_ray(num_cpus)
    return True


def release_ray(started: bool) -> bool:
    """Stop the local Ray for which ``ensure_ray`` returned True (``started``); a Ray this process joined, or
    one already stopped, is left alone. Returns False: the caller's flag once the Ray is released."""
    import ray

    if started and ray.is_initialized():
        ray.shutdown()
    return False


def seconds(env: str) -> float:
    """A timeout from the environment (``DEFAULTS`` when unset); a bad value fails naming the variable."""
    raw = os.environ.get(env, "")
    if not raw.strip():
        return DEFAULTS[env]
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${env}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"${env}={raw!r} must be > 0 seconds")
    return value


def autoscaling() -> bool:
    flag = os.environ.get(AUTOSCALING_ENV, "").strip().lower()
    if flag:
        return flag in ("1", "true", "yes")
    return bool(os.environ.get("RAY_ADDRESS"))


def _num(x: float) -> str:
    return f"{x:g}"


def _amount(n: float, resource: str) -> str:
    plural = "s" if resource in ("CPU", "GPU") and n != 1 else ""
    return f"{_num(n)} {resource}{plural}"


def summary(resources: dict[str, float]) -> str:
    """``CPU: 2.0, GPU: 1.0`` (what a request can name, sorted)."""
    shown = {k: v for k, v in resources.items() if not _HIDDEN.match(k)}
    return ", ".join(f"{k}: {v:.1f}" for k, v in sorted(shown.items())) or "nothing"


def _nodes(on_nodes_with: str | None) -> dict[str, dict[str, float]]:
    """node id -> total resources of the alive nodes (those offering ``on_nodes_with`` when given)."""
    import ray

    return {n["NodeID"]: n["Resources"] for n in ray.nodes()
            if n.get("Alive") and (on_nodes_with is None or n["Resources"].get(on_nodes_with, 0) > 0)}


def _reserved(node_ids) -> dict[str, float]:
    """What the created placement groups hold on these nodes, per resource (from the group table, which,
    unlike ``ray.cluster_resources()``, is current the moment a group is created or removed)."""
    from ray.util.placement_group import placement_group_table

    held: dict[str, float] = {}
    for group in placement_group_table().values():
        if group.get("state") != "CREATED":
            continue
        for index, bundle in group["bundles"].items():
            if group["bundles_to_node_id"].get(index) in node_ids:
                for resource, amount in bundle.items():
                    held[resource] = held.get(resource, 0.0) + amount
    return held


@dataclass
class Admission:
    """The verdict on a request: how long to wait for it and, when the cluster is short, why."""

    what: str
    wait_s: float
    shortage: str = ""  # "" when the cluster holds the request now

    def timed_out(self) -> Exception:
        """The error to raise when the request did not start within ``wait_s``."""
        import ray

        if self.shortage:
            return RayResourcesUnavailable(
                f"{self.shortage}; still not placed after waiting {self.wait_s:g} s for the autoscaler "
                f"(${AUTOSCALE_WAIT_ENV})")
        return RayTimeout(
            f"{self.what} did not start within {self.wait_s:g} s (${START_TIMEOUT_ENV}) although the cluster "
            f"can hold it; free now: {summary(ray.available_resources())}")


def admit(what: str, per_unit: dict[str, float], units: int, fix: str, *, on_nodes_with: str | None = None
          ) -> Admission:
    """Compare ``units`` x ``per_unit`` with the cluster before creating anything.

    ``what`` names the request by its config key (``reward.num_actors=8``), ``fix`` says what to
    change. What placement groups already hold does not count; with ``on_nodes_with`` only the
    nodes offering that resource do. A request the cluster can never
    hold raises ``RayResourcesUnavailable`` at once, or, on an autoscaling cluster, is waited for at
    most ``$DIFFUSIONRL_RAY_AUTOSCALE_WAIT_S`` (logged)."""
    import ray

    totals = ray.cluster_resources()
    nodes = _nodes(on_nodes_with)
    reserved = _reserved(set(nodes))
    where = f"the Ray cluster's {on_nodes_with} nodes have" if on_nodes_with else "the Ray cluster has"
    unit = " + ".join(_amount(v, k) for k, v in per_unit.items() if v > 0)
    problems = []
    for resource, each in per_unit.items():
        if each <= 0:
            continue
        need = each * units
        have = sum(n.get(resource, 0.0) for n in nodes.values())
        held = min(have, reserved.get(resource, 0.0))
        largest = max((n.get(resource, 0.0) for n in nodes.values()), default=0.0)
        if need > have - held + 1e-9:
            free = f", {_num(held)} of them reserved by placement groups" if held else ""
            problems.append(f"{what} x {unit} needs {_amount(need, resource)}; {where} {_num(have)}{free} "
                            f"({summary(totals)})")
        elif each > largest + 1e-9:
            problems.append(f"{what}: one needs {_amount(each, resource)}; the largest node has {_num(largest)} "
                            f"({summary(totals)})")
    if not problems:
        return Admission(what, seconds(START_TIMEOUT_ENV))
    shortage = f"{'; '.join(problems)}: {fix}"
    if not autoscaling():
        raise RayResourcesUnavailable(shortage)
    wait_s = seconds(AUTOSCALE_WAIT_ENV)
    log.warning("%s; the cluster autoscales: waiting up to %.0f s for nodes ($%s)", shortage, wait_s,
                AUTOSCALE_WAIT_ENV)
    return Admission(what, wait_s, shortage)


def get(refs, what: str, timeout_s: float | None = None):
    """``ray.get(refs)`` within ``timeout_s`` (default ``$DIFFUSIONRL_RAY_TIMEOUT_S``), else ``RayTimeout``."""
    import ray
    from ray.exceptions import GetTimeoutError

    timeout_s = seconds(TIMEOUT_ENV) if timeout_s is None else timeout_s
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise RayTimeout(f"{what}: no answer within {timeout_s:g} s (${TIMEOUT_ENV}); an actor is stuck or the "
                         "cluster is overloaded") from None


def started(refs, admission: Admission):
    """Wait for actors' first answers (``refs``) within ``admission.wait_s``; ``admission.timed_out()`` else."""
    import ray
    from ray.exceptions import GetTimeoutError

    t0 = time.perf_counter()
    try:
        out = ray.get(refs, timeout=admission.wait_s)
    except GetTimeoutError:
        raise admission.timed_out() from None
    log.info("%s started in %.1f s", admission.what, time.perf_counter() - t0)
    return out
