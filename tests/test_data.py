"""Prompt sources: validation errors name file and line; the split is deterministic."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffusionrl.config import DataConfig
from diffusionrl.data import PromptDataError, PromptSampler, load_prompts, split_rows


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a cat"}\n{"prompt": "a dog"}\n{"prompt": oops}\n')
    with pytest.raises(PromptDataError, match=r"p.jsonl:3: invalid JSON"):
        load_prompts(DataConfig(source=str(path)))
    path.write_text('{"prompt": "a cat"}\n{"text": "no prompt"}\n')
    with pytest.raises(PromptDataError, match=r"p.jsonl:2: missing the 'prompt' field"):
        load_prompts(DataConfig(source=str(path)))
    path.write_text('{"prompt": 3}\n')
    with pytest.raises(PromptDataError, match=r"p.jsonl:1: 'prompt' must be a string"):
        load_prompts(DataConfig(source=str(path)))


def test_blank_and_duplicate_prompts_are_counted(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a cat\n\n  \na dog\na cat\na bird\na fish\n")
    ps = load_prompts(DataConfig(source=str(path), test_fraction=0.3))
    assert ps.stats["blank"] == 2 and ps.stats["duplicate"] == 1
    assert sorted(r["prompt"] for r in ps.train + ps.test) == ["a bird", "a cat", "a dog", "a fish"]


def test_folder_layout_keeps_its_split_and_parquet_is_read(tmp_path):
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps({"prompt": f"p{i}", "k": i}) for i in range(5)) + "\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "held out"}) + "\n")
    ps = load_prompts(DataConfig(source=str(tmp_path)))
    assert len(ps.train) == 5 and ps.test == [{"prompt": "held out"}] and ps.train[0]["k"] == 0
    pq.write_table(pa.table({"prompt": ["x", "y", None]}), tmp_path / "p.parquet")
    ps = load_prompts(DataConfig(source=str(tmp_path / "p.parquet"), test_fraction=0.5))
    assert ps.stats["blank"] == 1 and len(ps.train) + len(ps.test) == 2


def test_split_is_deterministic_and_order_independent():
    rows = [{"prompt": f"prompt {i}"} for i in range(200)]
    train, test = split_rows(rows, 0.1, seed=0)
    train2, test2 = split_rows(rows[::-1], 0.1, seed=0)
    assert {r["prompt"] for r in test} == {r["prompt"] for r in test2} and 5 < len(test) < 40
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


def test_builtin_generator_and_sampler_are_deterministic():
    a = load_prompts(DataConfig(num_prompts=64))
    assert a.digest == load_prompts(DataConfig(num_prompts=64)).digest
    sampler = PromptSampler(a.train, per_step=5, seed=1)
    assert sampler.batch(3) == PromptSampler(a.train, per_step=5, seed=1).batch(3)
    epoch = [r["prompt"] for s in range(len(a.train)) for r in sampler.batch(s)[0]][: len(a.train)]
    assert sorted(epoch) == sorted(r["prompt"] for r in a.train)  # one epoch covers every prompt once


def test_fingerprint_follows_content_not_path(tmp_path):
    """The prepared-prompt cache keys on this: an edited file gets a new key, an unchanged one not."""
    from diffusionrl.data import source_fingerprint

    f = tmp_path / "prompts.txt"
    f.write_text("a cat\na dog\n")
    first = source_fingerprint(str(f))
    assert source_fingerprint(str(f)) == first
    f.write_text("a cat\na bird\n")
    assert source_fingerprint(str(f)) != first
    folder = tmp_path / "split"
    folder.mkdir()
    (folder / "train.txt").write_text("a\n")
    (folder / "test.txt").write_text("b\n")
    before = source_fingerprint(str(folder))
    (folder / "test.txt").write_text("c\n")
    assert source_fingerprint(str(folder)) != before
    assert source_fingerprint(str(tmp_path / "missing.txt")).startswith("missing-")
    assert source_fingerprint("builtin:objects") == source_fingerprint("builtin:objects")


def test_fingerprint_of_an_object_store_prefix_follows_its_objects():
    import fsspec

    from diffusionrl.data import source_fingerprint

    fs = fsspec.filesystem("memory")
    fs.pipe("/prompts/latest/train.txt", b"a\n")
    first = source_fingerprint("memory://prompts/latest/")
    fs.pipe("/prompts/latest/train.txt", b"a longer prompt\n")
    assert source_fingerprint("memory://prompts/latest/") != first
