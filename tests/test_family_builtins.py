"""Every family's built-in tiny model is a real diffusers model of that family (``BUILTINS``, one row a
builtin): built twice it has the same weights; ``adapter_class`` maps its name to the family's adapter;
written as a diffusers folder (``save_builtin``) its ``model_index.json`` names the family's stock pipeline
class, ``adapter_class`` reads the family back from that file, the stock class's ``from_pretrained`` loads
it with the builtin's weights (the adapter's digest), and, where the row gives a call, the stock pipeline
samples a picture (or video) of the right shape from it in 2 steps. A row's ``check`` holds what only its
family has (Kontext edits, FLUX.2 klein is not guidance-distilled, Wan2.2 loads both experts).

What is family-specific beyond this (ODE parity with the stock pipeline, encoding, serving, refusals)
stays in the family's own test file; the exactness invariants are ``test_family_exactness.py``'s.
``builtin:tiny-sd3-shapes`` and ``builtin:tiny-flux-kontext-shapes`` (shipped weights) are tested with
their worlds; ``builtin:tiny-qwen-image-edit`` and ``builtin:tiny-qwen-image-edit-v1`` in
``test_qwen_image_edit.py`` (their processor without torchvision)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import pytest
import torch

from diffusionrl.models import (
    Flux2Adapter,
    Flux2KleinAdapter,
    FluxAdapter,
    FluxKontextAdapter,
    QwenImageAdapter,
    SD3Adapter,
    WanAdapter,
    WanExperts,
    ZImageAdapter,
    adapter_class,
    save_builtin,
)
from diffusionrl.models.families import builtin_builder

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _kontext(pipe, loaded) -> None:  # an editing family; plain FLUX.1 is not
    assert loaded.editing and not FluxAdapter.editing


def _klein(pipe, loaded) -> None:  # FLUX.2 [klein] base: not guidance-distilled, no guidance embedding
    assert pipe.config.is_distilled is False and not loaded.transformer.config.guidance_embeds


def _wan22(pipe, loaded) -> None:  # both experts, split at the boundary; transformer_2 is in the digest
    assert pipe.config.boundary_ratio == 0.875 and pipe.transformer_2 is not None
    assert isinstance(loaded.transformer, WanExperts) and loaded.experts.boundary == 875.0
    assert loaded.digest() != WanAdapter(builtin_builder("builtin:tiny-wan")()).digest()


@dataclasses.dataclass(frozen=True)
class Builtin:
    ref: str
    pipeline: str  # the stock diffusers class, the folder's model_index.json _class_name
    adapter: type  # exactly this class, for the name and for the saved folder
    call: dict | None = None  # a 2-step call of the stock pipeline (besides prompt, steps, generator, np output)
    shape: tuple[int, ...] = ()  # ... and the shape of its images (or video frames)
    check: Callable | None = None  # (stock pipeline, adapter over it): the row's own


BUILTINS = [
    Builtin("builtin:tiny-sd3", "StableDiffusion3Pipeline", SD3Adapter,
            {"height": 64, "width": 64, "max_sequence_length": 16}, (1, 64, 64, 3)),
    Builtin("builtin:tiny-flux", "FluxPipeline", FluxAdapter,
            {"height": 64, "width": 64, "max_sequence_length": 16}, (1, 64, 64, 3)),
    Builtin("builtin:tiny-flux-kontext", "FluxKontextPipeline", FluxKontextAdapter, check=_kontext),
    Builtin("builtin:tiny-flux2", "Flux2Pipeline", Flux2Adapter,
            {"guidance_scale": 4.0, "height": 32, "width": 32, "max_sequence_length": 64}, (1, 32, 32, 3)),
    Builtin("builtin:tiny-flux2-klein", "Flux2KleinPipeline", Flux2KleinAdapter, check=_klein),
    Builtin("builtin:tiny-qwen-image", "QwenImagePipeline", QwenImageAdapter,
            {"negative_prompt": " ", "true_cfg_scale": 4.0, "height": 32, "width": 32}, (1, 32, 32, 3)),
    Builtin("builtin:tiny-wan", "WanPipeline", WanAdapter,
            {"height": 32, "width": 32, "num_frames": 5, "max_sequence_length": 16}, (1, 5, 32, 32, 3)),
    Builtin("builtin:tiny-wan22", "WanPipeline", WanAdapter, check=_wan22),
    Builtin("builtin:tiny-zimage", "ZImagePipeline", ZImageAdapter,
            {"guidance_scale": 3.0, "height": 32, "width": 32, "max_sequence_length": 64}, (1, 32, 32, 3)),
]


@pytest.mark.parametrize("row", BUILTINS, ids=lambda r: r.ref.removeprefix("builtin:"))
def test_a_builtin_is_reproducible_and_its_saved_folder_is_the_stock_pipelines(row, tmp_path):
    import diffusers

    build = builtin_builder(row.ref)
    builtin = row.adapter(build(), device="cpu")
    assert row.adapter(build(), device="cpu").digest() == builtin.digest()  # the same weights on every build
    assert adapter_class(row.ref) is row.adapter

    save_builtin(row.ref, tmp_path / "tiny")
    assert json.loads((tmp_path / "tiny" / "model_index.json").read_text())["_class_name"] == row.pipeline
    assert adapter_class(str(tmp_path / "tiny")) is row.adapter  # read from model_index.json
    pipe = getattr(diffusers, row.pipeline).from_pretrained(tmp_path / "tiny")
    assert type(pipe).__name__ == row.pipeline
    loaded = row.adapter(pipe)
    assert loaded.digest() == builtin.digest()
    if row.call is not None:
        out = pipe(prompt="a red cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                   output_type="np", **row.call)
        assert (out.frames if row.pipeline == "WanPipeline" else out.images).shape == row.shape
    if row.check is not None:
        row.check(pipe, loaded)
