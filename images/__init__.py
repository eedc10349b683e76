"""Container images of the pipeline (flytekit ImageSpec), built by ``pyflyte register``/``run --remote``.

Versions are pinned once, in pyproject.toml: the images install the project itself
(``pip install .``), so they carry exactly its dependency ranges.

- ``CPU_IMAGE``: data preparation, checkpoint fetch, evaluation on CPU, report, registry.
- ``GPU_IMAGE``: the Ray training stage on GPUs: CUDA torch from the PyTorch wheels, the project,
  ``ray[default]``, the Flyte Ray plugin and SGLang (its diffusion runtime serves rollouts).
Local runs (``pyflyte run`` without ``--remote``) never build them.
"""

from __future__ import annotations

import os

from flytekit import ImageSpec

REGISTRY = os.environ.get("DIFFUSIONRL_IMAGE_REGISTRY", "localhost:30000")
PYTHON = "3.11"

CPU_IMAGE = ImageSpec(
    name="diffusionrl-cpu",
    registry=REGISTRY,
    python_version=PYTHON,
    apt_packages=["libgl1", "libglib2.0-0"],  # opencv (RapidOCR) needs them
    pip_extra_index_url=["https://download.pytorch.org/whl/cpu"],
    packages=["torch==2.13.0"],
    copy=["pyproject.toml", "README.md", "diffusionrl", "configs"],
    commands=["pip install --no-cache-dir ."],
    source_root=".",
)

GPU_IMAGE = ImageSpec(
    name="diffusionrl-gpu",
    registry=REGISTRY,
    python_version=PYTHON,
    apt_packages=["libgl1", "libglib2.0-0", "build-essential"],
    pip_extra_index_url=["https://download.pytorch.org/whl/cu128"],
    # sglang 0.5.23 pins torch 2.14.1; its diffusion runtime serves rollouts on the GPU. The
    # [diffusion] extra brings what sglang.multimodal_gen imports (diffusers 0.37, inside our
    # range); the SGLang engine then runs `sglang serve` with this image's own interpreter.
    packages=["torch==2.14.1", "torchvision==0.29.1", "sglang[diffusion]==0.5.23", "ray[default]>=2.40,<2.61"],
    copy=["pyproject.toml", "README.md", "diffusionrl", "configs"],
    commands=["pip install --no-cache-dir ."],
    source_root=".",
)
