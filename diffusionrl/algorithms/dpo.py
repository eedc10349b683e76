"""Online Diffusion-DPO (docs/algorithms.md section 14.5): preference pairs from group advantages
and the Bradley-Terry loss on flow-matching errors, per pair.

Pairs are formed inside each prompt group of a rollout from its advantages (never across groups):
``best_worst`` takes the highest- against the lowest-advantage sample (one pair per group, the
first index on ties), ``all`` every sample with ``A > 0`` against every one with ``A < 0`` (the
groups' above- against below-mean samples). A group whose rewards are all equal gives no pair.

For a pair (winner w, loser l), both clean latents are re-noised at the *same* noise level ``t``
with the *same* noise ``eps``, and with ``err(x0) = mean |v(x_t, t) - (eps - x0)|^2`` (the
flow-matching error, ``algorithms.awm.flow_matching_error``) for the policy (theta) and the
reference (LoRA disabled):

    inside = -beta / 2 * [ (err_theta(w) - err_ref(w)) - (err_theta(l) - err_ref(l)) ]
    loss   = -log sigmoid(inside)

Diffusion-DPO's loss with the flow-matching error in place of the epsilon error. While the policy
is the reference (the LoRA starts at B = 0) ``inside = 0`` and ``loss = log 2``. The trainer sums
these per-pair values over the pairs of a step and divides once by their count (section 6).

The scale of beta: an Adam step moves a pair's ``(err_w - err_ref_w) - (err_l - err_ref_l)`` by an
amount set by the learning rate ``lr`` and the model, not by beta (Adam normalises the gradient):
~0.01 on tiny-cpu at 64 px and lr 1e-2, so ``|inside|`` grows by ~``beta * lr / 2`` a step. Past
``|inside|`` ~ 3 the sigmoid saturates: on fresh online pairs the margin is then the sign of the
policy's drift from the reference, not of the preference, and the update undoes that drift instead
of learning the reward. Diffusion-DPO's beta = 5000 goes with a full fine-tune at lr 1e-8 x its
batch of 2048 (~2e-5): ``beta * lr`` ~ 0.1. Keep it <~ 0.1 here too (tiny-cpu-dpo: beta 5 at lr
1e-2; 5000 there is 50 and learns nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DPOTerms:
    loss: torch.Tensor  # [P] -log sigmoid(inside)
    inside: torch.Tensor  # [P] the implicit reward margin -beta/2 [(err_w - ref_w) - (err_l - ref_l)]


def preference_pairs(advantages: torch.Tensor, group_ids: torch.Tensor, mode: str = "best_worst") -> torch.Tensor:
    """``[P, 2]`` int64 (winner, loser) sample indices, groups in order of first appearance."""
    adv = advantages.detach().float().reshape(-1).cpu()
    groups = group_ids.reshape(-1).cpu().tolist()
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(int(g), []).append(i)
    pairs: list[tuple[int, int]] = []
    for idx in members.values():
        values = adv[idx]
        if mode == "best_worst":
            win, lose = idx[int(torch.argmax(values))], idx[int(torch.argmin(values))]
            if adv[win] > adv[lose]:
                pairs.append((win, lose))
        elif mode == "all":
            pairs += [(win, lose) for win in idx if adv[win] > 0 for lose in idx if adv[lose] < 0]
        else:
            raise ValueError(f"unknown dpo pair mode {mode!r}; use best_worst | all")
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)


def dpo_terms(
    err_w: torch.Tensor,
    err_l: torch.Tensor,
    ref_err_w: torch.Tensor,
    ref_err_l: torch.Tensor,
    *,
    beta: float,
) -> DPOTerms:
    """The Bradley-Terry loss of P pairs from the policy's and the reference's errors ``[P]``."""
    inside = -0.5 * beta * ((err_w - ref_err_w.detach()) - (err_l - ref_err_l.detach()))
    return DPOTerms(-F.logsigmoid(inside), inside)
