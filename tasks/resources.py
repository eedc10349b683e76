"""What the cluster gives each task: secrets, environment, GPUs, timeouts and the Ray layout.

Read once at registration (``pyflyte register`` / ``make package``) from environment variables, so
the same code serves a laptop (where Flyte ignores all of it) and any cluster:

- ``DIFFUSIONRL_FLYTE_SECRETS`` (default ``hf,mlflow``): which Flyte secrets the tasks request.
  ``hf``: group ``hf``, key ``token`` -> ``HF_TOKEN`` (gated weights). ``mlflow``: group ``mlflow``,
  key ``token`` -> ``MLFLOW_TRACKING_TOKEN`` (a server behind auth). A requested secret must exist in
  the project's namespace (``kubectl create secret generic hf --from-literal=token=...``).
- ``MLFLOW_TRACKING_URI``: when set at registration, every task's environment carries it, so every
  pod of an execution talks to the same server (``tracking.uri`` in the config overrides it). The
  registered commit goes along as ``DIFFUSIONRL_GIT_SHA`` (the ``git_sha`` lineage tag).
- ``DIFFUSIONRL_GPU`` (default ``nvidia-h100``): the accelerator of the GPU tasks (Flyte's
  accelerator names: ``nvidia-h100``, ``nvidia-h200``, ``nvidia-a100``, ``nvidia-l4``, ...).
- ``DIFFUSIONRL_GPU_NODE_SELECTOR`` (``label=value``, optional): where the Ray GPU pods may run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from flytekit import PodTemplate, Resources, Secret
from flytekit.core.context_manager import FlyteContextManager
from flytekit.deck import DeckField
from flytekit.extend import TaskPlugins
from flytekit.extras.accelerators import GPUAccelerator
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig
from flytekitplugins.ray.task import RayFunctionTask

from images import CPU_IMAGE

# -- secrets and environment -------------------------------------------------------------------------

SECRETS = {
    "hf": Secret(group="hf", key="token", env_var="HF_TOKEN", mount_requirement=Secret.MountType.ENV_VAR),
    "mlflow": Secret(group="mlflow", key="token", env_var="MLFLOW_TRACKING_TOKEN",
                     mount_requirement=Secret.MountType.ENV_VAR),
}
_ENABLED = [s.strip() for s in os.environ.get("DIFFUSIONRL_FLYTE_SECRETS", "hf,mlflow").split(",") if s.strip()]
_UNKNOWN = set(_ENABLED) - set(SECRETS)
if _UNKNOWN:
    raise ValueError(f"DIFFUSIONRL_FLYTE_SECRETS names unknown secrets {sorted(_UNKNOWN)}; known: {sorted(SECRETS)}")


def secrets(*names: str) -> list[Secret]:
    """The enabled secrets among ``names`` (a task lists what it uses)."""
    return [SECRETS[n] for n in names if n in _ENABLED]


def load_secrets(requested: list[Secret]) -> None:
    """Expose each requested secret as its environment variable, wherever Flyte delivered it (an
    injected variable, ``_FSEC_<GROUP>_<KEY>``, or a mounted file). Values are never logged."""
    from flytekit import current_context

    for secret in requested:
        if os.environ.get(secret.env_var):
            continue
        try:
            value = current_context().secrets.get(secret.group, secret.key)
        except ValueError:  # not delivered: the tasks work without it (public weights, open server)
            continue
        if value:
            os.environ[secret.env_var] = value.strip()


def _registration_environment() -> dict[str, str]:
    """Baked into every task at registration: one tracking server for every pod of an execution, and
    the commit being registered (a pod runs the code tarball, no repository: the lineage tag
    ``git_sha`` comes from here)."""
    from diffusionrl.tracking.runs import git_sha

    env = {k: os.environ[k] for k in ("MLFLOW_TRACKING_URI",) if os.environ.get(k)}
    sha, dirty = git_sha()
    if sha != "unknown":
        env.update({"DIFFUSIONRL_GIT_SHA": sha, "DIFFUSIONRL_GIT_DIRTY": str(dirty).lower()})
    return env


ENVIRONMENT = _registration_environment()
MLFLOW = secrets("mlflow")
HF_MLFLOW = secrets("hf", "mlflow")
CPU_TASK = {"container_image": CPU_IMAGE, "environment": ENVIRONMENT}  # the CPU tasks that talk to MLflow
# The report tasks' Flyte Decks: ours ("Report") and flytekit's source code, timeline, inputs and
# outputs; not its "Dependencies" deck, a `pip list` of the pod run in a subprocess at every execution
# (0.7 s of a local demo run): the image's dependencies are fixed by its tag (images/).
REPORT_DECKS = (DeckField.SOURCE_CODE, DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT)

# -- GPUs, storage, timeouts --------------------------------------------------------------------------

GPU_NAME = os.environ.get("DIFFUSIONRL_GPU", "nvidia-h100")  # also what plan_resources plans for
ACCELERATOR = GPUAccelerator(GPU_NAME)
TIMEOUTS = {
    "fetch": timedelta(hours=2),
    "train": timedelta(hours=48),
    "evaluate": timedelta(hours=4),
    "register": timedelta(hours=2),
}
# Pods that download the base model (SD3.5-medium is ~20 GB with its text encoders) need disk.
MODEL_DISK = "80Gi"
GPU_TASK = Resources(cpu="4", mem="32Gi", gpu="1", ephemeral_storage=MODEL_DISK)

# -- the Ray layout of the train task -------------------------------------------------------------------

# One node shape for the head and the `train-gpu` workers: 2 GPUs (the sd35m-ocr layout: a trainer
# rank and an SGLang engine per GPU), a memory-backed /dev/shm for NCCL and CUDA IPC, local disk for
# the model. Workers join when train.world_size asks the placement group for more GPUs than the head
# has (Ray's autoscaler, up to `max_replicas` nodes); reward actors run on `reward-cpu` nodes.
GPU_NODE = {"cpu": "10", "memory": "96Gi", "nvidia.com/gpu": "2", "ephemeral-storage": MODEL_DISK}
REWARD_NODE = {"cpu": "8", "memory": "16Gi"}
SHM_SIZE = "32Gi"


def ray_pod_template(container: str, resources: dict[str, str], gpu: bool) -> PodTemplate:
    """A Ray pod: ``resources`` as requests and limits, and for GPU pods a memory-backed /dev/shm
    and the node selector of ``DIFFUSIONRL_GPU_NODE_SELECTOR``."""
    from kubernetes.client import (
        V1Container,
        V1EmptyDirVolumeSource,
        V1PodSpec,
        V1ResourceRequirements,
        V1Volume,
        V1VolumeMount,
    )

    volumes, mounts, selector = [], [], None
    if gpu:
        volumes = [V1Volume(name="dshm", empty_dir=V1EmptyDirVolumeSource(medium="Memory", size_limit=SHM_SIZE))]
        mounts = [V1VolumeMount(name="dshm", mount_path="/dev/shm")]
        label = os.environ.get("DIFFUSIONRL_GPU_NODE_SELECTOR", "")
        if "=" in label:
            key, value = label.split("=", 1)
            selector = {key: value}
    spec = V1PodSpec(
        containers=[V1Container(name=container, resources=V1ResourceRequirements(requests=resources, limits=resources),
                                volume_mounts=mounts)],
        volumes=volumes,
        node_selector=selector,
    )
    return PodTemplate(pod_spec=spec, primary_container_name=container)


# The train task's cluster autoscales (train-gpu workers): a request beyond its nodes waits for them
# (bounded by DIFFUSIONRL_RAY_AUTOSCALE_WAIT_S, diffusionrl/raycluster.py) instead of failing at once.
RAY_ENVIRONMENT = {**ENVIRONMENT, "DIFFUSIONRL_RAY_AUTOSCALING": "1"}



@dataclass
class OnDemandRayJobConfig(RayJobConfig):
    """``RayJobConfig`` (a KubeRay job on a cluster, serialized the same) whose local execution
    starts no Ray of its own: flytekit's Ray task calls ``ray.init()`` before the body in every
    local run (seconds, plus a dashboard and idle workers competing for the cores while training),
    whereas the library starts a local Ray itself when the config needs one
    (``raycluster.ensure_ray``: reward actors, ``train.world_size > 1``)."""


class OnDemandRayTask(RayFunctionTask):
    def pre_execute(self, user_params):
        if FlyteContextManager.current_context().execution_state.is_local_execution():
            return user_params
        return super().pre_execute(user_params)


TaskPlugins.register_pythontask_plugin(OnDemandRayJobConfig, OnDemandRayTask)

RAY_CONFIG = OnDemandRayJobConfig(
    head_node_config=HeadNodeConfig(
        ray_start_params={"num-cpus": GPU_NODE["cpu"], "num-gpus": GPU_NODE["nvidia.com/gpu"], "log-color": "False"},
        pod_template=ray_pod_template("ray-head", GPU_NODE, gpu=True),
    ),
    worker_node_config=[
        WorkerNodeConfig(group_name="train-gpu", replicas=0, min_replicas=0, max_replicas=8,
                         pod_template=ray_pod_template("ray-worker", GPU_NODE, gpu=True)),
        WorkerNodeConfig(group_name="reward-cpu", replicas=1, min_replicas=1, max_replicas=4,
                         ray_start_params={"resources": '"{\\"reward-cpu\\": 1}"'},
                         pod_template=ray_pod_template("ray-worker", REWARD_NODE, gpu=False)),
    ],
    enable_autoscaling=True,  # train-gpu nodes start when a placement group needs their GPUs
    shutdown_after_job_finishes=True,
    ttl_seconds_after_finished=600,
)
