"""Container images of the pipeline (flytekit ImageSpec).

The images carry the project's DEPENDENCIES only, never its code: the code (``diffusionrl/``,
``tasks/``, ``workflows/``, ``configs/``, ``pyproject.toml``) travels with fast registration
(``make package``, ``pyflyte register`` and ``pyflyte run --remote --copy all`` all ship it and
unpack it under ``/root``, which is on the images' ``PYTHONPATH``). So an image's tag, flytekit's
hash of the ImageSpec, changes when a dependency changes (``[project].dependencies`` in
pyproject.toml, the package and apt lists below) and not when library code changes.

- ``CPU_IMAGE``: data preparation, base-weights fetch, evaluation on CPU, report, registry.
- ``GPU_IMAGE``: the Ray training stage on GPUs: CUDA torch from the PyTorch wheels,
  ``ray[default]``, SGLang (its diffusion runtime serves rollouts) and ``wget`` (KubeRay's readiness
  probes run it in the head and worker pods).

The registry comes from ``DIFFUSIONRL_IMAGE_REGISTRY`` (e.g. ``ghcr.io/acme``; ``localhost:30000``
for the flytectl demo sandbox). Importing this module never needs it: local runs do not use the
images, and ``make package`` (``DIFFUSIONRL_IMAGES_OFFLINE=1``) writes the image names without
checking or building anything, naming a placeholder registry when the variable is unset. Any
command that would have to build an image (``make images``, ``pyflyte register``, ``pyflyte run
--remote``) stops with a message that says what is missing. Build with ``make images``
(``python -m images build``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import click
from flytekit import ImageSpec
from flytekit.image_spec.default_builder import DefaultImageBuilder
from flytekit.image_spec.image_spec import ImageBuildEngine

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

REGISTRY_ENV = "DIFFUSIONRL_IMAGE_REGISTRY"
# Set by `make package`: name the images but never look them up in a registry or build them.
OFFLINE_ENV = "DIFFUSIONRL_IMAGES_OFFLINE"
# Written into the task templates when DIFFUSIONRL_IMAGE_REGISTRY is unset: `.invalid` never
# resolves (RFC 2606), so a package registered by mistake fails to pull instead of pulling
# something else.
PLACEHOLDER_REGISTRY = "set-diffusionrl-image-registry.invalid"
BUILDER = "diffusionrl"
PYTHON = "3.11"

# What each image adds to the project's dependencies. Editing these lists changes the tags.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_PACKAGES = ["torch==2.13.0"]  # the CPU build the Makefile installs locally
CPU_APT = ["libgl1", "libglib2.0-0"]  # opencv (RapidOCR) needs them

GPU_INDEX = "https://download.pytorch.org/whl/cu128"
# sglang 0.5.23 pins torch 2.14.1; its diffusion runtime serves rollouts on the GPU. The
# [diffusion] extra brings what sglang.multimodal_gen imports (diffusers 0.37, inside our
# range); the SGLang engine then runs `sglang serve` with this image's own interpreter.
# ray[default]: the dashboard agent and the health endpoints KubeRay probes.
GPU_PACKAGES = ["torch==2.14.1", "torchvision==0.29.1", "sglang[diffusion]==0.5.23", "ray[default]>=2.40,<2.61"]
# wget: KubeRay's readiness/liveness probes run `wget ... /api/local_raylet_healthz` in the pods.
GPU_APT = ["libgl1", "libglib2.0-0", "build-essential", "wget"]


def project_dependencies(pyproject: Path = PYPROJECT) -> list[str]:
    """``[project].dependencies`` of ``pyproject``, in file order (the single place for pins).

    A pod that got only the imported ``.py`` files (``pyflyte run --remote --copy auto``) has no
    pyproject.toml: there the list is empty. It only matters where images are named or built,
    which is a checkout; inside a task nothing reads it (use ``--copy all`` so that
    ``ImageSpec.is_container()`` would agree too).
    """
    if not pyproject.is_file():
        return []
    import tomllib

    with pyproject.open("rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def registry_from_env() -> str:
    return os.environ.get(REGISTRY_ENV, "").strip() or PLACEHOLDER_REGISTRY


def make_images(dependencies: list[str], registry: str) -> tuple[ImageSpec, ImageSpec]:
    """The (CPU, GPU) ImageSpecs for a dependency list and a registry.

    No ``source_root``, ``copy`` or ``commands``: nothing from the checkout goes into an image,
    so flytekit's tag hashes only these fields. (Registering without fast registration,
    ``--copy none``, would make flytekit copy the loaded modules in; don't.)
    """
    cpu = ImageSpec(
        name="diffusionrl-cpu",
        builder=BUILDER,
        registry=registry,
        python_version=PYTHON,
        apt_packages=list(CPU_APT),
        pip_extra_index_url=[CPU_INDEX],
        packages=list(dependencies) + CPU_PACKAGES,
    )
    gpu = ImageSpec(
        name="diffusionrl-gpu",
        builder=BUILDER,
        registry=registry,
        python_version=PYTHON,
        apt_packages=list(GPU_APT),
        pip_extra_index_url=[GPU_INDEX],
        packages=list(dependencies) + GPU_PACKAGES,
    )
    return cpu, gpu


# ---- preflight: what `make images` (or a registration that must build) is missing ----------


def _registry_host(registry: str) -> str:
    return registry.split("/", 1)[0]


def _needs_login(host: str) -> bool:
    return host.split(":")[0] not in ("localhost", "127.0.0.1")


def _logged_in(host: str) -> bool:
    """Whether docker has credentials for ``host`` (``docker login`` writes them to
    ``$DOCKER_CONFIG/config.json``: an ``auths`` entry, also with a credential store, or a
    ``credHelpers`` entry)."""
    config = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    if ("." not in host and ":" not in host) or host == "docker.io":  # Docker Hub
        host = "index.docker.io"
    keys = set(data.get("auths", {})) | set(data.get("credHelpers", {}))
    for key in keys:
        name = key.split("://", 1)[-1].split("/", 1)[0]
        if name == host or (host == "index.docker.io" and name in ("docker.io", "registry-1.docker.io")):
            return True
    return False


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)


def build_problems(registry: str | None = None) -> list[str]:
    """One line per thing missing to build and push the images (empty: ready)."""
    registry = registry if registry is not None else os.environ.get(REGISTRY_ENV, "").strip()
    problems = []
    if not registry or registry == PLACEHOLDER_REGISTRY:
        problems.append(
            f"{REGISTRY_ENV} is not set: export the registry the cluster pulls from "
            "(e.g. ghcr.io/acme, or localhost:30000 for the flytectl demo sandbox)"
        )
    if shutil.which("docker") is None:
        problems.append("docker is not installed (no `docker` on PATH): install Docker with the buildx plugin")
        return problems
    info = _run(["docker", "info", "--format", "{{.ServerVersion}}"])
    if info.returncode != 0:
        detail = (info.stderr.strip().splitlines() or ["docker info failed"])[-1]
        problems.append(f"no Docker daemon is reachable ({detail})")
    if _run(["docker", "buildx", "version"]).returncode != 0:
        problems.append(
            "docker buildx is missing: flytekit's image builder needs BuildKit (`RUN --mount`, `docker build --push`)"
        )
    if registry and registry != PLACEHOLDER_REGISTRY:
        host = _registry_host(registry)
        if _needs_login(host) and not _logged_in(host):
            problems.append(f"not logged in to {host}: run `docker login {host}`")
    return problems


class DiffusionRLImageBuilder(DefaultImageBuilder):
    """flytekit's default (Docker/BuildKit) builder with this project's guards:

    - ``DIFFUSIONRL_IMAGES_OFFLINE=1`` (``make package``): never check a registry or build; the
      templates name ``REGISTRY/NAME:TAG`` (or the placeholder registry, with a warning).
    - otherwise an image that must be built, or looked up, with no registry set is an error that
      says so, and a build that lacks Docker, buildx or a login lists what is missing.
    """

    builder_type = BUILDER

    def should_build(self, image_spec: ImageSpec) -> bool:
        placeholder = image_spec.registry == PLACEHOLDER_REGISTRY
        if os.environ.get(OFFLINE_ENV, "").lower() in ("1", "true", "yes"):
            if placeholder:
                click.secho(
                    f"{REGISTRY_ENV} is not set: the package names the placeholder image {image_spec.image_name()}; "
                    "set it, run `make images`, then `make package` again before registering",
                    fg="yellow",
                    err=True,
                )
            else:
                click.secho(
                    f"offline: not checked or built: {image_spec.image_name()} (`make images` builds it)", err=True
                )
            return False
        if placeholder:
            raise RuntimeError(
                f"{REGISTRY_ENV} is not set, so image {image_spec.name} cannot be built or found: export the registry "
                f"the cluster pulls from (e.g. ghcr.io/acme) and run `make images`; for an offline package with "
                f"placeholder image names use `make package` ({OFFLINE_ENV}=1)"
            )
        return super().should_build(image_spec)

    def build_image(self, image_spec: ImageSpec) -> str | None:
        problems = build_problems(image_spec.registry)
        if problems:
            raise RuntimeError(f"cannot build {image_spec.image_name()}:\n  " + "\n  ".join(problems))
        return super().build_image(image_spec)


# Lowest priority: only ImageSpecs that name this builder use it.
ImageBuildEngine.register(BUILDER, DiffusionRLImageBuilder(), priority=0)

CPU_IMAGE, GPU_IMAGE = make_images(project_dependencies(), registry_from_env())
IMAGES = {"cpu": CPU_IMAGE, "gpu": GPU_IMAGE}
