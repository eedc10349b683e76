"""The model card of a LoRA folder (``serving.model_card``): a real card, not peft's empty template,
whose loading snippets load the folder that is actually written."""

from __future__ import annotations

import json
import re

import pytest
import torch

from diffusionrl.serving.model_card import render_card, version_description, write_card

from .conftest import tiny_config

INFO = {
    "base_model": "stabilityai/stable-diffusion-3.5-medium", "base_model_revision": "b940f670",
    "base_model_digest": "ab" * 32, "step": 40, "algorithm": "flow_grpo", "config_digest": "0123456789abcdef",
    "family": "sd3", "pipeline_class": "StableDiffusion3Pipeline", "reward": {"ocr": 1.0},
    "registered_model": "sd35m-ocr",
}
RESULTS = {"eval/reward_mean": 0.62, "eval/base_reward_mean": 0.41, "eval/ocr_mean": 0.62, "eval/base_ocr_mean": 0.41,
           "eval/reward_gain": 0.21, "eval/win_rate": 0.75, "eval/num_prompts": 24.0, "eval/seeds_per_prompt": 1.0}


def front_matter(card: str) -> dict[str, object]:
    head = card.split("---\n")[1]
    out: dict[str, object] = {}
    for line in head.splitlines():
        if line.startswith("- "):
            out.setdefault("tags", []).append(json.loads(line[2:]))
        elif line.endswith(":"):
            out[line[:-1]] = []
        else:
            key, _, value = line.partition(": ")
            out[key] = json.loads(value) if value.startswith('"') else value
    return out


def python_blocks(card: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", card, re.S)


def test_a_card_says_what_the_lora_is_and_how_to_load_it():
    card = render_card(INFO)
    assert "More Information Needed" not in card
    meta = front_matter(card)
    assert meta["base_model"] == "stabilityai/stable-diffusion-3.5-medium" and meta["library_name"] == "peft"
    assert meta["tags"] == ["lora", "diffusionrl", "flow_grpo", "sd3"]
    for fact in ("b940f670", "ab" * 32, "Training steps: 40", "0123456789abcdef", "`ocr` 1", "Flow-GRPO"):
        assert fact in card, fact
    assert "Not measured when this folder was written" in card and "report.html" in card
    peft, diffusers, served = python_blocks(card)
    assert 'StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium", revision="b940f670")' \
        in peft and "PeftModel.from_pretrained(pipe.transformer," in peft
    assert "diffusers_adapter_dir(" in diffusers and "pipe.load_lora_weights(" in diffusers
    assert 'mlflow.pyfunc.load_model("models:/sd35m-ocr@champion")' in served
    assert render_card(INFO) == card  # nothing in it changes from one call to the next


def test_held_out_results_and_the_registered_layout():
    card = render_card(INFO, RESULTS, layout="diffusers")
    assert front_matter(card)["library_name"] == "diffusers"
    assert "| reward_mean | 0.62 | 0.41 |" in card and "| ocr_mean | 0.62 | 0.41 |" in card
    assert "win rate 0.75" in card and "Not measured" not in card
    registered = python_blocks(card)[0]
    assert 'pipe.load_lora_weights("path/to/this/folder")' in registered and "diffusers_adapter_dir" not in registered
    builtin = render_card({**INFO, "base_model": "builtin:tiny-sd3", "base_model_revision": ""})
    assert front_matter(builtin)["base_model"] == "builtin:tiny-sd3"
    assert 'load_pipeline("builtin:tiny-sd3")' in python_blocks(builtin)[0]
    assert "base_model" not in front_matter(render_card({**INFO, "base_model": "/data/models/sd3"}))
    video = front_matter(render_card({**INFO, "family": "wan", "pipeline_class": "WanPipeline"}))
    assert video["pipeline_tag"] == "text-to-video" and "wan" in video["tags"]


def test_an_editing_models_card_serves_an_instruction_with_its_image():
    for family, pipeline in (("flux-kontext", "FluxKontextPipeline"), ("qwen-image-edit", "QwenImageEditPlusPipeline")):
        card = render_card({**INFO, "family": family, "pipeline_class": pipeline}, layout="diffusers")
        assert front_matter(card)["pipeline_tag"] == "image-to-image"
        served = python_blocks(card)[2]
        assert 'Path("input.png").read_bytes()' in served and '"image": [image]' in served
        assert ("VAE_IMAGE_SIZE" in card) == (family == "qwen-image-edit")  # the stock pipeline's 1024^2 input area
    assert front_matter(render_card(INFO))["pipeline_tag"] == "text-to-image"
    assert '"image"' not in python_blocks(render_card(INFO))[2]


def test_version_description_names_base_objective_reward_steps_scores_and_run():
    text = version_description(INFO, RESULTS, "run123")
    for fact in ("stabilityai/stable-diffusion-3.5-medium@b940f670", "flow_grpo", "ocr 1", "40 steps",
                 "0.62 vs base 0.41 (+0.21, 24 prompts)", "run123"):
        assert fact in text, fact
    assert "not evaluated" in version_description(INFO, None, "run123")
    assert "Held-out reward 0.5 (base not recorded)" in version_description(INFO, {"eval/reward_mean": 0.5}, "r")


@pytest.mark.usefixtures("one_torch_thread")
def test_a_saved_lora_has_the_card_and_its_snippets_load_it(tmp_path, monkeypatch):
    """A trained folder's README is the card, adapter_config names the model, and the card's peft and
    diffusers snippets, run as written, give the same transformer output with the LoRA applied."""
    from diffusionrl.models.families import load_pipeline
    from diffusionrl.train import train

    result = train(tiny_config("train.steps=1"), tmp_path / "run", resume=None)
    folder = tmp_path / "run" / "lora"
    card = (folder / "README.md").read_text()
    assert "More Information Needed" not in card and front_matter(card)["base_model"] == "builtin:tiny-sd3"
    assert f"Training steps: {result.steps_done}" in card and "`jpeg_compressibility` 1" in card
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "builtin:tiny-sd3"
    assert config["target_modules"] == sorted(config["target_modules"])
    info = json.loads((folder / "diffusionrl.json").read_text())
    assert (info["family"], info["pipeline_class"]) == ("sd3", "StableDiffusion3Pipeline")
    write_card(folder, info)  # rewriting is idempotent
    assert (folder / "README.md").read_text() == card

    monkeypatch.chdir(tmp_path)  # the diffusers snippet writes ./lora-diffusers
    gen = torch.Generator().manual_seed(0)
    c = load_pipeline("builtin:tiny-sd3").transformer.config
    x = torch.randn(2, c.in_channels, 4, 4, generator=gen)
    enc = torch.randn(2, 12, c.joint_attention_dim, generator=gen)
    pooled = torch.randn(2, c.pooled_projection_dim, generator=gen)
    t = torch.tensor([300.0, 700.0])

    def velocity(pipe):
        with torch.no_grad():
            return pipe.transformer(hidden_states=x, timestep=t, encoder_hidden_states=enc,
                                    pooled_projections=pooled).sample

    outputs = []
    for block in python_blocks(card)[:2]:  # peft, diffusers (the third needs a registry)
        scope: dict = {}
        exec(block.replace("path/to/this/folder", str(folder)), scope)
        outputs.append(velocity(scope["pipe"]))
    base = velocity(load_pipeline("builtin:tiny-sd3"))
    assert (outputs[0] - base).abs().max().item() > 1e-4  # the LoRA is applied
    assert (outputs[0] - outputs[1]).abs().max().item() <= 1e-6
