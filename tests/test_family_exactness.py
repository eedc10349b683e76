"""The exactness invariants (docs/algorithms.md section 11) of every model family, over one Flow-GRPO loop
of each family's tiny preset (``FAMILIES``, one row a family): the loop runs the family's adapter (with or
without a CFG pass, plus the row's own check of its scored rollout); recomputed log-probs equal the
rollout's before the first update; the gradient does not depend on the micro-batch split; after one update
every LoRA tensor has moved (the row's LoRA targets present or left out), the logged log-prob difference is
within bound and nothing was clipped.

The ``loop`` fixture is module-scoped and parametrized by ``family``: pytest runs all of one family's tests
on one loop (started once, closed before the next family's), in file order, so the update comes last. What
is family-specific beyond these (parity with the stock pipeline, encoding, serving, refusals) stays in the
family's own test file."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from diffusionrl.models import (
    Flux2Adapter,
    Flux2KleinAdapter,
    FluxAdapter,
    FluxKontextAdapter,
    QwenImageAdapter,
    QwenImageEditAdapter,
    QwenImageEditV1Adapter,
    WanAdapter,
    ZImageAdapter,
)

from .conftest import started_loop, tiny_config
from .family_checks import recompute_diff, split_rel_diff, unchanged_after_update, write_kontext_edits

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _flux_rollout(traj) -> None:
    assert traj.guidance_scale == 3.5 and traj.latents.shape[2:] == (16, 4, 4)  # distilled guidance, packed 2x2


def _kontext_rollout(traj) -> None:  # each sample carries its row's input image
    assert traj.conditioning.image_latents.shape == (8, 16, 4, 4)
    assert all(m["image_uri"].endswith(".png") and len(m["image_sha256"]) == 64 for m in traj.metadata)


def _qwen_image_edit_rollout(traj) -> None:  # builtin:shape-edits rows, judged
    assert traj.conditioning.image_latents.shape == (8, 16, 4, 4)
    assert all(len(m["image_sha256"]) == 64 and "target" in m for m in traj.metadata)
    assert torch.isfinite(torch.as_tensor(traj.rewards)).all()


def _wan_rollout(traj) -> None:  # 5-D video latents, frames scored by both rewards
    assert traj.latents.shape[2:] == (16, 2, 4, 4) and traj.images.shape == (8, 5, 32, 32, 3)
    assert traj.guidance_scale == 5.0
    assert set(traj.reward_components) == {"jpeg_compressibility", "temporal_consistency"}


def _wan22_rollout(traj) -> None:  # SDE steps on both sides of the experts' boundary (t = 875)
    sde_t = traj.timesteps[traj.sde_mask[0]]
    assert (sde_t >= 875).any() and (sde_t < 875).any()


@dataclasses.dataclass(frozen=True)
class Family:
    id: str
    preset: str
    adapter: type  # the loop's adapter is exactly this class
    cfg_pass: bool  # the rollout carries negative prompt embeddings
    overrides: tuple[str, ...] = ("algorithm.kl_beta=0.04",)  # on top of conftest.TINY_OVERRIDES
    data: Callable[[Path], Path] | None = None  # writes the row's dataset into a folder: data.source=<it>
    rollout: Callable | None = None  # the row's own check of the scored rollout
    lora_has: tuple[str, ...] = ()  # substrings of LoRA parameter names that must be there
    lora_lacks: tuple[str, ...] = ()  # ... and that must not (dead targets left out)
    recompute_max: float = 1e-6  # max |rollout log-prob - recompute|
    split_max: float = 1e-5  # max |g(one micro-batch of 8) - g(micro-batches of 2)| / max |g|
    log_prob_diff_max: float = 1e-6  # train/log_prob_mean_abs_diff of the first update


FAMILIES = [
    Family("flux", "tiny-cpu-flux", FluxAdapter, cfg_pass=False, rollout=_flux_rollout),
    Family("flux-kontext", "tiny-cpu-flux-kontext", FluxKontextAdapter, cfg_pass=False,
           overrides=("algorithm.kl_beta=0.04", "data.test_fraction=0.2"), data=write_kontext_edits,
           rollout=_kontext_rollout),
    Family("flux2", "tiny-cpu-flux2", Flux2Adapter, cfg_pass=False,  # guidance-distilled
           lora_has=("single_transformer_blocks.1.attn.to_qkv_mlp_proj", "ff_context.linear_out")),
    Family("flux2-klein", "tiny-cpu-flux2-klein", Flux2KleinAdapter, cfg_pass=True,  # klein base: CFG at 4
           lora_has=("single_transformer_blocks.1.attn.to_qkv_mlp_proj", "ff_context.linear_out")),
    Family("qwen-image", "tiny-cpu-qwen-image", QwenImageAdapter, cfg_pass=True,  # true CFG at 4
           overrides=("algorithm.kl_beta=0.04", "model.max_sequence_length=64"),
           # the last block's text-output layers are dead targets, left out; its text keys still reach the image
           lora_has=("transformer_blocks.0.attn.to_add_out.", "transformer_blocks.1.attn.add_k_proj."),
           lora_lacks=("transformer_blocks.1.attn.to_add_out.",)),
    Family("qwen-image-edit", "tiny-cpu-qwen-image-edit", QwenImageEditAdapter, cfg_pass=True,
           rollout=_qwen_image_edit_rollout),
    Family("qwen-image-edit-v1", "tiny-cpu-qwen-image-edit-v1", QwenImageEditV1Adapter, cfg_pass=True,
           rollout=_qwen_image_edit_rollout),
    Family("wan", "tiny-cpu-wan", WanAdapter, cfg_pass=True, rollout=_wan_rollout),
    Family("wan22", "tiny-cpu-wan22", WanAdapter, cfg_pass=True,
           overrides=("algorithm.kl_beta=0.04", "sampling.step_strategy=all"), rollout=_wan22_rollout,
           lora_has=("high.blocks.0.attn1.to_q", "low.blocks.0.attn1.to_q")),  # the LoRA on both experts
    Family("zimage", "tiny-cpu-zimage", ZImageAdapter, cfg_pass=True,  # CFG at 4
           lora_has=("context_refiner.0.feed_forward.w2", "all_final_layer.2-1.linear")),
]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.id for f in FAMILIES])
def family(request) -> Family:
    return request.param


@pytest.fixture(scope="module")
def loop(family, tmp_path_factory):
    """The family's loop, its engine holding the policy's weights; ``conftest.scored`` is its first rollout."""
    overrides = list(family.overrides)
    if family.data is not None:
        overrides.append(f"data.source={family.data(tmp_path_factory.mktemp(f'{family.id}-data'))}")
    cfg = tiny_config(*overrides, preset=family.preset)
    with started_loop(cfg, tmp_path_factory.mktemp(f"{family.id}-loop")) as lp:
        yield lp


def test_the_loop_runs_the_familys_adapter(family, loop, scored):
    traj, _ = scored
    assert type(loop.backend.worker.adapter) is family.adapter
    assert (traj.conditioning.negative_prompt_embeds is not None) == family.cfg_pass
    if family.rollout is not None:
        family.rollout(traj)


def test_recomputed_log_probs_equal_rollout_log_probs_before_the_update(family, loop, scored):
    diff = recompute_diff(loop, scored[0])
    print(f"{family.id} recompute: max |rollout - recompute| = {diff:.3g}")
    assert diff <= family.recompute_max, diff


def test_gradient_does_not_depend_on_the_micro_batch_split(family, loop, scored):
    rel = split_rel_diff(loop, *scored)
    print(f"{family.id} micro-batch split: relative gradient difference = {rel:.3g}")
    assert rel <= family.split_max, rel


def test_every_lora_parameter_changes_after_a_step(family, loop, scored):
    params = " ".join(loop.backend.worker.policy.params)
    assert all(name in params for name in family.lora_has), family.lora_has
    assert not any(name in params for name in family.lora_lacks), family.lora_lacks
    unchanged, metrics = unchanged_after_update(loop, *scored)
    assert not unchanged, f"{len(unchanged)} LoRA tensors did not change, e.g. {unchanged[:2]}"
    assert metrics["train/log_prob_mean_abs_diff"] <= family.log_prob_diff_max, metrics
    assert metrics["train/clipfrac"] == 0.0, metrics  # ratio 1 before the first update: nothing clipped
