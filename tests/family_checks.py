"""The exactness checks every model family passes (docs/algorithms.md section 11), shared by
``test_family_exactness.py`` (over a loop of each family's tiny preset), ``test_same_latent.py`` and the
objective tests; the registered model's served image against the evaluation's (``served_vs_evaluated``); input images to
edit and their rows (``scene``, ``png``, ``meta_of``, ``write_kontext_edits``)."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from diffusionrl.train import build_loop
from diffusionrl.training.trainer import UpdateStats

from .conftest import tiny_config


def recompute_diff(loop, traj) -> float:
    """The largest |rollout log-prob - trainer recompute| before any update (over every SDE step)."""
    diff, pairs = loop.backend.worker.objective.recompute_log_prob_diff(traj)
    assert pairs == int(traj.sde_mask.sum()) and pairs > 0
    return diff


def _grads(loop, traj, active, micro: int) -> dict[str, torch.Tensor]:
    worker = loop.backend.worker
    traj = dataclasses.replace(traj, micro_batch_size=micro)
    worker.trainer.optimizer.zero_grad(set_to_none=True)
    units = worker.objective.units(traj, traj.micro_batches(), active, np.random.default_rng(0))
    assert worker.trainer.accumulate(units, UpdateStats())
    grads = {n: p.grad.detach().clone() for n, p in worker.policy.params.items()}
    worker.trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def split_rel_diff(loop, traj, active, whole: int = 8, parts: int = 2) -> float:
    """max |g(one micro-batch) - g(micro-batches of ``parts``)| / max |g|, over the LoRA tensors."""
    one, many = _grads(loop, traj, active, whole), _grads(loop, traj, active, parts)
    num = max(float((one[n] - many[n]).norm()) for n in one)
    den = max(float(one[n].norm()) for n in one)
    assert den > 0
    return num / den


def unchanged_after_update(loop, traj, active) -> tuple[list[str], dict[str, float]]:
    """The LoRA tensors one update leaves unchanged (none, for live targets), and its metrics."""
    before = loop.backend.worker.policy.lora_state()
    metrics = loop.backend.update(traj, active, step=0)
    after = loop.backend.worker.policy.lora_state()
    return [n for n in before if torch.equal(before[n], after[n])], metrics


def nft_one_step(preset: str, out_dir, adapter_class) -> None:
    """One DiffusionNFT step of ``preset`` end to end: every LoRA tensor moves, metrics finite, LoRA saved."""
    lp = build_loop(tiny_config("train.steps=1", preset=preset), out_dir, progress=False)
    before = copy.deepcopy(lp.backend.worker.policy.lora_state())
    result = lp.run(resume=None)
    after = lp.backend.worker.policy.lora_state()
    lp.close()
    assert result.steps_done == 1 and isinstance(lp.backend.worker.adapter, adapter_class)
    assert all(not torch.equal(before[n], after[n]) for n in before)
    assert all(np.isfinite(v) for v in result.metrics[0].values())
    assert (result.model_dir / "adapter_model.safetensors").is_file()


def served_vs_evaluated(served_png: bytes, ev, label: str) -> tuple[int, int]:
    """A registered model's served image (PNG bytes) against the evaluation's tuned sample of the same prompt and
    seed (``ev``: ``evaluate_lora`` of one row): ``(max |served - tuned|, max |tuned - base|)`` over 0-255, printed;
    the second shows the comparison can tell the LoRA apart."""
    served = np.asarray(Image.open(io.BytesIO(served_png)).convert("RGB")).astype(int)
    diff = int(np.abs(served - ev.tuned_images[0]).max())
    lora_effect = int(np.abs(ev.base_images[0].astype(int) - ev.tuned_images[0]).max())
    print(f"{label} served vs evaluated: max |diff| = {diff} (tuned vs base: {lora_effect}) of 255")
    return diff, lora_effect


COLORS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220), "yellow": (230, 220, 40)}


def scene(color: str, shape: str, size: int = 32) -> Image.Image:
    """A ``color`` square or circle on a light background: an input image to edit."""
    im = Image.new("RGB", (size, size), (245, 245, 240))
    box = (size // 4, size // 4, 3 * size // 4, 3 * size // 4)
    (ImageDraw.Draw(im).ellipse if shape == "circle" else ImageDraw.Draw(im).rectangle)(box, fill=COLORS[color])
    return im


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def meta_of(*images: Image.Image) -> list[dict]:
    """Each image as an editing row's metadata (its PNG bytes resolved as a row's ``image`` is), the prompt left out."""
    from diffusionrl.data.images import resolve_row_image

    return [{k: v for k, v in resolve_row_image({"prompt": "x", "image": png(im)}, "test").items() if k != "prompt"}
            for im in images]


def write_kontext_edits(folder: Path) -> Path:
    """An editing dataset in ``folder``: 16 rows, each a prompt and a source scene (a path relative to the file)."""
    (folder / "scenes").mkdir()
    rows = []
    for i, (color, shape) in enumerate((c, s) for c in COLORS for s in ("square", "circle")):
        scene(color, shape).save(folder / "scenes" / f"{i}.png")
        for target in ("green", "yellow"):
            if target != color:
                rows.append({"prompt": f"make the {color} {shape} {target}", "image": f"scenes/{i}.png",
                             "category": "color"})
    (folder / "edits.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return folder / "edits.jsonl"
