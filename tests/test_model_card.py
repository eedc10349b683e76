"""The model card of a LoRA folder (``serving.model_card``): a real card, not peft's empty template,
whose loading snippets load the folder that is actually written."""

from __future__ import annotations

import json
import re

import pytest
import torch

from diffusionrl.errors import UserError
from diffusionrl.models.families import UnknownModelFamily
from diffusionrl.serving.model_card import editing_family, render_card, version_description, write_card

from .conftest import tiny_config

INFO = {
    "base_model": "stabilityai/stable-diffusion-3.5-medium", "base_model_revision": "b940f670",
    "base_model_digest": "ab" * 32, "step": 40, "algorithm": "flow_grpo", "config_digest": "0123456789abcdef",
    "family": "sd3", "pipeline_class": "StableDiffusion3Pipeline", "reward": {"ocr": 1.0},
    "registered_model": "sd35m-ocr", "max_sequence_length": 128,
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
    peft, diffusers, sample, served = python_blocks(card)
    assert 'StableDiffusion3Pipeline.from_pretrained("stabilityai/stable-diffusion-3.5-medium", revision="b940f670")' \
        in peft and "PeftModel.from_pretrained(pipe.transformer," in peft
    assert "diffusers_adapter_dir(" in diffusers and "pipe.load_lora_weights(" in diffusers
    # the run's text length, not the SD3 pipeline's default 256
    assert sample.strip() == 'image = pipe("a photo of a cat", max_sequence_length=128).images[0]'
    assert "not the pipeline's default, 256" in card
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


def test_every_familys_sampling_call_takes_the_runs_text_length():
    """Each family's stock pipeline call takes max_sequence_length (checked against its signature), so each card's
    sampling call passes the run's; a pipeline whose call takes none (SD1.5's) gets none."""
    import inspect

    import diffusers

    from diffusionrl.models.families import ADAPTERS
    from diffusionrl.serving.model_card import pipeline_seq_len

    for adapter in ADAPTERS:
        call = inspect.signature(getattr(diffusers, adapter.pipeline_class).__call__).parameters
        assert "max_sequence_length" in call, adapter.pipeline_class
        assert pipeline_seq_len(adapter.pipeline_class) == call["max_sequence_length"].default
        card = render_card({**INFO, "family": adapter.family, "pipeline_class": adapter.pipeline_class})
        (sample,) = [b for b in python_blocks(card) if " = pipe(" in b]
        assert "max_sequence_length=128)" in sample, (adapter.family, sample)
        assert ("image=load_image(" in sample) == adapter.editing and (".frames[0]" in sample) == adapter.video
    assert pipeline_seq_len("StableDiffusionPipeline") is None and pipeline_seq_len("NoSuchPipeline") is None
    card = render_card({**INFO, "pipeline_class": "StableDiffusionPipeline"})  # its call takes no text length
    assert python_blocks(card)[2].strip() == 'image = pipe("a photo of a cat").images[0]'


def test_an_editing_models_card_serves_an_instruction_with_its_image():
    for family, pipeline in (("flux-kontext", "FluxKontextPipeline"), ("qwen-image-edit", "QwenImageEditPlusPipeline"),
                             ("qwen-image-edit-v1", "QwenImageEditPipeline")):
        card = render_card({**INFO, "family": family, "pipeline_class": pipeline}, layout="diffusers")
        assert front_matter(card)["pipeline_tag"] == "image-to-image"
        served = python_blocks(card)[-1]
        assert 'Path("input.png").read_bytes()' in served and '"image": [image]' in served
        # the stock pipeline's fixed 1024^2 input area, and how the registered model serves the trained one
        assert ("VAE_IMAGE_SIZE" in card) == (family == "qwen-image-edit")
        assert ("calculate_dimensions(1024 * 1024" in card) == (family == "qwen-image-edit-v1")
        assert ("area_bound_call" in card) == family.startswith("qwen-image-edit")
    assert front_matter(render_card(INFO))["pipeline_tag"] == "text-to-image"
    with pytest.raises(UnknownModelFamily, match=r"^unknown model family 'sd15'; the families are \["):
        editing_family("sd15")
    assert '"image"' not in python_blocks(render_card(INFO))[-1]


def test_version_description_names_base_objective_reward_steps_scores_and_run():
    text = version_description(INFO, RESULTS, "run123")
    for fact in ("stabilityai/stable-diffusion-3.5-medium@b940f670", "flow_grpo", "ocr 1", "40 steps",
                 "0.62 vs base 0.41 (+0.21, 24 prompts)", "run123"):
        assert fact in text, fact
    assert "not evaluated" in version_description(INFO, None, "run123")
    assert "Held-out reward 0.5 (base not recorded)" in version_description(INFO, {"eval/reward_mean": 0.5}, "r")


def test_registering_needs_every_fact_the_trainer_records_beside_the_lora(tmp_path):
    """``registry.lora_info`` reads ``diffusionrl.json`` as the trainer writes it: a folder without it, or
    without one of its keys, is refused in one line naming the file and what to register instead."""
    from diffusionrl.serving.registry import lora_info

    path = tmp_path / "diffusionrl.json"
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}: no such file; register a LoRA folder this "
                                        r"version's trainer saved \(a run's <out>/lora\)"):
        lora_info(tmp_path)
    path.write_text(json.dumps({k: v for k, v in INFO.items() if k not in ("family", "max_sequence_length")}))
    with pytest.raises(UserError, match=f"^{re.escape(str(path))} records no family, max_sequence_length; register"):
        lora_info(tmp_path)
    path.write_text(json.dumps(INFO))
    assert lora_info(tmp_path) == INFO


@pytest.mark.usefixtures("one_torch_thread")
def test_a_saved_lora_has_the_card_and_its_snippets_load_it(tmp_path, monkeypatch):
    """A trained folder's README is the card, adapter_config names the model, and the card's peft and
    diffusers snippets, run as written, give the same transformer output with the LoRA applied. The run
    evaluates at the stock SD3 pipeline's defaults (28 steps, guidance 7, 64 px), so the card's sampling call,
    run as written and seeded as the evaluation seeds its sample, draws the evaluation's tuned image pixel for
    pixel: the prompt's T5 tokens at the run's model.max_sequence_length (32); at the pipeline's 256 it is off."""
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.models.families import load_pipeline
    from diffusionrl.train import train

    from .family_checks import served_vs_evaluated

    cfg = tiny_config("train.steps=1", "eval.every=0", "eval.num_steps=28", "eval.guidance_scale=7.0",
                      "sampling.eval_resolution=64")
    result = train(cfg, tmp_path / "run", resume=None)
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

    outputs, pipes = [], []
    for block in python_blocks(card)[:2]:  # peft, diffusers (then the sampling call; the last needs a registry)
        scope: dict = {}
        exec(block.replace("path/to/this/folder", str(folder)), scope)
        outputs.append(velocity(scope["pipe"]))
        pipes.append(scope["pipe"])
    base = velocity(load_pipeline("builtin:tiny-sd3"))
    assert (outputs[0] - base).abs().max().item() > 1e-4  # the LoRA is applied
    assert (outputs[0] - outputs[1]).abs().max().item() <= 1e-6

    sample = python_blocks(card)[2]
    assert f"max_sequence_length={cfg.model.max_sequence_length})" in sample and cfg.model.max_sequence_length == 32
    ev = evaluate_lora(cfg, [{"prompt": "a photo of a cat"}], folder)  # the card's prompt

    def sampled(block: str) -> bytes:
        import io

        scope = {"pipe": pipes[1]}
        torch.manual_seed(cfg.eval.seed)  # the pipeline draws its initial noise from it, as the evaluation's sample
        exec(block, scope)
        buffer = io.BytesIO()
        scope["image"].save(buffer, format="PNG")
        return buffer.getvalue()

    diff, lora_effect = served_vs_evaluated(sampled(sample), ev, "sd3 card snippet")
    assert diff == 0 and lora_effect > 0
    stock, _ = served_vs_evaluated(sampled(sample.replace(", max_sequence_length=32", "")), ev, "sd3 at 256 tokens")
    assert stock > 0  # the text length matters
