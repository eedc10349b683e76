"""Supervised fine-tuning on (prompt, image) pairs (docs/algorithms.md section 14.7): a warm start
before RL, in the same run loop, checkpoints and LoRA format.

``SFTBackend`` is a ``run.loop.RunLoop`` backend (``diffusionrl.train.build_loop`` picks it for
``algorithm.name=sft``): step ``s`` takes ``train.prompts_per_step * train.group_size`` pairs of
``algorithm.sft_source`` (``data.image_pairs``; epoch-wise permutations seeded by ``(train.seed, epoch)``, the
prompt sampler's), encodes the images with the VAE and the prompts with the text encoders, and
``SFTObjective`` trains the flow-matching loss of the pretraining recipe:

    t ~ logit-normal(0, 1),  x_t = (1 - t) x0 + t eps,  loss = mean |v_theta(x_t, t) - (eps - x0)|^2

without CFG (the conditional velocity is trained; CFG is an inference-time combination). ``t`` and
``eps`` are drawn per sample from ``default_rng`` seeded by ``(train.seed, step, inner epoch, sample)``;
one work unit per micro-batch, counted by its samples (section 6). The LoRA it saves is the peft
folder an RL run starts from with ``algorithm.init_lora``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffusionrl.algorithms.awm import flow_matching_error
from diffusionrl.algorithms.nft import noisy_latents
from diffusionrl.data import PromptSampler
from diffusionrl.run import CheckpointState
from diffusionrl.trajectory import Conditioning

from .policy import LoraPolicy
from .trainer import Trainer, Unit, UpdateStats

_TIME_STREAM = 0x534654  # "SFT"
_NOISE_STREAM = 0x53464E  # "SFN"
_ORDER_STREAM = 0x53464F  # "SFO"
_HELDOUT_KEY = 0x534648  # "SFH": the draws of held_out_loss (a key no (step, epoch) pair has)


@dataclass
class SFTBatch:
    prompts: list[str]
    latents: torch.Tensor  # [B, C, h, w] float32 clean latents of the images
    conditioning: Conditioning  # positive embeddings only (no CFG in training)
    micro_batch_size: int

    def micro_batches(self) -> list[slice]:
        m, b = self.micro_batch_size, len(self.prompts)
        return [slice(k, k + m) for k in range(0, b, m)]


class SFTObjective:
    """The flow-matching loss on encoded (prompt, image) pairs."""

    name = "sft"

    def __init__(self, cfg, policy: LoraPolicy):
        self.cfg = cfg
        self.policy = policy
        self.adapter = policy.adapter
        self.num_train_timesteps = float(self.adapter.scheduler.config.num_train_timesteps)

    def draws(self, rows: range, key: tuple[int, ...], shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sample: ``t`` (logit-normal) ``[n]`` and ``eps`` ``[n, C, h, w]``, float32, keyed by
        ``(train.seed, *key, sample)``; ``key`` is ``(step, inner epoch)`` in training."""
        seed = self.cfg.train.seed
        t = [1 / (1 + np.exp(-np.random.default_rng([_TIME_STREAM, seed, *key, i]).standard_normal()))
             for i in rows]
        eps = [np.random.default_rng([_NOISE_STREAM, seed, *key, i]).standard_normal(shape, dtype=np.float32)
               for i in rows]
        return torch.tensor(t, dtype=torch.float32), torch.from_numpy(np.stack(eps))

    def errors(self, batch: SFTBatch, sl: slice, key: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The flow-matching errors ``[n]`` of the pairs ``sl`` of ``batch`` and their ``t``."""
        device = self.adapter.device
        x0 = batch.latents[sl].to(device)
        t, eps = self.draws(range(sl.start, sl.stop), key, tuple(x0.shape[1:]))
        t, eps = t.to(device), eps.to(device)
        x_t = noisy_latents(x0, eps, t)
        cond = batch.conditioning.select(sl).to(device)
        v = self.adapter.velocity(self.policy.model, x_t, t * self.num_train_timesteps, cond, 1.0)
        return flow_matching_error(v, x0, eps), t

    @torch.no_grad()
    def held_out_loss(self, batch: SFTBatch) -> float:
        """The mean flow-matching loss on ``batch`` (pairs never trained on) at draws keyed by
        ``train.seed`` alone, not by a step: the same pairs score on the same ``t`` and ``eps`` before
        and after training, so the two values compare."""
        errors = [self.errors(batch, sl, (_HELDOUT_KEY,))[0] for sl in batch.micro_batches()]
        return float(torch.cat(errors).mean()) if errors else float("nan")

    def units(self, batch: SFTBatch, chunks: list[slice], step: int, epoch: int) -> list[Unit]:
        return [Unit(float(sl.stop - sl.start), self._make(batch, sl, step, epoch)) for sl in chunks]

    def _make(self, batch: SFTBatch, sl: slice, step: int, epoch: int):
        def compute() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            error, t = self.errors(batch, sl, (step, epoch))
            with torch.no_grad():
                stats = {"loss": error.detach().sum(), "sft_t_mean": t.sum()}
            return error.sum(), stats

        return compute

    def train_step(self, trainer: Trainer, batch: SFTBatch, step: int) -> dict[str, float]:
        """Inner epochs x minibatches optimizer steps; the micro-batch order shuffled per epoch."""
        train_cfg = self.cfg.train
        rng = np.random.default_rng([_ORDER_STREAM, train_cfg.seed, step])
        chunks = batch.micro_batches()
        per = max(1, len(chunks) // train_cfg.minibatches)
        stats = UpdateStats()
        for epoch in range(train_cfg.inner_epochs):
            order = [chunks[i] for i in rng.permutation(len(chunks))]
            for k in range(0, len(order), per):
                trainer.apply(self.units(batch, order[k : k + per], step, epoch), stats)
        metrics = stats.means()
        metrics["train/policy_loss"] = metrics.get("train/loss", float("nan"))
        metrics["train/lr"] = trainer.lr()
        return metrics


class _NoEngine:
    """SFT samples nothing: the worker's engine slot, without a copy of the transformer."""

    def update_weights(self, lora_state, version) -> None:
        pass

    def close(self) -> None:
        pass


class SFTBackend:
    """Pairs -> VAE latents -> flow-matching update, over a ``LocalPolicyWorker``."""

    progress_label = "sft"
    restore_rng = True

    def __init__(self, cfg, out_dir: str | Path, worker, rows: list[dict[str, Any]]):
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.worker = worker
        train_cfg = cfg.train
        self.sampler = PromptSampler(rows, train_cfg.prompts_per_step * train_cfg.group_size, train_cfg.seed)
        self.cursor = 0

    @staticmethod
    def no_engine(*args, **kwargs) -> _NoEngine:
        return _NoEngine()

    def metadata(self) -> dict[str, Any]:
        from diffusionrl.models.families import lora_suffixes

        cfg = self.cfg
        return {
            "model": cfg.model.name,
            "model_digest": self.worker.digest(),
            "algorithm": "sft",
            "sft_source": cfg.algorithm.sft_source,
            "lora": {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha,
                     "targets": lora_suffixes(cfg.model)},
        }

    def start(self) -> None:
        pass

    @torch.no_grad()
    def encode(self, rows: list[dict[str, Any]]) -> SFTBatch:
        adapter, cfg = self.worker.adapter, self.cfg
        prompts = [r["prompt"] for r in rows]
        latents = torch.cat([adapter.encode_images(np.stack([r["image"] for r in rows[k : k + 8]]))
                             for k in range(0, len(rows), 8)]).cpu()
        cond = adapter.encode_prompts(prompts, None, cfg.model.max_sequence_length).to("cpu")
        return SFTBatch(prompts, latents, cond, cfg.train.micro_batch_size)

    def run_step(self, step: int) -> tuple[SFTBatch, dict[str, float]]:
        t0 = time.perf_counter()
        rows, self.cursor = self.sampler.batch(step)
        batch = self.encode(rows)
        self.worker.trainer.begin_step(step)
        metrics = self.worker.objective.train_step(self.worker.trainer, batch, step)
        metrics.update({"perf/step_time": time.perf_counter() - t0, "step": float(step + 1),
                        "policy_version": float(step + 1)})
        return batch, metrics

    def state(self, step: int) -> CheckpointState:
        extra = {"data_cursor": self.cursor, "config_digest": self.cfg.digest()}
        return CheckpointState(step=step, policy_version=step, metadata=self.metadata(), extra=extra,
                               **self.worker.checkpoint_parts())

    def load_state(self, state: CheckpointState) -> None:
        self.worker.load_checkpoint_parts(state)
        self.cursor = int(state.extra.get("data_cursor", 0))

    def save_outputs(self, step: int) -> tuple[Path, dict[str, Path]]:
        info = {"base_model": self.cfg.model.name, "base_model_revision": self.cfg.model.revision,
                "base_model_digest": self.worker.digest(), "step": step, "algorithm": "sft",
                "sft_source": self.cfg.algorithm.sft_source, "config_digest": self.cfg.digest()}
        return self.worker.save_lora(self.out_dir, info)

    def close(self) -> None:
        self.worker.close()
