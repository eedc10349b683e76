"""Reward registry, JPEG rewards, the mixture and failure counting."""

import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from diffusionrl.config import RewardConfig
from diffusionrl.rewards import (
    MixtureReward,
    Reward,
    RewardResult,
    build_reward,
    prompt_validator,
    register_reward,
    reward_metrics,
    safe_score,
)
from diffusionrl.rewards.base import _REGISTRY


def _images():
    flat = np.full((1, 64, 64, 3), 128, dtype=np.uint8)
    noisy = np.random.default_rng(0).integers(0, 256, size=(1, 64, 64, 3), dtype=np.uint8)
    return np.concatenate([flat, noisy])


def test_jpeg_compressibility_is_minus_size_in_kb_over_500():
    images = _images()
    result = build_reward("jpeg_compressibility", RewardConfig())(images, ["a", "b"], [{}, {}])
    buf = io.BytesIO()
    Image.fromarray(images[1]).save(buf, format="JPEG", quality=95)
    assert np.isclose(result.scores[1], -buf.tell() / 1000 / 500)
    assert result.scores[0] > result.scores[1]  # a flat image compresses better
    inc = build_reward("jpeg_incompressibility", RewardConfig())(images, ["a", "b"], [{}, {}])
    np.testing.assert_allclose(inc.scores, -result.scores)


def test_mixture_is_the_weighted_sum_and_reports_components():
    cfg = RewardConfig(weights={"jpeg_compressibility": 2.0, "jpeg_incompressibility": 0.5})
    total, parts = MixtureReward(cfg.weights, cfg)(_images(), ["a", "b"], [{}, {}])
    np.testing.assert_allclose(
        total, 2.0 * parts["jpeg_compressibility"].scores + 0.5 * parts["jpeg_incompressibility"].scores, rtol=1e-6
    )
    metrics = reward_metrics(total, parts)
    assert {"rollout/reward/raw_mean", "rollout/reward/raw_std", "rollout/reward/raw_median",
            "rollout/reward/num_samples", "rollout/reward/jpeg_compressibility_mean"} <= set(metrics)


def test_a_failing_sample_scores_zero_and_is_counted():
    def score(image, prompt, meta):
        if prompt == "bad":
            raise RuntimeError("boom")
        return 1.0

    result = safe_score(score, _images(), ["ok", "bad"], [{}, {}], "test")
    assert isinstance(result, RewardResult) and result.failures == 1
    assert result.scores.tolist() == [1.0, 0.0]
    corrupt = build_reward("jpeg_compressibility", RewardConfig())([np.zeros((3,), np.uint8)], ["x"], [{}])
    assert corrupt.failures == 1 and corrupt.scores.tolist() == [0.0]


def test_prompt_validator_runs_each_configured_rewards_own_check():
    assert prompt_validator(RewardConfig(weights={"jpeg_compressibility": 1.0})) is None  # no reward checks prompts
    seen = []

    @register_reward("test_needs_x")
    class NeedsX(Reward):
        name = "test_needs_x"

        @classmethod
        def validate_prompts(cls, prompts, metadata=None, source="prompts", locations=None):
            seen.append((list(prompts), list(metadata), source))
            if any("x" not in p for p in prompts):
                raise ValueError(f"{source}: a prompt without x")

    try:
        validate = prompt_validator(RewardConfig(weights={"jpeg_compressibility": 1.0, "test_needs_x": 1.0}))
        rows = [{"prompt": "x1", "k": 1}, {"prompt": "x2"}]
        validate(rows, "f.jsonl (train)")
        assert seen == [(["x1", "x2"], rows, "f.jsonl (train)")]
        with pytest.raises(ValueError, match=r"^f\.jsonl \(test\): a prompt without x$"):
            validate([{"prompt": "y"}], "f.jsonl (test)")
        ocr_first = prompt_validator(RewardConfig(weights={"ocr": 1.0, "test_needs_x": 1.0}))
        with pytest.raises(ValueError, match=r"^g: row 0 has no text for the OCR reward"):
            ocr_first([{"prompt": "y"}], "g")
    finally:
        del _REGISTRY["test_needs_x"]


def test_a_prompt_check_gets_the_rows_locations_and_one_without_them_is_refused_at_registration():
    seen = []

    @register_reward("test_located")
    class Located(Reward):
        @classmethod
        def validate_prompts(cls, prompts, metadata=None, source="prompts", locations=None):
            seen.append(locations)

    try:
        validate = prompt_validator(RewardConfig(weights={"test_located": 1.0}))
        validate([{"prompt": "a"}], "f.jsonl", locations=["f.jsonl:3"])
        validate([{"prompt": "a"}], "builtin:x")
        assert seen == [["f.jsonl:3"], None]
    finally:
        del _REGISTRY["test_located"]
    with pytest.raises(TypeError, match=r"^reward 'test_unlocated': Unlocated.validate_prompts takes no locations; "
                                        r"give it Reward.validate_prompts's parameters"):
        @register_reward("test_unlocated")
        class Unlocated(Reward):
            @classmethod
            def validate_prompts(cls, prompts, metadata=None, source="prompts"):
                pass
    assert "test_unlocated" not in _REGISTRY


def test_rewards_import_and_prompt_validator_without_torch():
    code = (
        "import sys; from diffusionrl.config import RewardConfig; from diffusionrl.rewards import prompt_validator; "
        "prompt_validator(RewardConfig(weights={'ocr': 1.0, 'pickscore': 1.0}))([{'prompt': 'a \"A\"'}], 'x'); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
