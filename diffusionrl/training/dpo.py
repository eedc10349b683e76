"""The online Diffusion-DPO objective (docs/algorithms.md section 14.5) on the shared trainer.

Rollouts are deterministic (ODE) samples of the live policy. After scoring, the pairs of every
prompt group are formed from the advantages (``algorithm.dpo_pairs``); each pair is trained at T-1
of the rollout's T noise levels, in a random order, winner and loser re-noised with the same level
and the same noise, drawn per pair from ``default_rng`` seeded by ``(train.seed, step, inner epoch,
winner, loser)``: independent of how the pairs are split. One work unit per (chunk of pairs, slot),
counted by its pairs; a chunk holds ``micro_batch_size // 2`` pairs (at least 1) and runs its
winners and losers through the transformer as one batch of at most ``micro_batch_size`` samples,
then the reference (LoRA disabled) on the same batch. Chunks of a step are shuffled per inner
epoch and cut into ``train.minibatches`` optimizer steps.
"""

from __future__ import annotations

import numpy as np
import torch

from diffusionrl.algorithms.awm import flow_matching_error
from diffusionrl.algorithms.dpo import dpo_terms, preference_pairs
from diffusionrl.algorithms.nft import noisy_latents
from diffusionrl.trajectory import Trajectory

from .policy import LoraPolicy
from .trainer import Trainer, Unit, UpdateStats, unit_expert

# Distinct first words of the seed sequences of a step's random streams.
_TIMESTEP_STREAM = 0x44504F54  # "DPOT"
_NOISE_STREAM = 0x44504F4E  # "DPON"
_ORDER_STREAM = 0x44504F4F  # "DPOO"


class DPOObjective:
    """Bradley-Terry preference loss on pairs of one rollout's prompt groups, against the base model."""

    name = "dpo"

    def __init__(self, cfg, policy: LoraPolicy):
        self.cfg = cfg
        self.policy = policy
        self.adapter = policy.adapter
        self.num_train_timesteps = float(self.adapter.scheduler.config.num_train_timesteps)

    def pairs(self, traj: Trajectory, active: torch.Tensor) -> torch.Tensor:
        """``[P, 2]`` (winner, loser) indices from the advantages of the active samples."""
        if traj.advantages is None:
            raise ValueError("DPO needs scored trajectories: traj.advantages is None")
        keep = active.to(torch.bool).cpu()
        adv = torch.where(keep, traj.advantages, torch.zeros_like(traj.advantages))
        pairs = preference_pairs(adv, traj.group_ids, self.cfg.algorithm.dpo_pairs)
        return pairs[keep[pairs].all(dim=1)] if len(pairs) else pairs

    # -- randomness: per pair, independent of the split ---------------------------------------------------
    def slots(self, traj: Trajectory, pair: tuple[int, int], step: int, epoch: int) -> np.ndarray:
        """T-1 of the T non-zero noise levels (indices into ``traj.sigmas``), in random order."""
        seq = [_TIMESTEP_STREAM, self.cfg.train.seed, step, epoch, *pair]
        return np.random.default_rng(seq).permutation(traj.num_steps)[: traj.num_steps - 1]

    def noise(self, traj: Trajectory, pair: tuple[int, int], step: int, epoch: int, slot: int) -> torch.Tensor:
        seq = [_NOISE_STREAM, self.cfg.train.seed, step, epoch, *pair, slot]
        shape = tuple(traj.latents.shape[2:])
        return torch.from_numpy(np.random.default_rng(seq).standard_normal(shape, dtype=np.float32))

    # -- work units --------------------------------------------------------------------------------------
    def chunks(self, pairs: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
        size = max(1, micro_batch_size // 2)
        return [pairs[k : k + size] for k in range(0, len(pairs), size)]

    def units(self, traj: Trajectory, chunks: list[torch.Tensor], step: int, epoch: int) -> list[Unit]:
        units = []
        for chunk in chunks:
            plan = [self.slots(traj, (win, lose), step, epoch) for win, lose in chunk.tolist()]
            for slot in range(traj.num_steps - 1):
                t = traj.sigmas[torch.as_tensor([int(s[slot]) for s in plan], dtype=torch.long)]
                units.append(Unit(float(len(chunk)), self._make(traj, chunk, plan, slot, step, epoch),
                                  unit_expert(self.adapter, t * self.num_train_timesteps)))
        return units

    def errors(self, traj: Trajectory, chunk: torch.Tensor, plan: list[np.ndarray], slot: int, step: int, epoch: int):
        """Policy and reference flow-matching errors ``[p]`` of winners and losers at shared ``t``, ``eps``."""
        device = self.adapter.device
        p = len(chunk)
        idx = torch.cat([chunk[:, 0], chunk[:, 1]])  # [2p]: winners then losers
        t = traj.sigmas[torch.as_tensor([int(s[slot]) for s in plan], dtype=torch.long)]
        eps = torch.stack([self.noise(traj, (win, lose), step, epoch, slot) for win, lose in chunk.tolist()])
        t, eps = torch.cat([t, t]).to(device), torch.cat([eps, eps]).to(device)  # shared by w and l
        x0 = traj.latents[idx, -1].to(device)
        x_t = noisy_latents(x0, eps, t)
        cond = traj.conditioning.select(idx).to(device)
        timestep = t * self.num_train_timesteps
        v = self.adapter.velocity(self.policy.model, x_t, timestep, cond, *traj.guidance)
        with torch.no_grad(), self.policy.reference():
            v_ref = self.adapter.velocity(self.policy.model, x_t, timestep, cond, *traj.guidance)
        err, ref = flow_matching_error(v, x0, eps), flow_matching_error(v_ref, x0, eps)
        return err[:p], err[p:], ref[:p], ref[p:]

    def _make(self, traj, chunk, plan, slot, step, epoch):
        def compute() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            err_w, err_l, ref_w, ref_l = self.errors(traj, chunk, plan, slot, step, epoch)
            terms = dpo_terms(err_w, err_l, ref_w, ref_l, beta=self.cfg.algorithm.dpo_beta)
            with torch.no_grad():
                stats = {
                    "loss": terms.loss.detach().sum(),
                    "policy_loss": terms.loss.detach().sum(),
                    "dpo_margin": terms.inside.detach().sum(),
                    "dpo_accuracy": (terms.inside.detach() > 0).float().sum(),
                    "dpo_err_w": (err_w.detach() - ref_w).sum(),
                    "dpo_err_l": (err_l.detach() - ref_l).sum(),
                }
            return terms.loss.sum(), stats

        return compute

    def train_step(self, trainer: Trainer, traj: Trajectory, active: torch.Tensor, step: int) -> dict[str, float]:
        """Inner epochs x minibatches optimizer steps over the step's pairs (chunk order shuffled per epoch)."""
        train_cfg = self.cfg.train
        pairs = self.pairs(traj, active)
        chunks = self.chunks(pairs, traj.micro_batch_size)
        rng = np.random.default_rng([_ORDER_STREAM, train_cfg.seed, step])
        stats = UpdateStats()
        for epoch in range(train_cfg.inner_epochs):
            order = [chunks[i] for i in rng.permutation(len(chunks))] if chunks else []
            for part in np.array_split(np.arange(len(order)), train_cfg.minibatches):
                if len(part):
                    trainer.apply(self.units(traj, [order[i] for i in part], step, epoch), stats)
        metrics = trainer.global_stats(stats).means()
        metrics["train/lr"] = trainer.lr()
        metrics["train/dpo_pairs"] = float(len(pairs))
        return metrics
