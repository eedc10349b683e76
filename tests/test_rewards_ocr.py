"""OCR reward on text rendered with Pillow, read by the real RapidOCR models shipped in its wheel."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

from diffusionrl.config import RewardConfig
from diffusionrl.rewards import build_reward, reward_metrics
from diffusionrl.rewards.ocr import (
    OcrReward,
    PaddleOcrBackend,
    RapidOcrBackend,
    make_ocr_backend,
    ocr_score,
    ocr_target,
    render_text_image,
    validate_ocr_prompts,
)


@pytest.fixture(scope="module")
def reward() -> OcrReward:
    return OcrReward(RapidOcrBackend(threads=1))


def score(reward, images, prompts, metadata=None):
    return reward(np.stack(images) if not isinstance(images, list) else images, prompts,
                  metadata or [{}] * len(prompts))


# ----------------------------------------------------------------------------- the formula, no OCR


def test_formula_by_hand():
    assert ocr_score("HELLO", "hello") == 1.0
    assert ocr_score("HELLQ", "hello") == pytest.approx(1 - 1 / 5)
    assert ocr_score("", "hello") == 0.0
    assert ocr_score("completely different text", "hi") == 0.0  # distance capped at len(target)
    assert ocr_score("xx Hello World yy", "hello world") == 1.0  # substring, spaces ignored
    assert ocr_score("H e l l o", "HELLO") == 1.0


def test_targets_and_validation():
    assert ocr_target('a sign that says "Open Late" and "other"') == "Open Late"
    assert ocr_target("a sign \u201cCaf\u00e9\u201d") == "Caf\u00e9"
    assert ocr_target("no quote here", {"text": "META"}) == "META"
    assert validate_ocr_prompts(['a "A"', 'b "B"'], source="x.jsonl") == ["A", "B"]
    with pytest.raises(ValueError, match=r"x\.jsonl: row 1 .*'a sign without quotes'"):
        validate_ocr_prompts(['a "A"', "a sign without quotes", 'c ""'], source="x.jsonl")


# ----------------------------------------------------------------------------- real OCR on renders


def test_rendered_text_scores_as_the_formula_says(reward):
    images = [
        render_text_image("OPEN LATE"),  # exact (case differs from the prompt)
        render_text_image("COFFEE"),  # one character wrong w.r.t. "COFFEF"
        render_text_image(""),  # no text at all
        render_text_image("BIG SALE TODAY"),  # target inside longer text
        render_text_image("Hello World"),  # spaces removed on both sides
        render_text_image("Gate 42", font_size=40, y=60, color=(250, 250, 250), background=(20, 40, 90)),
    ]
    prompts = [
        'a neon sign that says "open late"',
        'a mug that says "COFFEF"',
        'a blank wall with "NOTHING"',
        'a banner that says "SALE"',
        'a card reading "hel loworld"',
        'an airport sign "GATE 42"',
    ]
    result = score(reward, np.stack(images), prompts)
    np.testing.assert_allclose(result.scores, [1.0, 1 - 1 / 6, 0.0, 1.0, 1.0, 1.0], atol=1e-6)
    assert result.failures == 0
    assert result.info["exact"] == pytest.approx(4 / 6)


def test_metadata_text_overrides_prompt(reward):
    result = score(reward, np.stack([render_text_image("ZEBRA")]), ["a sign"], [{"text": "zebra"}])
    assert result.scores[0] == 1.0


def test_corrupt_image_scores_zero_and_counts(reward):
    good = render_text_image("TAXI")
    images = [good, np.zeros((8, 8), np.float32), good[..., :2], good]
    prompts = ['a sign "TAXI"'] * 4
    result = reward(images, prompts, [{}] * 4)
    np.testing.assert_allclose(result.scores, [1.0, 0.0, 0.0, 1.0])
    assert result.failures == 2
    assert reward_metrics(result.scores, {"ocr": result})["rollout/reward/ocr_failures"] == 2.0


def test_backend_exception_is_a_failure_not_an_error(reward):
    class Exploding:
        def read_text(self, images):
            return [RuntimeError("onnx boom")] + [["OK"] for _ in images[1:]]

    result = OcrReward(Exploding())(np.stack([render_text_image("OK")] * 2), ['"OK"', '"OK"'], [{}, {}])
    np.testing.assert_allclose(result.scores, [0.0, 1.0])
    assert result.failures == 1


def test_prompt_without_quotes_raises_in_reward(reward):
    with pytest.raises(ValueError, match="row 1"):
        reward(np.stack([render_text_image("A")] * 2), ['"A"', "no target"], [{}, {}])


def test_registered_and_paddle_errors_are_clear(tmp_path):
    cfg = RewardConfig(weights={"ocr": 1.0})
    assert isinstance(build_reward("ocr", cfg), OcrReward)
    with pytest.raises(ValueError, match="ocr_model_dir"):
        PaddleOcrBackend("")
    (tmp_path / "det").mkdir()
    with pytest.raises(FileNotFoundError, match=r"det.*rec|rec"):
        make_ocr_backend(RewardConfig(weights={"ocr": 1.0}, ocr_backend="paddleocr", ocr_model_dir=str(tmp_path)))


def test_the_pools_thread_cap_reaches_ocr_built_from_a_config(monkeypatch):
    """reward.ocr_threads=0 (the default) takes the actor's cap; an explicit count wins."""
    from diffusionrl.config import RewardConfig
    from diffusionrl.rewards.base import THREADS_ENV, set_reward_threads
    from diffusionrl.rewards.ocr import make_ocr_backend

    monkeypatch.setenv(THREADS_ENV, "0")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    set_reward_threads(1)  # what the pool does in each actor before building its rewards
    assert make_ocr_backend(RewardConfig(weights={"ocr": 1.0})).threads == 1
    assert make_ocr_backend(RewardConfig(weights={"ocr": 1.0}, ocr_threads=2)).threads == 2
