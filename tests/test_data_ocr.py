"""Built-in OCR prompt generator: deterministic, held-out test texts, a quoted target in every row."""

from __future__ import annotations

import json

import pytest

from diffusionrl.data.ocr import MAX_TEXT_CHARS, candidate_texts, generate_ocr_prompts, write_ocr_jsonl
from diffusionrl.rewards.ocr import normalize_text, quoted_text, validate_ocr_prompts


def test_deterministic_by_seed():
    assert generate_ocr_prompts(200, seed=3, test_fraction=0.1) == generate_ocr_prompts(200, seed=3, test_fraction=0.1)
    assert generate_ocr_prompts(200, seed=3, test_fraction=0.1) != generate_ocr_prompts(200, seed=4, test_fraction=0.1)


@pytest.mark.parametrize("num,fraction", [(1000, 0.1), (50, 0.2), (10, 0.0), (7000, 0.25)])
def test_sizes_and_disjoint_test_texts(num, fraction):
    train, test = generate_ocr_prompts(num, seed=0, test_fraction=fraction)
    assert len(train) + len(test) == num and len(test) == round(num * fraction)
    train_texts = {normalize_text(r["text"]) for r in train}
    assert not train_texts & {normalize_text(r["text"]) for r in test}
    if num <= len(candidate_texts()) * (1 - fraction):  # texts repeat only once all are used
        assert len(train_texts) == len(train)


def test_every_prompt_quotes_its_short_text():
    train, test = generate_ocr_prompts(3000, seed=1, test_fraction=0.1)
    rows = train + test
    for row in rows:
        assert quoted_text(row["prompt"]) == row["text"]
        assert 1 <= len(row["text"]) <= MAX_TEXT_CHARS and 1 <= len(row["text"].split()) <= 4
        assert all(c.isalnum() or c in " .#%'!&-" for c in row["text"]), row["text"]
    prompts = [r["prompt"] for r in rows]
    assert validate_ocr_prompts(prompts, source="generator") == [r["text"] for r in rows]  # also without metadata
    assert len({p.split('"')[0] for p in prompts}) > 40  # varied scenes


def test_write_jsonl(tmp_path):
    train_path, test_path = write_ocr_jsonl(tmp_path / "ocr", num_prompts=30, seed=0, test_fraction=0.2)
    assert (train_path.name, test_path.name) == ("train.jsonl", "test.jsonl")
    train = [json.loads(line) for line in train_path.read_text().splitlines()]
    test = [json.loads(line) for line in test_path.read_text().splitlines()]
    assert (train, test) == generate_ocr_prompts(30, seed=0, test_fraction=0.2)
    assert set(train[0]) == {"prompt", "text"}
