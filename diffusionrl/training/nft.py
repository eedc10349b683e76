"""The DiffusionNFT objective (docs/algorithms.md section 7) on the shared trainer.

Rollouts are deterministic (ODE) samples of the *old* policy ``theta_old``, an EMA of the trained
LoRA that this objective owns: ``rollout_state()`` hands it to the engine, ``state_tensors()`` /
``load_state_tensors()`` carry it through checkpoints. Each sample's clean latent ``x0`` is
re-noised at T-1 of the rollout's T noise levels, in a random order per sample, and the NFT loss
compares the trained velocity ``v_theta`` with the old one ``v_old`` at each of them.

One work unit per (micro-batch, timestep slot), counted by the micro-batch's active samples, so
the trainer's sum / count rule makes the gradient independent of the micro-batch split. The
micro-batches keep the rollout's composition (SD3 outputs depend on the batch they ran in).
Timesteps and noises are drawn per sample from ``numpy.random.default_rng`` seeded by
``(train.seed, step, inner epoch, sample index)`` (the prompt group id instead with
``algorithm.group_renoise``: a group shares its draws): a resumed run draws what the uninterrupted run
drew, however the batch is split.

``v_old`` is computed by the policy's own network with the old LoRA tensors copied in for that
forward (and the live ones copied back before the trained forward): one set of layers, exact
copies, no second adapter whose ``requires_grad`` flags peft would manage.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from diffusionrl.algorithms.nft import nft_terms, noisy_latents, old_policy_eta
from diffusionrl.run import CheckpointMismatch
from diffusionrl.trajectory import Trajectory

from .policy import EMA, LoraPolicy
from .trainer import Trainer, Unit, UpdateStats, minibatch_schedule, unit_expert

# Distinct first words of the seed sequences, so each random stream of a step is its own.
_TIMESTEP_STREAM = 0x4E4654  # "NFT"
_NOISE_STREAM = 0x4E4F4953  # "NOIS"
_ORDER_STREAM = 0x4F524452  # "ORDR"


@dataclass
class TimestepPlan:
    """The noise levels and noises of one inner epoch of one step.

    Per sample, ``slots`` = T-1 of the rollout's T noise levels ``sigmas[0..T-1]`` (never the final
    0) in random order, or the first K of that order (DiffusionNFT's ``algorithm.nft_timesteps``),
    and one Gaussian noise per (sample, slot), drawn when a unit needs it.
    """

    seed: int
    step: int
    epoch: int
    indices: np.ndarray  # [B, K] int: indices into traj.sigmas, K = T - 1, random order per sample
    shape: tuple[int, ...]  # latent shape (C, H, W)

    keys: np.ndarray  # [B] int: the key of each sample's draws (its index, or its group id when shared)

    @classmethod
    def draw(cls, seed: int, step: int, epoch: int, keys: np.ndarray, num_steps: int,
             shape: tuple[int, ...], slots: int = 0) -> TimestepPlan:
        """``keys[i]`` seeds sample i's noise levels and noises: samples with one key draw the same.
        ``slots`` of them per sample (0: all T - 1), the first of the same random order."""
        slots = slots or num_steps - 1
        keys = np.asarray(keys, dtype=np.int64)
        rows = [
            np.random.default_rng([_TIMESTEP_STREAM, seed, step, epoch, int(k)]).permutation(num_steps)[:slots]
            for k in keys
        ]
        return cls(seed, step, epoch, np.stack(rows), tuple(shape), keys)

    @property
    def slots(self) -> int:
        return int(self.indices.shape[1])

    def noise(self, rows: range, slot: int) -> torch.Tensor:
        """``[len(rows), C, H, W]`` float32 standard normal noise of samples ``rows`` at ``slot``."""
        draws = [
            np.random.default_rng([_NOISE_STREAM, self.seed, self.step, self.epoch, int(self.keys[i]), slot])
            .standard_normal(self.shape, dtype=np.float32)
            for i in rows
        ]
        return torch.from_numpy(np.stack(draws))


class RenoisedUnits:
    """Work units and RL step of objectives that re-noise each sample's clean rollout latent ``x0`` at
    the slots of a ``TimestepPlan`` (DiffusionNFT, AWM): one unit per (micro-batch, slot), counted by
    the micro-batch's active samples; micro-batches without one are skipped. A subclass sets
    ``label`` and ``order_stream`` (the first word of its micro-batch order's seed), builds a unit's
    loss in ``_make(traj, sl, slot, mask, plan)`` and may add metrics after a step in ``after_step``."""

    label = "this objective"
    order_stream = _ORDER_STREAM

    def __init__(self, cfg, policy: LoraPolicy):
        self.cfg = cfg
        self.policy = policy
        self.adapter = policy.adapter
        # The timestep the transformer sees at noise level t (SD3: t * 1000).
        self.num_train_timesteps = float(self.adapter.scheduler.config.num_train_timesteps)

    def plan(self, traj: Trajectory, step: int, epoch: int) -> TimestepPlan:
        """Each sample's draws keyed by its index, or by its prompt group (``algorithm.group_renoise``)."""
        shape = tuple(traj.latents.shape[2:])
        keys = traj.group_ids.numpy() if self.cfg.algorithm.group_renoise else np.arange(traj.batch_size)
        return TimestepPlan.draw(self.cfg.train.seed, step, epoch, keys, traj.num_steps, shape, self.train_slots())

    def train_slots(self) -> int:
        """Noise levels trained per sample and step (0: all T - 1)."""
        return 0

    def units(self, traj: Trajectory, chunks: list[slice], active: torch.Tensor, plan: TimestepPlan) -> list[Unit]:
        if traj.advantages is None:
            raise ValueError(f"{self.label} needs scored trajectories: traj.advantages is None")
        units: list[Unit] = []
        for sl in chunks:
            mask = active[sl].to(torch.bool)  # [m]
            count = float(mask.sum())
            if count == 0:
                continue
            for slot in range(plan.slots):
                t = traj.sigmas[torch.as_tensor(plan.indices[sl, slot], dtype=torch.long)] * self.num_train_timesteps
                units.append(Unit(count, self._make(traj, sl, slot, mask, plan), unit_expert(self.adapter, t)))
        return units

    def noised(self, traj: Trajectory, sl: slice, slot: int, plan: TimestepPlan):
        """``x0``, ``eps``, ``t`` and ``x_t`` of micro-batch ``sl`` at ``slot`` (on the device)."""
        device = self.adapter.device
        x0 = traj.latents[sl, -1].to(device)  # [m, C, H, W] clean final latents
        t = traj.sigmas[torch.as_tensor(plan.indices[sl, slot], dtype=torch.long)].to(device)  # [m] noise levels
        eps = plan.noise(range(sl.start, sl.stop), slot).to(device)  # [m, C, H, W]
        return x0, eps, t, noisy_latents(x0, eps, t)

    def train_step(self, trainer: Trainer, traj: Trajectory, active: torch.Tensor, step: int) -> dict[str, float]:
        """Inner epochs x minibatches optimizer steps on one rollout, then ``after_step``.

        Each inner epoch draws fresh timesteps and noises; the micro-batch order is shuffled
        (composition kept).
        """
        train_cfg = self.cfg.train
        rng = np.random.default_rng([self.order_stream, train_cfg.seed, step])
        stats = UpdateStats()
        plan = None
        for epoch, selected in minibatch_schedule(traj, train_cfg, rng):
            if plan is None or plan.epoch != epoch:
                plan = self.plan(traj, step, epoch)
            trainer.apply(self.units(traj, selected, active, plan), stats)
        metrics = trainer.global_stats(stats).means()
        metrics["train/lr"] = trainer.lr()
        metrics.update(self.after_step(step))
        return metrics

    def after_step(self, step: int) -> dict[str, float]:
        """What happens after step ``step``'s updates (its metrics); nothing by default."""
        return {}


class NFTObjective(RenoisedUnits):
    """DiffusionNFT: likelihood-free policy improvement against an EMA old policy."""

    name = "nft"
    label = "DiffusionNFT"

    def __init__(self, cfg, policy: LoraPolicy):
        super().__init__(cfg, policy)
        self.old = EMA(policy.lora_state(), decay=0.0)  # theta_old starts equal to theta

    def train_slots(self) -> int:
        return self.cfg.algorithm.nft_timesteps

    # -- the old policy ----------------------------------------------------------------------------
    def rollout_state(self) -> dict[str, torch.Tensor]:
        """The LoRA the rollout engine samples with: the old policy, keyed like ``lora_state()``."""
        return self.old.state()

    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"old": self.old.state()}

    def load_state_tensors(self, groups: dict[str, dict[str, torch.Tensor]]) -> None:
        if "old" not in groups:
            raise CheckpointMismatch(
                f"the checkpoint has no old-policy tensors (groups: {sorted(groups)}); it was not written "
                "by a DiffusionNFT run: start a fresh run or resume with the checkpoint's algorithm"
            )
        state = groups["old"]
        missing, unknown = set(self.policy.params) - set(state), set(state) - set(self.policy.params)
        if missing or unknown:
            raise CheckpointMismatch(
                f"old-policy tensors do not match the LoRA: {len(missing)} missing, {len(unknown)} unknown"
            )
        self.old.shadow = {
            n: state[n].to(device=p.device, dtype=torch.float32).clone() for n, p in self.policy.params.items()
        }

    def update_old_policy(self, steps_done: int) -> float:
        """``theta_old <- eta * theta_old + (1 - eta) * theta`` after ``steps_done`` RL steps.

        ``eta = min(rate * max(steps_done - flat, 0), cap)``: ``steps_done`` counts completed
        steps (1 after the first), as the reference counts optimizer steps with one per rollout.
        """
        algo_cfg = self.cfg.algorithm
        eta = old_policy_eta(steps_done, algo_cfg.old_policy_rate, algo_cfg.old_policy_flat, algo_cfg.old_policy_cap)
        self.old.update(self.policy.params, decay=eta)
        return eta

    @contextlib.contextmanager
    def old_weights(self):
        """Inside: the policy network carries the old LoRA tensors (use under ``no_grad``)."""
        live = self.policy.lora_state()
        self.policy.load_lora_state(self.old.shadow)
        try:
            yield
        finally:
            self.policy.load_lora_state(live)

    # -- work units: plan, units and noised come from RenoisedUnits ------------------------------------
    def _make(self, traj: Trajectory, sl: slice, slot: int, mask: torch.Tensor, plan: TimestepPlan):
        def compute() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            algo_cfg = self.cfg.algorithm
            device = self.adapter.device
            model, g = self.policy.model, traj.guidance
            x0, eps, t, x_t = self.noised(traj, sl, slot, plan)
            timestep = t * self.num_train_timesteps  # [m]
            cond = traj.conditioning.select(sl).to(device)
            with torch.no_grad(), self.old_weights():
                v_old = self.adapter.velocity(model, x_t, timestep, cond, *g)
            v = self.adapter.velocity(model, x_t, timestep, cond, *g)
            v_ref = None
            if algo_cfg.kl_beta > 0:
                with torch.no_grad(), self.policy.reference():
                    v_ref = self.adapter.velocity(model, x_t, timestep, cond, *g)
            terms = nft_terms(
                v, v_old, x0, x_t, t, traj.advantages[sl].to(device),
                beta=algo_cfg.nft_beta, adv_clip=algo_cfg.nft_adv_clip, kl_beta=algo_cfg.kl_beta, v_ref=v_ref,
            )
            m = mask.to(device).float()
            with torch.no_grad():  # sums over the active samples; the trainer divides by the counts
                deviate = ((v.detach() - v_old) ** 2).mean(dim=tuple(range(1, v.ndim)))
                stats = {
                    "nft_loss": (terms.policy_loss.detach() * m).sum(),
                    "nft_pos": (terms.positive.detach() * m).sum(),
                    "nft_neg": (terms.negative.detach() * m).sum(),
                    "nft_r_mean": (terms.r * m).sum(),
                    "nft_old_deviate": (deviate * m).sum(),
                    "kl_loss": (terms.kl.detach() * m).sum(),
                    "loss": (terms.loss.detach() * m).sum(),
                }
            return (terms.loss * m).sum(), stats

        return compute

    # -- after one RL step (train_step: RenoisedUnits) ---------------------------------------------
    def after_step(self, step: int) -> dict[str, float]:
        """The old-policy update after step ``step``'s optimizer steps."""
        return {"train/old_policy_eta": self.update_old_policy(step + 1)}
