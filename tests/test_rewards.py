"""Reward registry, JPEG rewards, the mixture and failure counting."""

import io

import numpy as np
from PIL import Image

from diffusionrl.config import RewardConfig
from diffusionrl.rewards import MixtureReward, RewardResult, build_reward, reward_metrics, safe_score


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
    np.testing.assert_allclose(total, 2.0 * parts["jpeg_compressibility"].scores + 0.5 * parts["jpeg_incompressibility"].scores, rtol=1e-6)
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
