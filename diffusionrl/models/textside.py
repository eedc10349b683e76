"""``TextSide``: one side of a ``Conditioning`` (the prompts' or the negative prompt's text, and an editing
family's input-image latents, the same on both sides) as one transformer forward takes it;
``FlowAdapter.velocity`` hands one to the family's ``_forward``, both sides in one batch (``TextSide.cat``)
where a family runs its CFG pass batched (SD3, Z-Image); ``pad_embeds`` / ``unpad_embeds``: per-prompt embeddings of
varying length as one padded batch with its token mask and back (Z-Image, Qwen-Image-Edit)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TextSide:
    """One side of a ``Conditioning`` as one forward takes it: the prompts' or the negative prompt's
    embeddings ``[N, S, D]``, pooled embeddings ``[N, P]`` and token mask ``[N, S]`` (or None); ``image``:
    the input image's latents ``[N, C, h, w]`` of an editing family (FLUX.1 Kontext, Qwen-Image-Edit), else None."""

    embeds: torch.Tensor
    pooled: torch.Tensor
    mask: torch.Tensor | None = None
    image: torch.Tensor | None = None

    @staticmethod
    def cat(a: TextSide, b: TextSide) -> TextSide:
        """``[a; b]`` as one batch (a batched CFG pass): texts of different lengths zero-padded to the
        longer with a token mask (1 = real token) saying which are real; no mask where neither has one
        and the lengths agree."""
        s = max(a.embeds.shape[1], b.embeds.shape[1])
        if a.mask is None and b.mask is None and a.embeds.shape[1] == b.embeds.shape[1]:
            mask = None
        else:
            masks = [side.embeds.new_ones(side.embeds.shape[:2], dtype=torch.int64) if side.mask is None
                     else side.mask for side in (a, b)]
            mask = torch.cat([torch.nn.functional.pad(m, (0, s - m.shape[1])) for m in masks])
        embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, s - e.shape[1])) for e in (a.embeds, b.embeds)])
        image = None if a.image is None else torch.cat([a.image, b.image])
        return TextSide(embeds, torch.cat([a.pooled, b.pooled]), mask, image)


def pad_embeds(embeds: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-prompt ``[S_i, D]`` -> ``([N, max S_i, D]`` zero-padded, ``[N, max S_i]`` int64 token mask)."""
    longest = max(e.shape[0] for e in embeds)
    out = embeds[0].new_zeros(len(embeds), longest, embeds[0].shape[1])
    mask = torch.zeros(len(embeds), longest, dtype=torch.int64, device=embeds[0].device)
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = 1
    return out, mask


def unpad_embeds(embeds: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    """The inverse of ``pad_embeds``: each prompt's real tokens."""
    if mask is None:
        return list(embeds.unbind(0))
    return [e[m.bool()] for e, m in zip(embeds, mask)]
