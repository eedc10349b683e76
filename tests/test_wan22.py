"""Wan2.2's two experts (``WanPipeline`` with ``transformer_2`` and ``boundary_ratio``) through ``WanExperts``:
ODE parity with the stock pipeline (one guidance scale, or ``guidance_scale_2`` on the low-noise expert's
steps), each step on the expert the pipeline picks, LoRA on both experts or one, ``guidance_scale_2`` through
the recompute, the step file and the evaluation, and a two-expert LoRA registered in MLflow and served. The
exactness invariants (docs/algorithms.md section 11) with SDE steps on both sides of the boundary:
``test_family_exactness.py``; builtin:tiny-wan22 loaded by the stock pipeline with both experts:
``test_family_builtins.py``."""

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusionrl.config import ConfigError
from diffusionrl.models import (
    TINY_WAN22_REF,
    WanAdapter,
    WanExperts,
    build_tiny_wan22_pipeline,
    build_tiny_wan_pipeline,
    save_builtin,
)
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.train import build_loop
from diffusionrl.training.trainer import UpdateStats

from .conftest import started_loop, tiny_config
from .family_checks import recompute_diff, split_rel_diff

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a red cat", "a dog on the big beach"]
SPEC = SamplingSpec(resolution=32, num_steps=6, guidance_scale=5.0, sde_type="ode", num_frames=5,
                    max_sequence_length=32)


@pytest.fixture(scope="module")
def wan22():
    return WanAdapter(build_tiny_wan22_pipeline(), device="cpu")


def test_each_forward_runs_the_expert_the_pipeline_picks(wan22):
    experts = wan22.experts
    assert [experts.expert(t) for t in (1000.0, 875.0, 874.9, 10.0)] == ["high", "high", "low", "low"]
    g = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(2, 16, 2, 4, 4, generator=g),
              encoder_hidden_states=torch.randn(2, 8, 64, generator=g), return_dict=False)
    with torch.no_grad():
        for t, name in ((900.0, "high"), (500.0, "low")):
            ts = torch.full((2,), t)
            out = experts(timestep=ts, **kw)[0]
            assert torch.equal(out, getattr(experts, name)(timestep=ts, **kw)[0])
        with pytest.raises(ValueError, match="both sides of the boundary"):
            experts(timestep=torch.tensor([900.0, 500.0]), **kw)


@pytest.mark.parametrize("guidance", [(5.0, None), (1.0, None), (5.0, 2.0), (3.0, 7.0), (5.0, 1.0), (4.0, 3.0)])
def test_ode_sampling_equals_the_stock_two_expert_pipeline(wan22, guidance):
    """Same initial latents: <= 1e-5 (measured 0.0), also with the stock pipeline's ``guidance_scale_2``
    on the low-noise expert's steps (4.0 / 3.0: wan22-t2v-a14b-ocr's scales); one expert alone, or one scale
    for both, would give another video."""
    g, g2 = guidance
    spec = SamplingSpec(**{**SPEC.__dict__, "guidance_scale": g, "guidance_scale_2": g2})
    traj = LocalRolloutEngine(wan22, wan22.transformer, micro_batch_size=2).generate(PROMPTS, [0, 1], [3, 4], spec)
    assert traj.timesteps[0] >= 875 > traj.timesteps[-1]  # steps on both sides of the boundary
    assert traj.guidance == (g, g2)

    def stock(**kw):
        return wan22.pipe(prompt=PROMPTS, negative_prompt=[""] * 2, num_inference_steps=6, height=32, width=32,
                          num_frames=5, max_sequence_length=32, latents=traj.latents[:, 0], output_type="latent",
                          guidance_scale=g, **kw).frames

    assert float((stock(guidance_scale_2=g2) - traj.latents[:, -1]).abs().max()) <= 1e-5
    high_only = LocalRolloutEngine(wan22, wan22.experts.high, 2).generate(PROMPTS, [0, 1], [3, 4], spec)
    assert float((high_only.latents[:, -1] - traj.latents[:, -1]).abs().max()) > 1e-3
    if g2 is not None:  # the low-noise steps' own scale changes the video
        assert float((stock() - traj.latents[:, -1]).abs().max()) > 1e-3


def _loop(tmp_path, *extra):
    """A started tiny-cpu-wan22 loop (``conftest.started_loop``: closed on leaving the ``with``)."""
    return started_loop(tiny_config("algorithm.kl_beta=0.04", *extra, preset="tiny-cpu-wan22"), tmp_path)


def test_guidance_scale_2_reaches_the_recompute_the_parquet_file_and_the_evaluation(tmp_path):
    """The rollout's low-noise steps at sampling.guidance_scale_2: the trainer recomputes them at it (equal
    log-probs; at guidance_scale they differ), the step file keeps it, the evaluation takes eval's."""
    from diffusionrl.evaluation import eval_spec
    from diffusionrl.trajectory.store import read_trajectory, write_step

    with _loop(tmp_path, "sampling.step_strategy=all", "sampling.guidance_scale_2=2.0") as lp:
        traj, active, _ = lp.backend.score(lp.backend.rollout(0))
        sde_t = traj.timesteps[traj.sde_mask[0]]
        assert (sde_t >= 875).any() and (sde_t < 875).any() and traj.guidance == (5.0, 2.0)
        assert recompute_diff(lp, traj) <= 1e-6
        assert recompute_diff(lp, dataclasses.replace(traj, guidance_scale_2=None)) > 1e-4
        back = read_trajectory(write_step(tmp_path / "trajectories", traj, run_id="r", step=1, latents=True))
        assert back.guidance == (5.0, 2.0) and recompute_diff(lp, back) <= 1e-6
        assert split_rel_diff(lp, traj, active) <= 1e-5
    cfg = tiny_config("eval.guidance_scale_2=3", preset="tiny-cpu-wan22")
    assert eval_spec(cfg).guidance == (5.0, 3.0)
    assert eval_spec(tiny_config(preset="tiny-cpu-wan22")).guidance == (5.0, None)


def test_guidance_scale_2_needs_two_experts_and_a_cfg_pass(tmp_path):
    with pytest.raises(ConfigError, match=r"sampling.guidance_scale_2=2: model.name='builtin:tiny-sd3' has one "
                                          r"transformer, not two experts"):
        build_loop(tiny_config("sampling.guidance_scale_2=2"), tmp_path / "sd3", progress=False)
    with pytest.raises(ConfigError, match=r"eval.guidance_scale_2=3: model.name='builtin:tiny-wan' has one"):
        build_loop(tiny_config("eval.guidance_scale_2=3", preset="tiny-cpu-wan"), tmp_path / "wan", progress=False)
    with pytest.raises(ConfigError, match=r"sampling.guidance_scale_2=3 needs sampling.guidance_scale > 1"):
        tiny_config("sampling.guidance_scale=1", "sampling.guidance_scale_2=3", preset="tiny-cpu-wan22")
    wan21 = WanAdapter(build_tiny_wan_pipeline())  # and where the adapter is called directly
    cond = wan21.encode_prompts(["a cat"], "", 32)
    with pytest.raises(ConfigError, match="guidance_scale_2=2: wan has one transformer"):
        wan21.velocity(wan21.transformer, torch.zeros(1, 16, 2, 4, 4), 500.0, cond, 5.0, 2.0)


def _grad_norm(lp) -> float:
    traj, active, _ = lp.backend.score(lp.backend.rollout(0))
    worker = lp.backend.worker
    worker.trainer.optimizer.zero_grad(set_to_none=True)
    units = worker.objective.units(traj, traj.micro_batches(), torch.ones_like(active), np.random.default_rng(0))
    worker.trainer.accumulate(units, UpdateStats())
    norm = sum(float(p.grad.norm()) for p in worker.policy.params.values() if p.grad is not None)
    worker.trainer.optimizer.zero_grad(set_to_none=True)
    return norm, traj


@pytest.mark.parametrize("experts", ["low", "high"])
def test_a_lora_on_one_expert_learns_only_from_that_experts_steps(tmp_path, experts):
    """LoRA on one expert: its gradient is exactly 0 from SDE steps the other expert took, non-zero from its own."""
    norms = {}
    for window in ("[0, 1]", "[2, 3]"):  # step 0 (t = 1000, high) or step 2 (t < 875, low)
        with _loop(tmp_path / window, f"model.lora_experts={experts}", "sampling.num_sde_steps=1",
                   f"sampling.window_range={window}", "algorithm.kl_beta=0") as lp:
            assert all(n.split(".")[2] == experts for n in lp.backend.worker.policy.params)  # base_model.model.<expert>
            norms[window], traj = _grad_norm(lp)
    own = "[0, 1]" if experts == "high" else "[2, 3]"
    other = "[2, 3]" if experts == "high" else "[0, 1]"
    assert norms[own] > 0 and norms[other] == 0.0


def test_one_expert_lora_needs_two_experts(tmp_path):
    with pytest.raises(ConfigError, match="lora_experts=low.*one transformer"):
        build_loop(tiny_config("model.lora_experts=low"), tmp_path / "sd3", progress=False)


@pytest.mark.parametrize("experts", ["both", "low"])
def test_a_two_expert_lora_registers_and_serves_as_the_local_pipeline_with_it(tmp_path, experts):
    """register_lora on a local MLflow store: one diffusers LoRA file per trained expert, the pyfunc loads
    them onto transformer / transformer_2 and generates exactly what the stock pipeline does with the peft
    LoRA on both experts (WanExperts), at the run's guidance_scale_2 (latents: max abs diff 0.0, 0.29 / 0.42
    from the base model's); the card says how to load it."""
    import mlflow
    import mlflow.pyfunc
    import pandas as pd
    from peft import PeftModel
    from PIL import Image

    from diffusionrl.serving.lora_export import EXPERT_FILES
    from diffusionrl.serving.registry import register_lora
    from diffusionrl.tracking import TrackingRun
    from diffusionrl.video import gif_bytes

    base = save_builtin(TINY_WAN22_REF, tmp_path / "base")
    cfg = tiny_config(f"model.name={base}", f"model.lora_experts={experts}", "eval.guidance_scale_2=2",
                      "eval.num_steps=3", preset="tiny-cpu-wan22")
    with _loop(tmp_path / "run", f"model.lora_experts={experts}") as lp:
        policy = lp.backend.worker.policy
        gen = torch.Generator().manual_seed(1)  # a LoRA that changes the output (peft's init has B = 0)
        policy.load_lora_state({n: 0.05 * torch.randn(v.shape, generator=gen) for n, v in policy.lora_state().items()})
        lora, _ = lp.backend.save_outputs(1)  # the run's lora/ with the diffusionrl.json it records
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("wan22", artifact_location=str(tmp_path / "artifacts"))
    run = TrackingRun(uri, experiment, client.create_run(experiment).info.run_id)
    reg = register_lora(run, cfg, lora, str(base), "digest", [{"prompt": "a red cat"}], "test-digest",
                        {"eval/reward_mean": 0.5}, {})
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model(reg.model_uri)
    adapter = model.unwrap_python_model()
    settings = adapter.settings
    trained = ["high", "low"] if experts == "both" else ["low"]
    assert settings["weight_names"] == {EXPERT_FILES[e][0]: EXPERT_FILES[e][1] for e in trained}
    assert settings["generation"]["guidance_scale"] == 5.0 and settings["generation"]["guidance_scale_2"] == 2.0
    card = (Path(mlflow.artifacts.download_artifacts(reg.model_uri)) / "artifacts/adapter/README.md").read_text()
    assert "load_into_transformer_2=True" in card and ("high_noise_lora_weights" in card) == (experts == "both")
    high = "`transformer` (high-noise steps), " if experts == "both" else ""
    assert f"- Experts with the LoRA: {high}`transformer_2` (low-noise steps)\n" in card

    torch.manual_seed(0)
    (gif,) = model.predict(pd.DataFrame({"prompt": ["a red cat"]}))
    pipe = build_tiny_wan22_pipeline()  # the stock pipeline with our peft LoRA on both experts
    PeftModel.from_pretrained(WanExperts(pipe.transformer, pipe.transformer_2, 875.0), str(lora))
    kw = {k: v for k, v in settings["generation"].items() if k != "negative_prompt" or v}
    torch.manual_seed(0)
    frames = pipe(prompt=["a red cat"], output_type="np", **kw).frames[0]
    assert gif == gif_bytes((np.asarray(frames) * 255).round().astype(np.uint8))
    assert Image.open(io.BytesIO(gif)).size == (32, 32)
    latents = {}
    for name, p in (("served", adapter.pipe), ("ours", pipe), ("base", build_tiny_wan22_pipeline())):
        torch.manual_seed(0)
        latents[name] = p(prompt=["a red cat"], output_type="latent", **kw).frames
    assert float((latents["served"] - latents["ours"]).abs().max()) <= 1e-6
    assert float((latents["served"] - latents["base"]).abs().max()) > 1e-3  # the LoRA is really applied


@pytest.mark.parametrize("experts", ["both", "high"])
def test_the_cards_of_a_two_expert_lora_load_it_as_written(tmp_path, monkeypatch, experts):
    """The run folder's card (peft layout) and the registered folder's (diffusers layout): each of their
    peft and diffusers snippets, run as written, puts the LoRA on the experts it trained and on no other."""
    from diffusionrl.models.families import load_pipeline
    from diffusionrl.serving.lora_export import diffusers_adapter_dir
    from diffusionrl.serving.model_card import DIFFUSERS, render_card

    from .test_model_card import python_blocks

    with _loop(tmp_path / "run", f"model.lora_experts={experts}") as lp:
        policy = lp.backend.worker.policy
        gen = torch.Generator().manual_seed(1)
        policy.load_lora_state({n: 0.05 * torch.randn(v.shape, generator=gen) for n, v in policy.lora_state().items()})
        folder, _ = lp.backend.save_outputs(1)
    info = json.loads((folder / "diffusionrl.json").read_text())
    assert info["lora_experts"] == (["high", "low"] if experts == "both" else ["high"])
    registered = diffusers_adapter_dir(folder, tmp_path / "registered", "WanPipeline")
    (registered / "README.md").write_text(render_card(info, layout=DIFFUSERS))

    c = build_tiny_wan22_pipeline().transformer.config
    gen = torch.Generator().manual_seed(0)
    kw = dict(hidden_states=torch.randn(2, c.in_channels, 2, 4, 4, generator=gen),
              encoder_hidden_states=torch.randn(2, 6, c.text_dim, generator=gen), return_dict=False)

    def outputs(pipe) -> list[torch.Tensor]:  # both experts, each at a timestep of its own
        with torch.no_grad():
            return [m(timestep=torch.tensor([t, t]), **kw)[0] for m, t in ((pipe.transformer, 900.0),
                                                                          (pipe.transformer_2, 300.0))]

    base = outputs(load_pipeline(TINY_WAN22_REF))
    monkeypatch.chdir(tmp_path)  # the peft card's diffusers snippet writes ./lora-diffusers
    got = []
    for where in (folder, registered):
        for block in python_blocks((where / "README.md").read_text())[:2]:  # peft, diffusers (not the registry's)
            scope: dict = {}
            exec(block.replace("path/to/this/folder", str(where)), scope)
            got.append(outputs(scope["pipe"]))
    assert len(got) == 4
    for high, low in got:
        assert float((high - got[0][0]).abs().max()) <= 1e-6 and float((low - got[0][1]).abs().max()) <= 1e-6
    assert float((got[0][0] - base[0]).abs().max()) > 1e-4  # the high-noise expert has the LoRA in both cases
    assert (float((got[0][1] - base[1]).abs().max()) > 1e-4) == (experts == "both")
