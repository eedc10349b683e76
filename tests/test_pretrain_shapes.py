"""builtin:tiny-sd3-shapes: the pretrain script (a few steps: its losses fall, it resumes) and the shipped weights."""

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from diffusionrl.models.pretrain import main
from diffusionrl.models.tiny_shapes import SHAPES_REF, SHAPES_WEIGHTS, build_shapes_components

ROOT = Path(__file__).resolve().parents[1]
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


def test_shipped_weights_match_the_digest_in_the_docs():
    docs = (ROOT / "docs" / "architecture.md").read_text()
    documented = re.search(r"tiny_sd3_shapes\.safetensors` sha256 `([0-9a-f]{64})`", docs)
    assert documented, "docs/architecture.md names the shipped weights' sha256"
    assert hashlib.sha256(SHAPES_WEIGHTS.read_bytes()).hexdigest() == documented.group(1)


def test_shipped_model_loads_as_a_builtin_reference():
    from diffusionrl.models import load_pipeline

    pipe = load_pipeline(SHAPES_REF)
    assert pipe.vae.config.latent_channels == 16 and len(pipe.vae.config.block_out_channels) == 4  # 8x
    assert sum(p.numel() for p in pipe.transformer.parameters()) > 1_000_000
    assert all(not p.requires_grad for p in pipe.transformer.parameters())
    assert torch.isfinite(next(pipe.transformer.parameters())).all()
