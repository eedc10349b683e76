"""Full fine-tuning (``model.finetune=full``, ``training.full``): every transformer weight trains, with the
exactness of the LoRA path (recompute, micro-batch split, resume) and the model folder it writes."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from diffusionrl.config import ConfigError

from .conftest import run_interrupted_and_uninterrupted, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FULL = ["model.finetune=full", "eval.every=0"]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    from diffusionrl.train import build_loop

    out = tmp_path_factory.mktemp("full")
    loop = build_loop(tiny_config(*FULL), out, progress=False)
    try:
        base = {n: p.detach().clone() for n, p in loop.backend.worker.policy.params.items()}
        result = loop.run(resume=None)
        trained = loop.backend.worker.policy.lora_state()
    finally:
        loop.close()
    return result, base, trained


def test_every_weight_trains_and_the_recompute_is_exact(full_run):
    result, base, trained = full_run
    assert len(base) > 50 and base.keys() == trained.keys()  # every parameter, not a LoRA's
    for m in result.metrics:
        assert m["train/log_prob_mean_abs_diff"] <= 1e-6 and m["train/optimizer_steps"] >= 1
    moved = [n for n in base if not torch.equal(base[n], trained[n])]
    assert len(moved) > 0.9 * len(base), f"{len(moved)} of {len(base)} tensors moved"


def test_the_model_folder_loads_into_the_pipeline(full_run):
    from diffusers import SD3Transformer2DModel

    result, _, trained = full_run
    folder = result.model_dir
    info = json.loads((folder / "diffusionrl.json").read_text())
    assert info["finetune"] == "full" and info["components"] == ["transformer"] and info["step"] == 2
    assert "fully fine-tuned" in (folder / "README.md").read_text()
    loaded = SD3Transformer2DModel.from_pretrained(str(folder / "transformer"))
    state = dict(loaded.named_parameters())
    assert state.keys() == trained.keys()
    assert all(torch.equal(state[n].detach(), trained[n]) for n in trained)


def test_the_gradient_does_not_depend_on_the_micro_batch_split(tmp_path):
    from diffusionrl.train import build_loop
    from diffusionrl.training.trainer import UpdateStats

    loop = build_loop(tiny_config(*FULL), tmp_path, progress=False)
    try:
        backend = loop.backend
        backend.push_weights(0)
        traj, active, _ = backend.score(backend.rollout(0))
        worker = backend.worker

        def grads(micro: int) -> dict[str, torch.Tensor]:
            split = dataclasses.replace(traj, micro_batch_size=micro)
            worker.trainer.optimizer.zero_grad(set_to_none=True)
            units = worker.objective.units(split, split.micro_batches(), active, np.random.default_rng(0))
            assert worker.trainer.accumulate(units, UpdateStats())
            out = {n: p.grad.detach().clone() for n, p in worker.policy.params.items() if p.grad is not None}
            worker.trainer.optimizer.zero_grad(set_to_none=True)
            return out

        whole, split = grads(traj.micro_batch_size), grads(1)
    finally:
        loop.close()
    assert whole.keys() == split.keys() and len(whole) > 50
    worst = max(float((whole[n] - split[n]).norm() / whole[n].norm().clamp_min(1e-12)) for n in whole)
    assert worst <= 1e-5


@pytest.mark.parametrize("preset,checkpoint_format", [("tiny-cpu", "gathered"), ("tiny-cpu-nft", "sharded")])
def test_a_resumed_full_run_equals_the_uninterrupted_one(tmp_path, preset, checkpoint_format):
    cfg = tiny_config(*FULL, "train.ema=true", f"train.checkpoint_format={checkpoint_format}", preset=preset)
    full, resumed, result = run_interrupted_and_uninterrupted(cfg, tmp_path)
    assert result.steps_done == 2 and (tmp_path / "part" / "model_ema" / "transformer").is_dir()
    for folder in ("model", "model_ema"):
        a = load_file(str(tmp_path / "full" / folder / "transformer" / "diffusion_pytorch_model.safetensors"))
        b = load_file(str(tmp_path / "part" / folder / "transformer" / "diffusion_pytorch_model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder
    assert [m["train/loss"] for m in full.history] == [m["train/loss"] for m in resumed.history]


@pytest.mark.parametrize("extra,needle", [
    (["model.dtype=bfloat16"], "model.dtype=float32"),
    (["algorithm.init_lora=/tmp/some-lora"], "algorithm.init_lora"),
    (["model.lora_experts=high"], "lora_experts"),
])
def test_what_full_fine_tuning_refuses(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        tiny_config("model.finetune=full", *extra)


@pytest.mark.parametrize("preset", ["tiny-cpu-grpo-guard", "tiny-cpu-dppo", "tiny-cpu-awm", "tiny-cpu-dpo",
                                    "tiny-cpu-sft"])
def test_every_objective_takes_a_full_step(tmp_path, preset):
    """One step of each other objective (and the SFT warm start) moves nearly every weight; the objectives with
    a KL term or DPO's implicit reward hold the frozen reference copy, SFT none."""
    from diffusionrl.train import build_loop

    loop = build_loop(tiny_config(*FULL, "train.steps=1", preset=preset), tmp_path, progress=False)
    try:
        policy = loop.backend.worker.policy
        from diffusionrl.config.objectives import needs_reference

        assert policy.finetune == "full"
        cfg = loop.backend.cfg
        expected = preset != "tiny-cpu-sft" and (cfg.algorithm.kl_beta > 0 or preset.endswith("dpo"))
        assert (policy.frozen is not None) == needs_reference(cfg) == expected
        before = policy.lora_state()
        metrics = loop.run(resume=None).metrics[0]
        after = policy.lora_state()
    finally:
        loop.close()
    assert np.isfinite(metrics["train/loss"]) and metrics["train/optimizer_steps"] >= 1
    assert sum(not torch.equal(before[n], after[n]) for n in before) > 0.9 * len(before)
