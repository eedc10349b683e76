"""DAPO dynamic sampling: refill a step's batch with groups that have reward variance.

A group whose samples all earn the same reward has advantage 0 everywhere and gives no gradient.
``dapo`` filters such groups out and then *refills*: it rolls out further batches of fresh prompts
(seeded by ``(grpo.seed, step, attempt)``, so a resumed run draws the same ones) until the step
holds ``prompts_per_step`` groups with variance or ``grpo.dapo_max_refills`` extra batches were
drawn. Surplus groups of the last batch are dropped, as in DAPO.

The learner sees one trace: the batches concatenated whole and then cut to the micro-batches that
hold a kept row, so every replayed micro-batch has exactly the rows (and order) it had in the
rollout and the replayed log-probs stay equal to the recorded ones.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["REFILL_GROUP_OFFSET", "concat_rows", "keep_groups"]

# Group ids of refill batch ``a`` are the step's ids + ``a * REFILL_GROUP_OFFSET``: unique in the step.
REFILL_GROUP_OFFSET = 1 << 40


def keep_groups(active: torch.Tensor, group_ids: torch.Tensor, wanted: int) -> torch.Tensor:
    """``active`` ``[B]`` limited to the first ``wanted`` active groups in row order."""
    keep = torch.zeros_like(active)
    seen: list[int] = []
    for row in range(len(active)):
        if not bool(active[row]):
            continue
        g = int(group_ids[row])
        if g not in seen:
            if len(seen) == wanted:
                continue
            seen.append(g)
        keep[row] = True
    return keep


def concat_rows(traces: list, rows: torch.Tensor):
    """One trace of the ``rows`` (indices into the concatenation) of ``traces`` (same type and
    settings): every per-row field (a tensor or list with the batch as its first axis, or a dict of
    them) is concatenated and indexed; every other field must be equal across ``traces``."""
    first = traces[0]
    n = [t.batch_size for t in traces]
    values = {}
    for f in dataclasses.fields(first):
        parts = [getattr(t, f.name) for t in traces]
        values[f.name] = _rows(f.name, parts, n, rows)
    return type(first)(**values)


def _rows(name: str, parts: list, sizes: list[int], rows: torch.Tensor):
    head = parts[0]
    if isinstance(head, torch.Tensor) and head.dim() and all(p.shape[0] == s for p, s in zip(parts, sizes)):
        return torch.cat(parts)[rows]
    if isinstance(head, list) and all(len(p) == s for p, s in zip(parts, sizes)):
        flat = [x for p in parts for x in p]
        return [flat[int(i)] for i in rows]
    if isinstance(head, dict) and head:
        return {k: _rows(f"{name}.{k}", [p[k] for p in parts], sizes, rows) for k in head}
    for p in parts[1:]:
        same = torch.equal(p, head) if isinstance(head, torch.Tensor) else p == head
        if not same:
            raise ValueError(f"cannot concatenate traces: their {name} differ ({head!r} vs {p!r})")
    return head
