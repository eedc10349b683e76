"""Prompt sources: validation errors name file and line; the split is deterministic."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffusionrl.config import ConfigError, DataConfig
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


# -- every source gives both splits, non-empty and disjoint; errors are one line naming the file -------------


def _one_line_error(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


def test_a_folder_without_a_test_file_fails_at_load_naming_folder_and_split(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog"}\n')
    with pytest.raises(PromptDataError) as err:
        load_prompts(DataConfig(source=str(tmp_path)))
    assert _one_line_error(err) == (f"{tmp_path}: no test split in this folder; put one of test.txt, test.jsonl, "
                                    "test.parquet beside train.jsonl")


def test_a_test_file_that_only_repeats_training_prompts_is_an_empty_split(tmp_path):
    (tmp_path / "train.txt").write_text("a cat\na dog\n")
    (tmp_path / "test.txt").write_text("a dog\n\na cat\n")
    with pytest.raises(PromptDataError) as err:
        load_prompts(DataConfig(source=str(tmp_path)))
    assert _one_line_error(err) == (f"{tmp_path}/test.txt: the test split is empty: its 3 rows are blank or repeat "
                                    "training prompts (2 duplicates)")


def test_train_and_test_files_of_different_kinds_pair_up_and_two_of_a_split_fail(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "a cat", "k": 1}\n{"prompt": "a dog"}\n')
    (tmp_path / "test.txt").write_text("a bird\na dog\n")
    ps = load_prompts(DataConfig(source=str(tmp_path)))
    assert ps.train == [{"prompt": "a cat", "k": 1}, {"prompt": "a dog"}] and ps.test == [{"prompt": "a bird"}]
    assert ps.stats["duplicate"] == 1
    (tmp_path / "train.txt").write_text("a fish\n")
    with pytest.raises(PromptDataError) as err:
        load_prompts(DataConfig(source=str(tmp_path)))
    assert _one_line_error(err) == f"{tmp_path}: train.jsonl and train.txt are both train splits; keep one"


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_bytes("\ufeffa cat\na dog\na bird\n".encode())
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes('\ufeff{"prompt": "a cat"}\n{"prompt": "a dog"}\n'.encode())
    for path in (txt, jsonl):
        ps = load_prompts(DataConfig(source=str(path), test_fraction=0.4))
        assert "a cat" in {r["prompt"] for r in ps.train + ps.test}, path
        assert not any("\ufeff" in r["prompt"] for r in ps.train + ps.test)


def test_too_few_prompts_say_the_real_reason(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("a cat\n")
    with pytest.raises(PromptDataError) as err:
        load_prompts(DataConfig(source=str(path)))
    assert _one_line_error(err) == (f"{path}: only 1 prompt; at least 2 are needed, one to train on and one held "
                                    "out for evaluation")
    path.write_text("a cat\n\na cat\n")
    with pytest.raises(PromptDataError, match=r"only 1 prompt \(1 blank and 1 duplicate rows dropped\)"):
        load_prompts(DataConfig(source=str(path)))
    path.write_text("")
    with pytest.raises(PromptDataError, match=r"one.txt: no prompts; at least 2"):
        load_prompts(DataConfig(source=str(path)))
    for source in ("builtin:objects", "builtin:ocr"):
        with pytest.raises(ConfigError) as err:
            DataConfig(source=source, num_prompts=0)
        assert _one_line_error(err) == (f"data.num_prompts=0: {source} must make at least 2 prompts, one to train "
                                        "on and one held out for evaluation")


def test_tiny_builtin_sets_keep_a_prompt_on_each_side():
    for source in ("builtin:objects", "builtin:ocr"):
        ps = load_prompts(DataConfig(source=source, num_prompts=2))
        assert len(ps.train) == 1 and len(ps.test) == 1, source


def test_a_missing_path_is_named_as_missing(tmp_path):
    for missing in (tmp_path / "prompts", tmp_path / "prompts.jsonl"):
        with pytest.raises(PromptDataError) as err:
            load_prompts(DataConfig(source=str(missing)))
        assert _one_line_error(err) == f"no such file or folder: {missing}"


def test_a_reward_check_names_the_file_and_line_of_the_row(tmp_path):
    from diffusionrl.config import RewardConfig
    from diffusionrl.rewards import prompt_validator

    validate = prompt_validator(RewardConfig(weights={"ocr": 1.0}))
    path = tmp_path / "ocr.jsonl"
    rows = [{"prompt": f'sign {i} that says "OPEN {i}"'} for i in range(30)]
    rows[17] = {"prompt": "a sign without quotes"}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(PromptDataError) as err:
        load_prompts(DataConfig(source=str(path)), validate=validate)
    assert _one_line_error(err).startswith(f"{path}:18: has no text for the OCR reward: prompt 'a sign without quotes'")
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "train.txt").write_text('a "A"\na "B"\n')
    (tmp_path / "split" / "test.txt").write_text('a "C"\n\nno quotes\n')
    with pytest.raises(PromptDataError, match=r"split/test\.txt:3: has no text for the OCR reward"):
        load_prompts(DataConfig(source=str(tmp_path / "split")), validate=validate)


def test_balanced_sampling_gives_every_category_an_equal_share_and_resumes_exactly():
    """data.balance_by=category on the shapes world (72 color_attr prompts, 3 single): each step's prompts
    spread evenly over the six categories; every category's prompts are all visited before one repeats; the
    choice depends on the step alone; a row without the field is refused naming it."""
    from collections import Counter

    rows = load_prompts(DataConfig(source="builtin:shapes", num_prompts=256, test_fraction=0.2)).train
    per_category = Counter(r["category"] for r in rows)
    assert max(per_category.values()) > 10 * min(per_category.values())
    sampler = PromptSampler(rows, per_step=12, seed=3, balance_by="category")
    counts = Counter(r["category"] for s in range(20) for r in sampler.batch(s)[0])
    assert set(counts.values()) == {40} and len(counts) == 6
    assert sampler.batch(7) == PromptSampler(rows, per_step=12, seed=3, balance_by="category").batch(7)
    color_attr = [r["prompt"] for s in range(40) for r in sampler.batch(s)[0] if r["category"] == "color_attr"]
    n = per_category["color_attr"]
    assert sorted(color_attr[:n]) == sorted(r["prompt"] for r in rows if r["category"] == "color_attr")
    uniform = Counter(r["category"] for s in range(20) for r in PromptSampler(rows, 12, seed=3).batch(s)[0])
    assert uniform["color_attr"] > 3 * uniform["single"]  # the default draws rows, not categories
    with pytest.raises(PromptDataError, match="balance_by='category': 1 of 2 training rows have no 'category'"):
        PromptSampler([{"prompt": "a", "category": "x"}, {"prompt": "b"}], 2, 0, balance_by="category")


def test_every_bad_row_of_a_file_is_reported_in_one_error(tmp_path):
    """The readers stopped at the first bad line: a user needed one run per bad line. Now one error lists a file's
    bad rows (the first 20, then how many more), each naming its line; json's "... character at" reads once."""
    from diffusionrl.config import RewardConfig
    from diffusionrl.rewards import prompt_validator

    path = tmp_path / "p.jsonl"
    lines = ['{"prompt": "ok 0"}', '{"prompt": "a cat', '{"text": "no prompt"}', '{"prompt": 3}', '{"prompt": "ok 1"}']
    path.write_text("\n".join(lines + ["{oops}"] * 20) + "\n")
    with pytest.raises(PromptDataError) as err:
        load_prompts(DataConfig(source=str(path)))
    message = _one_line_error(err)
    assert message.startswith(
        f"{path}: 23 bad rows, fix them all: {path}:2: invalid JSON (Invalid control character at column 18); "
        f"{path}:3: missing the 'prompt' field (keys: ['text']); {path}:4: 'prompt' must be a string, got int; "
        f"{path}:6: invalid JSON (Expecting property name enclosed in double quotes at column 2); ")
    assert message.endswith(f"{path}:22: invalid JSON (Expecting property name enclosed in double quotes at column "
                            "2); and 3 more") and "at at" not in message
    text = tmp_path / "p.txt"
    text.write_bytes(b"a cat\n\xff bad\na dog\nalso \xfe bad\n")
    with pytest.raises(PromptDataError, match=rf"^{text}: 2 bad rows, fix them all: {text}:2: not valid UTF-8 "
                                              rf"\(invalid start byte\); {text}:4: not valid UTF-8"):
        load_prompts(DataConfig(source=str(text)))
    images = tmp_path / "e.jsonl"  # rows whose image is missing, all of them
    images.write_text("".join(json.dumps({"prompt": f"edit {i}", "image": f"imgs/{i}.png"}) + "\n" for i in range(3)))
    with pytest.raises(PromptDataError, match=rf"^{images}: 3 bad rows, fix them all: {images}:1: cannot read the "
                                              r"image .*; .*e.jsonl:2: cannot read .*; .*e.jsonl:3: cannot read"):
        load_prompts(DataConfig(source=str(images)))
    ocr = tmp_path / "ocr.txt"
    ocr.write_text('a "A"\nno quotes\na "B"\nnone here\nnor here\n')
    with pytest.raises(PromptDataError, match=rf"^{ocr}:2: has no text for the OCR reward: .*\(3 of 5 rows of {ocr} "
                                              rf"are like this: {ocr}:2, {ocr}:4, {ocr}:5\)"):
        load_prompts(DataConfig(source=str(ocr)), validate=prompt_validator(RewardConfig(weights={"ocr": 1.0})))
    shapes = tmp_path / "shapes.jsonl"
    shapes.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(3)))
    with pytest.raises(PromptDataError, match=rf"^{shapes}: 3 rows are not what the geneval_mini reward needs .*: "
                                              rf"{shapes}:1: no shapes-world 'spec' .*; {shapes}:3: no shapes"):
        load_prompts(DataConfig(source=str(shapes)),
                     validate=prompt_validator(RewardConfig(weights={"geneval_mini": 1.0})))
