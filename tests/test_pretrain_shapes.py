"""builtin:tiny-sd3-shapes: the pretrain script (a few steps: its losses fall, it resumes) and the shipped weights."""

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from diffusionrl.models.pretrain import main
from diffusionrl.models.tiny_shapes import SHAPES_REF, SHAPES_WEIGHTS, build_shapes_components

ROOT = Path(__file__).resolve().parents[1]
# What the shipped model does on the held-out single, colors and two prompts (the evaluation's 4
# samples each and ODE settings): single 1.0, colors 0.75, two 0.25 (0.69 in all); on the whole split
# 0.42 blobs per image, diversity 0.117 (bench/shapes_base.py); the bounds leave room for another
# machine's float rounding.
SINGLE_MIN, OVERALL_MIN, BLOBS_MAX, DIVERSITY_MIN = 0.75, 0.4, 0.6, 0.07
FEW = ["--batch", "4", "--resolution", "32", "--bank", "32", "--log-every", "10", "--save-every", "20",
       "--threads", "1", "--vae-lr", "3e-3"]


def test_a_few_steps_lower_both_losses_and_a_rerun_resumes(tmp_path):
    out = tmp_path / "w.safetensors"
    args = ["--work", str(tmp_path / "work"), "--out", str(out), "--vae-steps", "40", *FEW]
    summary = main(args + ["--transformer-steps", "30"])
    assert summary["vae_final_loss"] < 0.7 * summary["vae_first_loss"]
    assert summary["transformer_final_loss"] < summary["transformer_first_loss"]
    curves = [json.loads(line) for line in (tmp_path / "work" / "curves.jsonl").read_text().splitlines()]
    assert [(c["stage"], c["step"]) for c in curves] == [("vae", 10), ("vae", 20), ("vae", 30), ("vae", 40),
                                                         ("transformer", 10), ("transformer", 20), ("transformer", 30)]
    components = build_shapes_components(out)  # the written file is a complete model
    vae = components["vae"].config
    assert vae.scaling_factor != 1.0 and vae.shift_factor != 0.0
    again = main(args + ["--transformer-steps", "40"])  # resumes at transformer step 30
    assert again["transformer_steps"] == 40 and again["vae_steps"] == 40
    assert len((tmp_path / "work" / "curves.jsonl").read_text().splitlines()) == 8
    with pytest.raises(SystemExit, match="other settings"):
        main(args + ["--transformer-steps", "50", "--seed", "1"])


def test_a_state_without_a_recorded_setting_is_refused_in_one_line(tmp_path):
    args = ["--work", str(tmp_path / "work"), "--out", str(tmp_path / "w.safetensors"), "--vae-steps", "2",
            "--transformer-steps", "0", *FEW]
    main(args)
    state = tmp_path / "work" / "state.pt"
    saved = torch.load(state, weights_only=False)
    del saved["args"]["world"], saved["args"]["own_caption"]
    torch.save(saved, state)
    with pytest.raises(SystemExit, match=r"state.pt records no own_caption, world, settings a --work binds; use "
                                         r"another --work$"):
        main(args)


def test_fresh_scenes_each_step_resume_to_the_uninterrupted_weights(tmp_path):
    """--fresh draws and encodes new scenes every step (seeded by the step), so an interrupted run resumes
    to the same weights as one that was not, and they differ from training on the bank."""
    from safetensors.torch import load_file

    def run(name, *steps):
        out = tmp_path / f"{name}.safetensors"
        for n in steps:
            main(["--work", str(tmp_path / name), "--out", str(out), "--vae-steps", "10",
                  "--transformer-steps", str(n), "--fresh", *FEW])
        return load_file(str(out))

    whole, resumed = run("whole", 12), run("resumed", 6, 12)
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    # a finished run re-exports; --folder is the same model as a diffusers folder, which model.name loads
    from diffusionrl.models import load_pipeline

    main(["--work", str(tmp_path / "whole"), "--out", str(tmp_path / "again.safetensors"), "--vae-steps", "10",
          "--transformer-steps", "12", "--fresh", "--folder", str(tmp_path / "folder"), *FEW])
    pipe = load_pipeline(str(tmp_path / "folder"))
    assert torch.equal(pipe.transformer.proj_out.weight, whole["transformer.proj_out.weight"])
    vae = build_shapes_components(tmp_path / "whole.safetensors")["vae"]
    assert pipe.vae.config.scaling_factor == vae.config.scaling_factor
    bank = tmp_path / "bank.safetensors"
    main(["--work", str(tmp_path / "bank"), "--out", str(bank), "--vae-steps", "10", "--transformer-steps", "12",
          *FEW])
    other = load_file(str(bank))
    assert not torch.equal(other["transformer.proj_out.weight"], whole["transformer.proj_out.weight"])
    with pytest.raises(SystemExit, match="other settings"):  # --fresh binds once the transformer has started
        main(["--work", str(tmp_path / "whole"), "--out", str(bank), "--vae-steps", "10", "--transformer-steps",
              "14", *FEW])


def test_vae_from_an_exported_model_skips_the_vae_stage(tmp_path):
    """--vae-from takes the VAE of an exported model as it is and trains only the transformer; --init-from
    starts from the whole model; a file without a VAE is refused in one line."""
    from safetensors.torch import load_file

    first = tmp_path / "first.safetensors"
    main(["--work", str(tmp_path / "a"), "--out", str(first), "--vae-steps", "10", "--transformer-steps", "4", *FEW])
    second = tmp_path / "second.safetensors"
    summary = main(["--work", str(tmp_path / "b"), "--out", str(second), "--vae-steps", "10", "--transformer-steps",
                    "10", "--vae-from", str(first), "--world", "train", *FEW])
    curves = [json.loads(line) for line in (tmp_path / "b" / "curves.jsonl").read_text().splitlines()]
    assert {c["stage"] for c in curves} == {"transformer"} and summary["vae_steps"] == 10
    a, b = load_file(str(first)), load_file(str(second))
    assert all(torch.equal(a[k], b[k]) for k in a if k.startswith("vae."))
    assert not torch.equal(a["transformer.proj_out.weight"], b["transformer.proj_out.weight"])
    # --init-from: the whole model is the starting point, its latent scaling kept
    third = tmp_path / "third.safetensors"
    main(["--work", str(tmp_path / "d"), "--out", str(third), "--vae-steps", "10", "--transformer-steps", "10",
          "--init-from", str(first), "--lr", "0", *FEW])
    c = load_file(str(third))
    assert all(torch.equal(a[k], c[k]) for k in a)  # a learning rate of 0 leaves every weight where it started
    assert build_shapes_components(third)["vae"].config.scaling_factor == \
        build_shapes_components(first)["vae"].config.scaling_factor
    with pytest.raises(SystemExit, match="no vae"):
        from safetensors.torch import save_file

        save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
        main(["--work", str(tmp_path / "c"), "--out", str(second), "--vae-from", str(tmp_path / "other.safetensors"),
              *FEW])


def test_shipped_weights_match_the_digest_in_the_docs():
    docs = (ROOT / "docs" / "architecture.md").read_text()
    documented = re.search(r"tiny_sd3_shapes\.safetensors` sha256 `([0-9a-f]{64})`", docs)
    assert documented, "docs/architecture.md names the shipped weights' sha256"
    assert hashlib.sha256(SHAPES_WEIGHTS.read_bytes()).hexdigest() == documented.group(1)


def test_shipped_model_loads_as_a_builtin_reference():
    from diffusionrl.models import load_pipeline

    pipe = load_pipeline(SHAPES_REF)
    assert pipe.vae.config.latent_channels == 4 and len(pipe.vae.config.block_out_channels) == 3  # 4x
    assert pipe.transformer.config.patch_size == 2 and pipe.transformer.config.sample_size == 16  # 64 image tokens
    assert sum(p.numel() for p in pipe.transformer.parameters()) > 3_000_000
    assert all(not p.requires_grad for p in pipe.transformer.parameters())
    assert torch.isfinite(next(pipe.transformer.parameters())).all()


def test_the_shipped_base_model_draws_its_world_on_held_out_prompts():
    """Held-out prompts, judged strictly: single objects right, crisp objects (few shapeless blobs),
    and pictures that change with the prompt (bench/shapes_base.py measures the whole split)."""
    from diffusionrl.config import load_config
    from diffusionrl.data import load_prompts
    from diffusionrl.evaluation import eval_samples, eval_spec
    from diffusionrl.heldout import diversity
    from diffusionrl.models import load_adapter
    from diffusionrl.rewards.geneval_mini import GenEvalMini
    from diffusionrl.rollout.local import LocalRolloutEngine

    # the base at its best guidance (the demo samples CFG-free, as DiffusionNFT trains)
    cfg = load_config("tiny-cpu-shapes", overrides=["eval.guidance_scale=4.5"])
    test = load_prompts(cfg.data).test
    rows = [r for r in test if r["category"] in ("single", "colors", "two")]
    prompts, groups, seeds, metadata = eval_samples(rows, 4, cfg.eval.seed)
    adapter = load_adapter(cfg.model, cfg.train.mixed_precision)
    traj = LocalRolloutEngine(adapter, adapter.transformer, 20).generate(
        prompts, groups, seeds, eval_spec(cfg), None, metadata)
    result = GenEvalMini()(traj.images, prompts, metadata)
    single = [s for s, m in zip(result.per_sample["success"], metadata) if m["category"] == "single"]
    assert np.mean(single) >= SINGLE_MIN, result.per_sample["success"]
    assert result.info["accuracy"] >= OVERALL_MIN and result.info["blobs_per_image"] <= BLOBS_MAX
    assert diversity(traj.images, prompts) >= DIVERSITY_MIN
