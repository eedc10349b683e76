"""Prompt rows that carry an input image (editing datasets): paths relative to the dataset file, URIs,
bytes; a missing or malformed image names its file and line; rows stay JSON and trace to their image."""

import hashlib
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffusionrl.config import DataConfig
from diffusionrl.data import PromptDataError, load_prompts
from diffusionrl.data.images import decode_image, image_bytes, row_images


def png(color, size=(16, 12)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def write_images(folder):
    (folder / "imgs").mkdir()
    for i in range(4):
        (folder / "imgs" / f"{i}.png").write_bytes(png((60 * i, 10, 200)))


def test_relative_paths_resolve_against_the_dataset_file_and_rows_trace_to_their_image(tmp_path):
    write_images(tmp_path)
    rows = [{"prompt": f"make it {i}", "image": f"imgs/{i}.png", "category": "color"} for i in range(4)]
    (tmp_path / "edits.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ps = load_prompts(DataConfig(source=str(tmp_path / "edits.jsonl"), test_fraction=0.25))
    out = {r["prompt"]: r for r in ps.train + ps.test}
    for i in range(4):
        row = out[f"make it {i}"]
        data = (tmp_path / "imgs" / f"{i}.png").read_bytes()
        assert row["image"].startswith("data:image/png;base64,") and image_bytes(row["image"]) == data
        assert row["image_sha256"] == hashlib.sha256(data).hexdigest()
        assert row["image_uri"] == str(tmp_path / "imgs" / f"{i}.png") and row["category"] == "color"
        assert decode_image(row["image"]).shape == (12, 16, 3)
        assert tuple(decode_image(row["image"])[0, 0]) == (60 * i, 10, 200)
    json.dumps(ps.train)  # rows stay JSON (prompt caches, digests, metadata_json)
    again = load_prompts(DataConfig(source=str(tmp_path / "edits.jsonl"), test_fraction=0.25))
    assert again.digest == ps.digest


def test_a_missing_or_malformed_image_names_file_and_line(tmp_path):
    write_images(tmp_path)
    path = tmp_path / "edits.jsonl"
    path.write_text(json.dumps({"prompt": "a", "image": "imgs/0.png"}) + "\n"
                    + json.dumps({"prompt": "b", "image": "imgs/nope.png"}) + "\n")
    with pytest.raises(PromptDataError, match=r"edits.jsonl:2: cannot read the image .*nope.png.*no such file"):
        load_prompts(DataConfig(source=str(path)))
    (tmp_path / "imgs" / "bad.png").write_bytes(png((1, 2, 3))[:40])  # truncated
    path.write_text(json.dumps({"prompt": "a", "image": "imgs/0.png"}) + "\n"
                    + json.dumps({"prompt": "b", "image": "imgs/bad.png"}) + "\n")
    with pytest.raises(PromptDataError, match=r"edits.jsonl:2: the 'image' is not a readable image"):
        load_prompts(DataConfig(source=str(path)))
    path.write_text(json.dumps({"prompt": "a", "image": 7}) + "\n")
    with pytest.raises(PromptDataError, match=r"edits.jsonl:1: 'image' must be a path, a URI or the image's bytes"):
        load_prompts(DataConfig(source=str(path)))


def test_parquet_bytes_and_a_folder_layout_with_uris(tmp_path):
    images = [png((i * 40, 0, 0)) for i in range(4)]
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(4)], "image": images}), tmp_path / "e.parquet")
    ps = load_prompts(DataConfig(source=str(tmp_path / "e.parquet"), test_fraction=0.25))
    for row in ps.train + ps.test:
        i = int(row["prompt"][1:])
        assert image_bytes(row["image"]) == images[i] and "image_uri" not in row
    pq.write_table(pa.table({"prompt": ["p0", "p1"], "image": [images[0], b"not an image"]}), tmp_path / "e.parquet")
    with pytest.raises(PromptDataError, match=r"e.parquet: row 2: the 'image' is not a readable image"):
        load_prompts(DataConfig(source=str(tmp_path / "e.parquet")))
    # a folder in the train/test layout; a file:// URI inside the folder works as well as a relative path
    data = tmp_path / "set"
    data.mkdir()
    write_images(data)
    (data / "train.jsonl").write_text("\n".join(json.dumps({"prompt": f"t{i}", "image": f"imgs/{i}.png"})
                                                for i in range(3)) + "\n")
    (data / "test.jsonl").write_text(json.dumps({"prompt": "h", "image": (data / "imgs" / "3.png").as_uri()}) + "\n")
    ps = load_prompts(DataConfig(source=str(data)))
    assert ps.test[0]["image_uri"] == str((data / "imgs" / "3.png").resolve())  # the file it resolved to
    assert image_bytes(ps.test[0]["image"]) == (data / "imgs" / "3.png").read_bytes()
    assert [image_bytes(r["image"]) for r in ps.train] == [(data / "imgs" / f"{i}.png").read_bytes() for i in range(3)]


def test_row_images_of_a_batch():
    from diffusionrl.data.images import resolve_row_image

    rows = [resolve_row_image({"prompt": "x", "image": png((9, 8, 7))}, "gen row 1")] * 2
    images = row_images([{k: v for k, v in r.items() if k != "prompt"} for r in rows])
    assert len(images) == 2 and images[0].dtype == np.uint8 and tuple(images[0][0, 0]) == (9, 8, 7)
    assert row_images([{}, {"category": "x"}]) is None and row_images(None) is None
    with pytest.raises(PromptDataError, match="1 of 2 rows in a batch carry no 'image'"):
        row_images([rows[0], {}])


def test_one_instruction_on_several_images_is_several_rows_and_a_repeat_is_a_duplicate(tmp_path):
    write_images(tmp_path)
    rows = [{"prompt": "make it green", "image": f"imgs/{i}.png"} for i in range(4)]
    rows.append({"prompt": "make it green", "image": "imgs/0.png"})  # the same edit of the same image again
    (tmp_path / "e.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ps = load_prompts(DataConfig(source=str(tmp_path / "e.jsonl"), test_fraction=0.3))
    assert len(ps.train) + len(ps.test) == 4 and ps.stats["duplicate"] == 1
    assert {r["image_uri"] for r in ps.train + ps.test} == {str(tmp_path / "imgs" / f"{i}.png") for i in range(4)}


def test_an_image_row_reads_only_its_own_dataset_folder(tmp_path):
    """A row's image is read only from inside its dataset's folder (or an object store or the hub): an
    escaping path, an absolute one outside, a symbolic link out of it, a file:// URI, a web or chained URL
    are refused before anything is opened, and the refusal says nothing of the file (not its size)."""
    data = tmp_path / "set"
    data.mkdir()
    write_images(data)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(png((1, 2, 3)))
    (data / "link.png").symlink_to(outside / "secret.png")
    refused = {"../outside/secret.png": "outside the dataset folder",
               str(outside / "secret.png"): "outside the dataset folder",
               "link.png": "outside the dataset folder",
               "imgs/../../outside/secret.png": "outside the dataset folder",
               "../../../../etc/hostname": "outside the dataset folder",
               "~/secret.png": "outside the dataset folder",
               "file:///etc/hostname": "outside the dataset folder",
               (outside / "secret.png").as_uri(): "outside the dataset folder",
               "http://127.0.0.1:9/x.png": "only paths inside the dataset folder",
               "simplecache::file:///etc/hostname": "only paths inside the dataset folder",
               "memory://x.png": "only paths inside the dataset folder"}
    for ref, why in refused.items():
        (data / "e.jsonl").write_text(json.dumps({"prompt": "a", "image": "imgs/0.png"}) + "\n"
                                      + json.dumps({"prompt": "b", "image": ref}) + "\n")
        with pytest.raises(PromptDataError, match=r"e.jsonl:2: image .*" + why) as info:
            load_prompts(DataConfig(source=str(data / "e.jsonl")))
        assert "bytes" not in str(info.value) and "\n" not in str(info.value), ref
    # inside the folder: a relative path, a file:// URI and a symbolic link that stays inside
    (data / "inner.png").symlink_to(data / "imgs" / "1.png")
    (data / "e.jsonl").write_text("\n".join(json.dumps({"prompt": f"p{i}", "image": ref}) for i, ref in enumerate(
        ["imgs/0.png", (data / "imgs" / "2.png").as_uri(), "inner.png", "imgs/../imgs/3.png"])) + "\n")
    ps = load_prompts(DataConfig(source=str(data / "e.jsonl"), test_fraction=0.25))
    assert len(ps.train) + len(ps.test) == 4


def test_a_remote_datasets_relative_images_stay_under_its_own_location():
    from diffusionrl.data.images import read_image_bytes

    for ref in ("../other/x.png", "a/../../x.png", "/etc/hostname", "file:///etc/hostname"):
        with pytest.raises(PromptDataError, match=r"row 1: image .*(outside the dataset folder|its own location)"):
            read_image_bytes(ref, "s3://bucket/set", "row 1")
    with pytest.raises(PromptDataError, match=r"row 1: image .*outside the dataset folder hf://datasets/o/r"):
        read_image_bytes("../x.png", "hf://datasets/o/r@v1", "row 1")
    with pytest.raises(PromptDataError, match="comes? from no dataset folder"):
        read_image_bytes("imgs/0.png", None, "gen row 1")


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` pixels, with no pixel data behind it (a decompression bomb's
    first bytes: PIL reads the size from the header alone)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def big_png() -> bytes:
    """A real 12000 x 12000 image (144 MP: PIL only warns) of 1-bit pixels, a small file."""
    buf = io.BytesIO()
    Image.new("1", (12000, 12000)).save(buf, format="PNG")
    return buf.getvalue()


def test_an_image_over_the_pixel_bound_is_refused_from_its_header_naming_the_row(tmp_path):
    """A header that claims 400 MP ended in PIL's DecompressionBombError naming no file, a real 144 MP image was
    decoded with only PIL's warning: both are one line naming the row and the bound, nothing decoded, no warning."""
    import warnings

    from diffusionrl.data import load_image_pairs
    from diffusionrl.data.images import MAX_IMAGE_PIXELS

    write_images(tmp_path)
    (tmp_path / "imgs" / "bomb.png").write_bytes(png_header(20000, 20000))
    (tmp_path / "imgs" / "big.png").write_bytes(big_png())
    path = tmp_path / "edits.jsonl"
    for name, claim in (("bomb.png", r"400000000 pixels \(400 MP\)"), ("big.png", r"12000x12000 pixels \(144 MP\)")):
        path.write_text(json.dumps({"prompt": "a", "image": "imgs/0.png"}) + "\n"
                        + json.dumps({"prompt": "b", "image": f"imgs/{name}"}) + "\n")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # PIL's DecompressionBombWarning would fail here
            with pytest.raises(PromptDataError, match=rf"edits.jsonl:2: the image is {claim}, over the bound of "
                                                      rf"{MAX_IMAGE_PIXELS} pixels .*; downscale it") as err:
                load_prompts(DataConfig(source=str(path)))
        assert "\n" not in str(err.value)
    pq.write_table(pa.table({"prompt": ["p0", "p1"], "image": [png((1, 2, 3)), png_header(5000, 5000)]}),
                   tmp_path / "e.parquet")
    with pytest.raises(PromptDataError, match=r"e.parquet: row 2: the image is 5000x5000 pixels \(25 MP\), over"):
        load_prompts(DataConfig(source=str(tmp_path / "e.parquet")))
    ok = png((1, 2, 3), size=(4096, 4096))  # at the bound: accepted
    pq.write_table(pa.table({"prompt": ["p0", "p1"], "image": [ok, png((4, 5, 6))]}), tmp_path / "e.parquet")
    assert len(load_prompts(DataConfig(source=str(tmp_path / "e.parquet"))).train) == 1
    # the SFT pairs' images too
    pq.write_table(pa.table({"prompt": ["p0"], "image": [png_header(20000, 20000)]}), tmp_path / "pairs.parquet")
    with pytest.raises(PromptDataError, match=r"pairs.parquet: row 0: the image is 400000000 pixels"):
        load_image_pairs(str(tmp_path / "pairs.parquet"), 16)


def test_rows_with_and_without_an_image_fail_at_load_naming_the_first_that_differs(tmp_path):
    """A dataset mixing edits and generations failed at the training step that drew both (row_images); it fails
    when loaded, naming the row."""
    write_images(tmp_path)
    path = tmp_path / "edits.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "a", "image": "imgs/0.png"}, {"prompt": "b", "image": "imgs/1.png"}, {"prompt": "c"},
        {"prompt": "d"}]) + "\n")
    with pytest.raises(PromptDataError, match=r"edits.jsonl:3: this row has no 'image', while the rows before it "
                                              r"have one \(from .*edits.jsonl:1\); give every row"):
        load_prompts(DataConfig(source=str(path)))
    path.write_text("\n\n" + "\n".join(json.dumps(r) for r in [
        {"prompt": "a"}, {"prompt": "b"}, {"prompt": "c", "image": "imgs/2.png"}]) + "\n")
    with pytest.raises(PromptDataError, match=r"edits.jsonl:5: this row has an 'image', while the rows before it "
                                              r"have none \(from .*edits.jsonl:3\)"):
        load_prompts(DataConfig(source=str(path)))
    data = tmp_path / "set"  # a folder: train with images, test without
    data.mkdir()
    write_images(data)
    (data / "train.jsonl").write_text(json.dumps({"prompt": "t", "image": "imgs/0.png"}) + "\n")
    (data / "test.jsonl").write_text(json.dumps({"prompt": "h"}) + "\n")
    with pytest.raises(PromptDataError, match=r"set/test.jsonl:1: this row has no 'image'.*set/train.jsonl:1"):
        load_prompts(DataConfig(source=str(data)))
