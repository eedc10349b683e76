"""Supervised fine-tuning: the (prompt, image) sources, the loss on recorded data, the split, the run,
and the RL warm start from its LoRA (docs/algorithms.md section 14.7)."""

import dataclasses
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from diffusionrl.config import ConfigError
from diffusionrl.data import PromptDataError, load_image_pairs
from diffusionrl.run import CheckpointMismatch
from diffusionrl.train import build_loop, train, train_sft
from diffusionrl.training.trainer import UpdateStats

from .conftest import saved_lora, tiny_config

SFT = "tiny-cpu-sft"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _png(colour, size=(40, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def test_sources_folder_parquet_and_builtin(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    (folder / "a.png").write_bytes(_png((255, 0, 0)))
    (folder / "b.png").write_bytes(_png((0, 0, 255)))
    (folder / "prompts.jsonl").write_text(
        json.dumps({"image": "a.png", "prompt": "red"}) + "\n\n" + json.dumps({"file_name": "b.png", "text": "blue"}))
    rows = load_image_pairs(str(folder), 32)
    assert [r["prompt"] for r in rows] == ["red", "blue"]
    assert rows[0]["image"].shape == (32, 32, 3) and rows[0]["image"].dtype == np.uint8
    assert tuple(rows[0]["image"][16, 16]) == (255, 0, 0) and tuple(rows[1]["image"][0, 0]) == (0, 0, 255)
    table = pa.table({"prompt": ["green"], "image": [{"bytes": _png((0, 255, 0)), "path": None}]})
    pq.write_table(table, tmp_path / "pairs.parquet")
    (row,) = load_image_pairs(str(tmp_path / "pairs.parquet"), 16)
    assert row["prompt"] == "green" and tuple(row["image"][8, 8]) == (0, 255, 0)
    shapes = load_image_pairs("builtin:shapes:5", 32, seed=3)
    assert len(shapes) == 5 and all(r["image"].shape == (32, 32, 3) for r in shapes)
    assert [r["prompt"] for r in shapes] == [r["prompt"] for r in load_image_pairs("builtin:shapes:5", 32, seed=3)]
    (folder / "prompts.jsonl").write_text(json.dumps({"image": "missing.png", "prompt": "x"}))
    with pytest.raises(PromptDataError, match=r"prompts.jsonl:1: image 'missing.png' not found"):
        load_image_pairs(str(folder), 32)
    pq.write_table(pa.table({"prompt": ["p"], "image": [b"not an image"]}), tmp_path / "bad.parquet")
    with pytest.raises(PromptDataError, match="row 0: cannot decode"):
        load_image_pairs(str(tmp_path / "bad.parquet"), 32)


def test_an_image_folder_index_cannot_name_files_outside_the_folder(tmp_path):
    """prompts.jsonl rows naming ../x.png, an absolute path or a link out of the folder are refused
    (naming file and line) instead of read and trained on."""
    (tmp_path / "outside").mkdir()
    secret = tmp_path / "outside" / "x.png"
    secret.write_bytes(_png((9, 9, 9)))
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "ok.png").write_bytes(_png((255, 0, 0)))
    (folder / "sub").mkdir()
    (folder / "sub" / "in.png").write_bytes(_png((0, 255, 0)))
    (folder / "link.png").symlink_to(secret)
    cases = {"../outside/x.png": "outside the dataset folder", str(secret): "is an absolute path",
             "sub/../../outside/x.png": "outside the dataset folder", "link.png": "outside the dataset folder"}
    for name, why in cases.items():
        (folder / "prompts.jsonl").write_text(json.dumps({"image": "ok.png", "prompt": "red"}) + "\n"
                                              + json.dumps({"image": name, "prompt": "leak"}) + "\n")
        with pytest.raises(PromptDataError, match=rf"prompts.jsonl:2: image '.*' .*{why}") as err:
            load_image_pairs(str(folder), 16)
        assert "\n" not in str(err.value)
    (folder / "prompts.jsonl").write_text(json.dumps({"image": "sub/../sub/in.png", "prompt": "green"}))
    (row,) = load_image_pairs(str(folder), 16)  # a path that stays inside is fine
    assert tuple(row["image"][8, 8]) == (0, 255, 0)


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    lp = build_loop(tiny_config(preset=SFT), tmp_path_factory.mktemp("sft"), progress=False)
    rows, _ = lp.backend.sampler.batch(0)
    batch = lp.backend.encode(rows)
    yield lp, batch
    lp.close()


def test_a_unit_is_the_flow_matching_loss_on_the_encoded_pairs(sft):
    lp, batch = sft
    objective, adapter = lp.backend.worker.objective, lp.backend.worker.adapter
    assert batch.latents.shape == (8, *adapter.latent_shape(32))
    sl = batch.micro_batches()[1]
    with torch.no_grad():
        loss, stats = objective._make(batch, sl, step=0, epoch=0)()
        t, eps = objective.draws(range(sl.start, sl.stop), (0, 0), tuple(batch.latents.shape[1:]))
        x0 = batch.latents[sl]
        x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        v = adapter.velocity(objective.policy.model, x_t, t * 1000, batch.conditioning.select(sl), 1.0)
        expected = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3)).sum()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    assert 0 < float(stats["sft_t_mean"]) / 4 < 1


def test_gradient_does_not_depend_on_the_micro_batch_split(sft):
    lp, batch = sft
    trainer, objective = lp.backend.worker.trainer, lp.backend.worker.objective

    def grads(micro):
        b = dataclasses.replace(batch, micro_batch_size=micro)
        trainer.optimizer.zero_grad(set_to_none=True)
        assert trainer.accumulate(objective.units(b, b.micro_batches(), 0, 0), UpdateStats())
        out = {n: p.grad.detach().clone() for n, p in lp.backend.worker.policy.params.items()}
        trainer.optimizer.zero_grad(set_to_none=True)
        return out

    one, many = grads(8), grads(2)
    num = max(float((one[n] - many[n]).norm()) for n in one)
    den = max(float(one[n].norm()) for n in one)
    assert den > 0 and num / den <= 1e-5


def test_sft_trains_two_steps_resumes_only_as_sft_and_warm_starts_rl(tmp_path):
    result = train(tiny_config(preset=SFT), tmp_path / "sft", resume=None)
    assert result.steps_done == 2 and all(np.isfinite(m["train/loss"]) for m in result.metrics)
    assert all(m["train/optimizer_steps"] == 1 for m in result.metrics)
    with pytest.raises(CheckpointMismatch, match="algorithm"):
        train(tiny_config("train.steps=3", preset="tiny-cpu"), tmp_path / "sft", resume="auto")
    sft_lora = saved_lora(tmp_path / "sft")
    rl = build_loop(tiny_config(f"algorithm.init_lora={result.model_dir}"), tmp_path / "rl", progress=False)
    from peft import get_peft_model_state_dict

    start = get_peft_model_state_dict(rl.backend.worker.policy.model)
    assert start.keys() == sft_lora.keys() and all(torch.equal(start[k], sft_lora[k]) for k in start)
    rl.close()
    # the same from an object-store URI (the workflow's SFT stage hands RL its LoRA's URI)
    import fsspec

    fs = fsspec.filesystem("memory")
    for f in result.model_dir.iterdir():
        fs.pipe_file(f"/sft-test/lora/{f.name}", f.read_bytes())
    rl = build_loop(tiny_config("algorithm.init_lora=memory://sft-test/lora"), tmp_path / "rl2", progress=False)
    start = get_peft_model_state_dict(rl.backend.worker.policy.model)
    assert all(torch.equal(start[k], sft_lora[k]) for k in sft_lora)
    rl.close()
    with pytest.raises(ConfigError, match="init_lora=memory://sft-test/nothing: no adapter_model.safetensors there"):
        build_loop(tiny_config("algorithm.init_lora=memory://sft-test/nothing"), tmp_path / "rl3", progress=False)
    again = train_sft(tiny_config("train.steps=1"), tmp_path / "again", source="builtin:shapes:16", resume=None)
    assert again.steps_done == 1


def test_sft_resumes_after_a_run_control_change(tmp_path, capfd):
    """More steps or another reward layout is no new objective: the warm start goes on from its checkpoint."""
    first = train(tiny_config("train.steps=1", preset=SFT), tmp_path, resume=None)
    assert first.steps_done == 1
    assert "sft step 1/1: loss " in capfd.readouterr().err  # its progress line names what it shows
    more = train(tiny_config("train.steps=2", "reward.num_actors=2", preset=SFT), tmp_path, resume="auto")
    assert more.steps_done == 2 and [m["step"] for m in more.metrics] == [1, 2]
    assert more.metrics[0] == first.metrics[0]  # step 1 is the first run's, not trained again
    with pytest.raises(CheckpointMismatch, match="learning_rate"):
        train(tiny_config("train.steps=3", "train.learning_rate=0.5", preset=SFT), tmp_path, resume="auto")


def test_configuration_fails_closed(tmp_path):
    with pytest.raises(ConfigError, match="sft_source"):
        tiny_config("algorithm.sft_source=", preset=SFT)
    with pytest.raises(ConfigError, match="world_size"):
        tiny_config("train.world_size=2", "train.prompts_per_step=4", preset=SFT)
    with pytest.raises(ConfigError, match="init_lora=.* is not a LoRA folder"):  # before the model loads
        build_loop(tiny_config(f"algorithm.init_lora={tmp_path}"), tmp_path / "x", progress=False)


def test_sft_lowers_the_flow_matching_loss_on_held_out_pairs(tmp_path):
    from diffusionrl.data import shape_pairs

    cfg = tiny_config("train.steps=4", "train.learning_rate=1e-2", "train.checkpoint_every=0", preset=SFT)
    loop = build_loop(cfg, tmp_path, progress=False)
    objective = loop.backend.worker.objective
    held = loop.backend.encode(shape_pairs(8, cfg.sampling.resolution, cfg.data.seed + 1))  # other pictures
    before = objective.held_out_loss(held)
    assert objective.held_out_loss(held) == before  # the same draws every call
    for step in range(cfg.train.steps):
        loop.run_step(step)
    after = objective.held_out_loss(held)
    loop.close()
    assert after < 0.95 * before, (before, after)


def test_builtin_shape_pairs_never_draw_a_held_out_prompt():
    """A warm start on builtin:shapes must not see the prompts the demo evaluates on."""
    from diffusionrl.config import load_config
    from diffusionrl.data import load_prompts, shape_pairs

    held_out = {r["prompt"] for r in load_prompts(load_config("tiny-cpu-shapes").data).test}
    drawn = {r["prompt"] for r in shape_pairs(300, 32)}
    assert held_out and not drawn & held_out and len(drawn) > 90  # every training prompt, none held out
