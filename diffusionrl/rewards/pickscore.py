"""PickScore reward (docs/algorithms.md section 8): ``logit_scale * cos(text_emb, image_emb) / 26``.

A CLIP model fine-tuned on human preferences (PickScore_v1, CLIP-H processor). ``/ 26`` brings the
typical score (about 21-23 for SD images) near 1, as flow_grpo does. torch and transformers are
imported inside functions so importing this module stays cheap.
"""

from __future__ import annotations

import logging
import os

import numpy as np

from .base import Reward, RewardResult, register_reward, safe_score

log = logging.getLogger(__name__)

DEFAULT_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
DEFAULT_MODEL = "yuvalkirstain/PickScore_v1"
SCALE_DIVISOR = 26.0


@register_reward("pickscore")
class PickScoreReward(Reward):
    """PickScore_v1 preference score / 26 (CLIP-H processor)."""

    name = "pickscore"

    def __init__(self, model, processor, device=None, dtype=None, batch_size: int = 16):
        """Score with an already-built CLIP ``model`` and its ``processor`` (tokenizer + image processor).

        ``device`` defaults to CUDA when available, else CPU; ``dtype`` to fp16 on GPU, fp32 on CPU.
        """
        import torch

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.float16 if self.device.type == "cuda" else torch.float32)
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.processor = processor
        self.batch_size = batch_size

    @classmethod
    def from_pretrained(cls, processor_id: str = DEFAULT_PROCESSOR, model_id: str = DEFAULT_MODEL, device=None,
                        token=None):
        """Load from hub ids or local folders; ``token`` defaults to ``hub.hf_token()`` (for gated mirrors)."""
        import torch
        from transformers import AutoModel, AutoProcessor

        from diffusionrl.hub import hf_token

        token = token or hf_token()
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        try:
            processor = AutoProcessor.from_pretrained(processor_id, token=token)
            model = AutoModel.from_pretrained(model_id, token=token, dtype=dtype)
        except (OSError, ValueError) as exc:
            offline = os.environ.get("HF_HUB_OFFLINE") in ("1", "true", "True")
            raise OSError(
                f"could not load PickScore (reward.pickscore_processor={processor_id!r}, "
                f"reward.pickscore_model={model_id!r}): {exc}. Point both at local folders saved with "
                "save_pretrained, or allow downloads"
                + (" (HF_HUB_OFFLINE=1 is set)" if offline else "")
                + "; set HF_TOKEN if the repository is gated."
            ) from exc
        return cls(model, processor, device=device, dtype=dtype)

    @classmethod
    def from_config(cls, reward_cfg=None) -> PickScoreReward:
        return cls.from_pretrained(
            getattr(reward_cfg, "pickscore_processor", DEFAULT_PROCESSOR) or DEFAULT_PROCESSOR,
            getattr(reward_cfg, "pickscore_model", DEFAULT_MODEL) or DEFAULT_MODEL,
        )

    def _score_batch(self, images: list[np.ndarray], prompts: list[str]) -> np.ndarray:
        import torch

        with torch.inference_mode():
            pixels = self.processor(images=list(images), return_tensors="pt")["pixel_values"]
            text = self.processor(text=list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt")
            out = self.model(
                input_ids=text["input_ids"].to(self.device),
                attention_mask=text["attention_mask"].to(self.device),
                pixel_values=pixels.to(self.device, self.dtype),
            )
            # text_embeds / image_embeds are already L2-normalised by CLIPModel; cos = their dot product.
            cos = (out.text_embeds.float() * out.image_embeds.float()).sum(-1)  # [B]
            scores = self.model.logit_scale.float().exp() * cos / SCALE_DIVISOR
        return scores.cpu().numpy().astype(np.float32)

    def __call__(self, images, prompts, metadata) -> RewardResult:
        scores = np.zeros(len(prompts), dtype=np.float32)
        failures = 0
        for start in range(0, len(prompts), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            batch_images, batch_prompts = list(images[chunk]), list(prompts[chunk])
            try:
                values = self._score_batch(batch_images, batch_prompts)
                if not np.all(np.isfinite(values)):
                    raise ValueError("non-finite scores")
                scores[chunk] = values
            except Exception as exc:  # retry sample by sample to isolate the bad one
                log.warning("pickscore batch %d failed (%s); scoring its samples one by one", start, exc)
                part = safe_score(
                    lambda im, p, _m: self._score_batch([im], [p])[0], batch_images, batch_prompts,
                    list(metadata[chunk]) if metadata is not None else [{}] * len(batch_prompts), self.name,
                )
                scores[chunk] = part.scores
                failures += part.failures
        return RewardResult(scores, failures)
