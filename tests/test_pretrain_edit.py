"""builtin:tiny-flux-kontext-shapes: the edit pretraining script (runs, resumes bit for bit, refuses other
settings on resume) and the builtin built from the shapes model's parts and the shipped transformer."""

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffusionrl.data.shape_edits import edit_splits
from diffusionrl.models.pretrain_edit import main
from diffusionrl.models.tiny_flux_shapes import (
    KONTEXT_SHAPES_REF,
    KONTEXT_SHAPES_WEIGHTS,
    build_kontext_shapes_components,
)

ROOT = Path(__file__).resolve().parents[1]
FEW = ["--batch", "4", "--bank", "12", "--double", "1", "--single", "1", "--heads", "1", "--log-every", "1",
       "--save-every", "1", "--threads", "1"]


def test_two_steps_then_a_resume_equal_four_steps_bit_for_bit(tmp_path):
    straight = main(["--work", str(tmp_path / "a"), "--out", str(tmp_path / "a.safetensors"), "--steps", "4", *FEW])
    args = ["--work", str(tmp_path / "b"), "--out", str(tmp_path / "b.safetensors"), *FEW]
    first = main(args + ["--steps", "2"])
    assert first["steps"] == 2
    resumed = main(args + ["--steps", "4"])
    assert resumed["steps"] == 4 and resumed["final_loss"] == straight["final_loss"]
    a, b = load_file(tmp_path / "a.safetensors"), load_file(tmp_path / "b.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    curves = [json.loads(line) for line in (tmp_path / "b" / "curves.jsonl").read_text().splitlines()]
    assert [(c["stage"], c["step"]) for c in curves] == [("edit", s) for s in (1, 2, 3, 4)]
    assert all(0.5 < c["loss"] < 5 for c in curves)  # velocity of unit-scale latents and noise: ~2 at first
    bank = torch.load(tmp_path / "b" / "bank.pt")
    _, held_out = edit_splits(0.2, 0)
    assert bank["source"].shape == (12, 4, 16, 16) and not set(bank["texts"]) & held_out  # training split only
    assert not torch.equal(bank["source"], bank["target"])
    with pytest.raises(SystemExit, match="other settings"):
        main(args + ["--steps", "5", "--lr", "3e-3"])
    # the written file is a complete model: its size is in its metadata
    components = build_kontext_shapes_components(tmp_path / "b.safetensors")
    assert components["transformer"].config.num_single_layers == 1
    assert torch.equal(components["transformer"].state_dict()["proj_out.weight"], b["proj_out.weight"])


def test_every_instruction_with_dropout_draws_held_out_instructions_and_writes_a_loadable_folder(tmp_path):
    """``--instructions all`` draws held-out instructions too (in other scenes than a run's held-out rows);
    ``--cfg-dropout`` replaces a share of them by the empty one, which moves the loss; the metadata says so; a
    state.pt of the other settings is refused; ``--folder`` is a model the edit preset loads."""
    from diffusionrl.config import load_config
    from diffusionrl.models import load_adapter

    few = [*FEW[:2], *FEW[4:], "--bank", "150", "--steps", "2"]
    plain = main(["--work", str(tmp_path / "p"), "--out", str(tmp_path / "p.safetensors"), "--instructions", "all",
                  *few])
    args = ["--work", str(tmp_path / "d"), "--out", str(tmp_path / "d.safetensors"), "--instructions", "all",
            "--folder", str(tmp_path / "folder"), *few]
    dropped = main(args + ["--cfg-dropout", "0.5"])
    bank = torch.load(tmp_path / "d" / "bank.pt")
    train, held_out = edit_splits(0.2, 0)
    assert set(bank["texts"]) & held_out and set(bank["texts"]) & train
    assert dropped["first_loss"] != plain["first_loss"]
    with pytest.raises(SystemExit, match="other settings.*cfg_dropout"):
        main(args + ["--cfg-dropout", "0.1"])
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d.safetensors"), "pt") as f:
        meta = json.loads(f.metadata()["diffusionrl"])
    assert meta["instructions"] == "all" and meta["cfg_dropout"] == 0.5 and meta["loose"] == 0.0
    # --loose: the same rows, about half of their targets holding one more edit than the instruction names
    main(["--work", str(tmp_path / "l"), "--out", str(tmp_path / "l.safetensors"), "--instructions", "all",
          "--loose", "0.5", *few[:-2], "--steps", "0"])
    plain_bank, loose = torch.load(tmp_path / "p" / "bank.pt"), torch.load(tmp_path / "l" / "bank.pt")
    assert torch.equal(plain_bank["source"], loose["source"]) and plain_bank["texts"] == loose["texts"]
    changed = (plain_bank["target"] - loose["target"]).abs().flatten(1).amax(1) > 0
    assert 0.3 < changed.float().mean() < 0.7
    cfg = load_config("tiny-cpu-shape-edits", overrides=[f"model.name={tmp_path / 'folder'}", "model.device=cpu"])
    adapter = load_adapter(cfg.model)
    assert adapter.family == "flux-kontext" and adapter.cfg_mode == "separate"
    assert torch.equal(adapter.transformer.state_dict()["proj_out.weight"],
                       load_file(tmp_path / "d.safetensors")["proj_out.weight"])


def test_the_builtin_reuses_the_shapes_model_and_loads_the_shipped_transformer():
    from diffusionrl.config import ModelConfig
    from diffusionrl.models import load_adapter
    from diffusionrl.models.tiny_shapes import build_shapes_components

    adapter = load_adapter(ModelConfig(name=KONTEXT_SHAPES_REF, device="cpu"))
    pipe = adapter.pipe
    assert type(pipe).__name__ == "FluxKontextPipeline" and adapter.family == "flux-kontext"
    assert pipe.vae_scale_factor == 4 and pipe.vae.config.latent_channels == 4
    assert adapter.latent_shape(64) == (4, 16, 16) and adapter.image_seq_len(64) == 64
    assert pipe.transformer.config.in_channels == 16 and not pipe.transformer.config.guidance_embeds
    shapes = build_shapes_components()
    assert pipe.vae.config.scaling_factor == shapes["vae"].config.scaling_factor
    assert torch.equal(pipe.text_encoder.state_dict()["embeddings.token_embedding.weight"],
                       shapes["text_encoder"].state_dict()["text_model.embeddings.token_embedding.weight"])
    assert pipe.text_encoder_2 is not None and pipe.text_encoder_2.config.d_model == 64
    assert all(not p.requires_grad for p in pipe.transformer.parameters())
    shipped = load_file(KONTEXT_SHAPES_WEIGHTS)
    assert all(torch.equal(v, shipped[k]) for k, v in pipe.transformer.state_dict().items())
    assert KONTEXT_SHAPES_WEIGHTS.stat().st_size <= 30 * 2**20


def test_shipped_weights_match_the_digest_in_the_docs():
    docs = (ROOT / "docs" / "architecture.md").read_text()
    documented = re.search(r"tiny_flux_kontext_shapes\.safetensors` sha256 `([0-9a-f]{64})`", docs)
    assert documented, "docs/architecture.md names the shipped weights' sha256"
    assert hashlib.sha256(KONTEXT_SHAPES_WEIGHTS.read_bytes()).hexdigest() == documented.group(1)
