"""PickScore reward with a tiny CLIP built in code (no download)."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from diffusionrl.config import RewardConfig  # noqa: E402
from diffusionrl.models.tiny import build_tokenizers  # noqa: E402
from diffusionrl.rewards import build_reward  # noqa: E402
from diffusionrl.rewards.pickscore import SCALE_DIVISOR, PickScoreReward  # noqa: E402


def tiny_clip():
    """A 2-layer CLIP (32-d, 32 px images) with the tiny SD3's in-code CLIP tokenizer."""
    from transformers import CLIPConfig, CLIPModel, CLIPProcessor

    try:  # transformers 5 names the torchvision-free image processor *Pil
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor

    tokenizer, _ = build_tokenizers()
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        ),
        vision_config=dict(
            image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2,
        ),
        projection_dim=16,
    )
    torch.manual_seed(0)
    model = CLIPModel(config)
    processor = CLIPProcessor(
        image_processor=ImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer,
    )
    return model, processor


@pytest.fixture(scope="module")
def reward():
    model, processor = tiny_clip()
    return PickScoreReward(model, processor, device="cpu", batch_size=2)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(3, 48, 48, 3), dtype=np.uint8)
    prompts = ["a red cat", 'a sign that says "OPEN"', "a blue bird on a tree"]
    return images, prompts, [{}] * 3


def test_scores_shape_finite_deterministic(reward, batch):
    first = reward(*batch)
    second = reward(*batch)
    assert first.scores.shape == (3,) and first.scores.dtype == np.float32
    assert np.all(np.isfinite(first.scores)) and first.failures == 0
    np.testing.assert_array_equal(first.scores, second.scores)


def test_matches_formula_by_hand(reward, batch):
    images, prompts, _ = batch
    model, processor = reward.model, reward.processor
    with torch.no_grad():
        pixels = processor(images=list(images), return_tensors="pt")["pixel_values"]
        text = processor(text=prompts, padding=True, return_tensors="pt")
        out = model(input_ids=text["input_ids"], attention_mask=text["attention_mask"], pixel_values=pixels)
        t = out.text_embeds / out.text_embeds.norm(dim=-1, keepdim=True)
        i = out.image_embeds / out.image_embeds.norm(dim=-1, keepdim=True)
        expected = model.logit_scale.exp() * (t * i).sum(-1) / SCALE_DIVISOR
    np.testing.assert_allclose(reward(*batch).scores, expected.numpy(), rtol=1e-5, atol=1e-6)


def test_each_pair_scored_on_its_own(reward, batch):
    # A pair's score does not depend on the rest of the batch; re-pairing changes the scores.
    images, prompts, meta = batch
    full = reward(images, prompts, meta).scores
    single = np.array([reward(images[k : k + 1], prompts[k : k + 1], meta[:1]).scores[0] for k in range(3)])
    np.testing.assert_allclose(full, single, rtol=1e-5, atol=1e-6)
    swapped = reward(images, prompts[::-1], meta).scores
    assert swapped[1] == pytest.approx(full[1]) and not np.allclose(swapped[[0, 2]], full[[0, 2]])


def test_corrupt_image_scores_zero_and_counts(reward, batch):
    images, prompts, meta = batch
    mixed = [images[0], np.zeros((3,), np.uint8), images[2]]
    result = reward(mixed, prompts, meta)
    assert result.failures == 1 and result.scores[1] == 0.0
    np.testing.assert_allclose(result.scores[[0, 2]], reward(images, prompts, meta).scores[[0, 2]], rtol=1e-5)


def test_registered_loader_fails_clearly_offline(tmp_path):
    cfg = RewardConfig(weights={"pickscore": 1.0}, pickscore_processor=str(tmp_path / "nope"),
                       pickscore_model=str(tmp_path / "nope"))
    with pytest.raises(OSError, match="pickscore_model"):
        build_reward("pickscore", cfg)


def test_loads_from_saved_folders(tmp_path, batch):
    model, processor = tiny_clip()
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "processor")
    cfg = RewardConfig(weights={"pickscore": 1.0}, pickscore_processor=str(tmp_path / "processor"),
                       pickscore_model=str(tmp_path / "model"))
    loaded = build_reward("pickscore", cfg)
    np.testing.assert_allclose(loaded(*batch).scores, PickScoreReward(model, processor, device="cpu")(*batch).scores,
                               rtol=1e-5, atol=1e-6)
