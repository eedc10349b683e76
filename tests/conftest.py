"""Test setup: no network, private caches, tiny configs."""

from __future__ import annotations

import contextlib
import os
import tempfile

# No hub access in tests: everything is built in code or shipped in a wheel.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("FLYTE_LOCAL_CACHE_ENABLED", "false")
# MLflow: a private SQLite store per test session (tests that need a server start one).
_TMP = tempfile.mkdtemp(prefix="diffusionrl-tests-")
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{_TMP}/mlflow.db"
os.environ["DIFFUSIONRL_CACHE"] = f"{_TMP}/cache"

import pytest  # noqa: E402
import torch  # noqa: E402

from diffusionrl.config import load_config  # noqa: E402

# Under pytest-xdist (``make test``: one worker per core) each worker computes on one thread.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))

# The longest modules first, so that the workers of `make test` (whole modules each, taken in this order) do
# not end on one long module while the other has nothing left; the rest in their alphabetical order.
LONG_MODULES = ("test_cluster", "test_sglang", "test_distributed", "test_workflow", "test_tracking",
                "test_qwen_image_edit", "test_pretrain_shapes", "test_plan", "test_shapes_demo", "test_images")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(rank)))


@pytest.fixture(scope="module", autouse=True)
def ray_per_module():
    """Every module meets no Ray started by another: a Ray a module's tests leave running is stopped when the
    module ends, so a module's result does not depend on which modules ran before it in the same process."""
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()

# A training config small enough for a test: 2 groups x 4 samples, 32 px, 4 steps.
TINY_OVERRIDES = [
    "sampling.resolution=32",
    "sampling.num_steps=4",
    "sampling.window_range=[0, 3]",
    "train.prompts_per_step=2",
    "train.group_size=4",
    "train.micro_batch_size=4",
    "train.steps=2",
    "train.checkpoint_every=1",
    "train.log_images_every=0",
    "data.num_prompts=16",
    "eval.num_steps=4",
    "eval.num_prompts=2",
]


def tiny_config(*extra: str, preset: str = "tiny-cpu"):
    return load_config(preset, overrides=TINY_OVERRIDES + list(extra))


@contextlib.contextmanager
def started_loop(cfg, folder):
    """A training loop of ``cfg`` in ``folder`` whose rollout engine holds the policy's weights (version 0),
    closed on leaving: the module-scoped ``loop`` fixtures of the family and objective tests."""
    from diffusionrl.train import build_loop

    lp = build_loop(cfg, folder, progress=False)
    try:
        lp.backend.push_weights(0)
        yield lp
    finally:
        lp.close()


@pytest.fixture(scope="module")
def scored(loop):
    """The first step's rollout of the test module's own ``loop`` fixture, scored: ``(trajectory, active)``."""
    traj, active, _ = loop.backend.score(loop.backend.rollout(0))
    return traj, active


def saved_lora(run_dir, folder: str = "lora"):
    """The final LoRA tensors a run wrote (peft format; ``folder="lora_ema"``: their EMA)."""
    from safetensors.torch import load_file

    return load_file(str(run_dir / folder / "adapter_model.safetensors"))


def run_interrupted_and_uninterrupted(cfg, tmp_path):
    """Train ``cfg`` once straight through (``tmp_path/full``) and once "crashed" after one step
    and resumed from its checkpoint (``tmp_path/part``). Returns (full loop, resumed loop, result)."""
    from diffusionrl.train import build_loop

    full = build_loop(cfg, tmp_path / "full", progress=False)
    full.run(resume=None)
    full.close()
    part = build_loop(cfg, tmp_path / "part", progress=False)
    part.run(resume=None, stop_after=1)  # "crash" after one step
    part.close()
    resumed = build_loop(cfg, tmp_path / "part", progress=False)
    result = resumed.run(resume="auto")
    resumed.close()
    return full, resumed, result


@pytest.fixture(scope="session")
def tiny_adapter():
    """One tiny SD3 adapter for read-only uses (no LoRA attached)."""
    from diffusionrl.models import SD3Adapter, build_tiny_sd3_pipeline

    return SD3Adapter(build_tiny_sd3_pipeline(), device="cpu")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny tensors (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): one
    intra-op thread is as fast, and does not collapse (100x) when another job shares the cores, as two
    spinning OpenMP threads do."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
