"""Semi-autoregressive block decoding with low-confidence commits, recording an exact trace.

Each global step ``s`` is one forward pass over the whole (micro-)batch:

1. ``log_p = log_softmax(logits / T)`` with the MASK logit at -inf (MASK is never proposed);
2. a proposal per position: a sample from ``p`` (per-row seeded), or its argmax when greedy;
3. confidence = max probability; inside each row's current block (the first block that still has
   MASK positions) commit every masked position with confidence >= threshold, or the single most
   confident one if none reaches it;
4. record, for each committed position, the step ``s`` and the sampled token's ``log_p``.

Prompt and padding positions carry step -1. A position is therefore visible at step ``s`` iff its
step is < ``s``, which is all the replay scorer needs to rebuild every canvas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import BDLMAdapter


@dataclass
class Decoded:
    tokens: torch.Tensor  # [B, L] int64: the final canvas (prompt + committed tokens)
    action_steps: torch.Tensor  # [B, L] int64: global step each position was committed at, -1 for prompt/padding
    log_probs: torch.Tensor  # [B, L] float32: log_softmax(logits / T) of the committed token, 0 where step is -1
    num_steps: int  # forward passes taken


def proposal_log_probs(logits: torch.Tensor, temperature: float, mask_id: int) -> torch.Tensor:
    """``log_softmax(logits / T)`` in float32 with MASK excluded; shared by sampler and replay so
    both run the very same ops on the very same logits."""
    scaled = logits.float() / temperature  # [B, L, V]
    scaled[..., mask_id] = -torch.inf
    return torch.log_softmax(scaled, dim=-1)  # [B, L, V]


def current_block(masked: torch.Tensor, prompt_length: int, block_size: int) -> torch.Tensor:
    """``[B, L]`` bool: the still-masked positions of each row's first unfinished block."""
    b = masked.shape[0]
    gen = masked[:, prompt_length:].reshape(b, -1, block_size)  # [B, nb, bs]
    has = gen.any(-1)  # [B, nb]
    first = torch.where(has.any(1), has.float().argmax(1), torch.full((b,), -1))  # [B]
    in_block = torch.arange(gen.shape[1])[None, :] == first[:, None]  # [B, nb]
    out = torch.zeros_like(masked)
    out[:, prompt_length:] = (gen & in_block[:, :, None]).reshape(b, -1)
    return out


def commit_mask(confidence: torch.Tensor, candidates: torch.Tensor, threshold: float) -> torch.Tensor:
    """Candidates with confidence >= threshold; where none qualifies, the most confident one."""
    above = candidates & (confidence >= threshold)  # [B, L]
    fallback = candidates.any(1) & ~above.any(1)  # [B]
    best = confidence.masked_fill(~candidates, -torch.inf).argmax(1)  # [B]
    single = torch.zeros_like(candidates)
    single[torch.arange(len(best)), best] = True
    return above | (single & fallback[:, None])


def _gumbel(seeds: torch.Tensor | None, step: int, shape: tuple[int, ...]) -> torch.Tensor | None:
    """Per-row Gumbel noise ``[B, L, V]``; row ``i`` depends only on ``(seeds[i], step)``, so a
    sample does not depend on which other rows share its batch."""
    if seeds is None:
        return None
    rows = []
    for seed in seeds.tolist():
        gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + step)
        rows.append(torch.rand(shape[1:], generator=gen))
    u = torch.stack(rows)  # [B, L, V] in [0, 1)
    return -torch.log(-torch.log(u.clamp_min(1e-20)))


@torch.no_grad()
def decode(
    adapter: BDLMAdapter,
    prompts: torch.Tensor,
    *,
    gen_length: int,
    block_size: int,
    temperature: float,
    threshold: float,
    seeds: torch.Tensor | None,
) -> Decoded:
    """Decode ``gen_length`` tokens after ``prompts`` (``[B, P]``); ``seeds=None`` is greedy."""
    vocab = adapter.vocab
    b, p = prompts.shape
    canvas = torch.cat([prompts, torch.full((b, gen_length), vocab.mask, dtype=torch.int64)], 1)  # [B, L]
    steps = torch.full_like(canvas, -1)
    log_probs = torch.zeros(canvas.shape, dtype=torch.float32)
    step = 0
    while bool((masked := canvas == vocab.mask).any()):
        log_p = proposal_log_probs(adapter.logits(canvas), temperature, vocab.mask)  # [B, L, V]
        noise = _gumbel(seeds, step, tuple(log_p.shape))
        tokens = (log_p if noise is None else log_p + noise).argmax(-1)  # [B, L]
        confidence = log_p.max(-1).values.exp()  # [B, L]
        commit = commit_mask(confidence, current_block(masked, p, block_size), threshold)
        canvas = torch.where(commit, tokens, canvas)
        steps = torch.where(commit, torch.full_like(steps, step), steps)
        chosen = log_p.gather(-1, tokens[..., None]).squeeze(-1)  # [B, L]
        log_probs = torch.where(commit, chosen, log_probs)
        step += 1
    return Decoded(canvas, steps, log_probs, step)
