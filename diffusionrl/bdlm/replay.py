"""Exact replay of a decoding trace: the log-prob of every committed token under any policy.

At step ``s`` the sampler saw a canvas in which exactly the positions committed at a step < ``s``
were visible (prompt positions carry step -1). ``replay_canvas`` rebuilds it from the final tokens
and the commit steps; one forward pass per step then gives ``log_softmax(logits / T)`` at the
tokens committed at ``s``. With the same weights, rows and batch composition this is the sampler's
own computation, so the replayed log-probs equal the recorded ones (fp32, ~1e-7).

Positions not scored at ``s`` are *sanitised*: their logits are replaced by zeros before the
softmax (``torch.where``, not a multiply: ``0 * nan`` is nan), so a NaN/inf that a model emits at
a masked or padded position can reach neither the loss nor the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model import BDLMAdapter
from .sampler import proposal_log_probs


def replay_canvas(targets: torch.Tensor, action_steps: torch.Tensor, step: int, mask_id: int) -> torch.Tensor:
    """The canvas the sampler saw at ``step``: positions committed at >= ``step`` are MASK."""
    return torch.where(action_steps >= step, torch.full_like(targets, mask_id), targets)  # [B, L]


@dataclass
class StepScores:
    token_log_probs: torch.Tensor  # [B, L]: log-prob of the target at active positions, 0 elsewhere
    log_probs: torch.Tensor  # [B, L, V]: full (sanitised) proposal log-probs, for the KL term
    cols: slice = field(default_factory=lambda: slice(None))  # the columns of the trace's [B, A] layout they fill


def score_step(logits: torch.Tensor, targets: torch.Tensor, active: torch.Tensor, temperature: float,
               mask_id: int) -> StepScores:
    """``log_softmax(logits / T)`` at ``targets`` where ``active``; inactive positions sanitised."""
    safe = torch.where(active[..., None], logits.float(), torch.zeros((), dtype=torch.float32))  # [B, L, V]
    log_p = proposal_log_probs(safe, temperature, mask_id)  # [B, L, V]
    chosen = log_p.gather(-1, targets[..., None]).squeeze(-1)  # [B, L]
    return StepScores(torch.where(active, chosen, torch.zeros_like(chosen)), log_p)


def steps_with_actions(action_steps: torch.Tensor) -> list[int]:
    """Global steps at which at least one row of the batch committed a token."""
    return sorted(int(s) for s in torch.unique(action_steps) if s >= 0)


def replay_log_probs(adapter: BDLMAdapter, trace, micro_batch_size: int | None = None) -> torch.Tensor:
    """``[B, A]`` log-prob of every action under ``adapter`` (no grad), 0 where there is none.

    Works on any trace with the learner interface (``micro_batches``, ``unit_keys``,
    ``score_unit``): a ``TraceBatch`` (one unit per step, ``A = L``) or a DiffusionGemma
    ``CanvasTrace`` (one unit per block). ``micro_batch_size`` defaults to the rollout's, so the
    forward passes see the rollout's rows.
    """
    out = torch.zeros(trace.log_probs.shape, dtype=torch.float32)
    with torch.no_grad():
        for rows in trace.micro_batches(micro_batch_size):
            for key in trace.unit_keys(rows):
                scores = trace.score_unit(adapter, rows, key)
                out[rows, scores.cols] += scores.token_log_probs
    return out
