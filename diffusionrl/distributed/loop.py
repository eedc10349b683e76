"""``DistributedRLLoop``: the RL loop with the trainer as ``train.world_size`` Ray actors.

The driver (the Flyte Ray task's process) keeps what is cheap and global: prompt sampling, reward
scoring (Ray CPU actors), advantages, metrics, checkpoints. Per step:

1. rollout: each engine rank samples its share of whole blocks (``shards.assign_blocks``); the
   driver concatenates the shares (same per-sample seeds and micro-batches as one process);
2. score + advantages over the whole batch (global std);
3. update: the driver replays the single-process schedule (``worker.grpo_plan``), each rank
   trains on its share; metrics are reduced over ranks;
4. push: every rank joins the LoRA gather, engine ranks push it to their engine (CUDA IPC when
   colocated on a GPU, by value otherwise) and report the push time.

Everything else (``run``, ``run_step``, metrics files, callbacks) is ``RLLoop``'s.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from diffusionrl.config import Config
from diffusionrl.data import PromptSampler, PromptSet, load_prompts
from diffusionrl.rewards import make_scorer
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.training.checkpoint import (
    CheckpointState,
    check_metadata,
    load_checkpoint,
)
from diffusionrl.training.loop import RLLoop, _read_metrics, prompt_validator

from .group import node_address_and_port
from .placement import build_placement
from .shards import assign_blocks, cat_trajectories, select_samples
from .worker import TrainerRank, grpo_plan

log = logging.getLogger(__name__)


class DistributedRLLoop(RLLoop):
    def __init__(self, cfg: Config, out_dir: str | Path, prompts: PromptSet | None = None,
                 callbacks: list[Any] | None = None, progress: bool | None = None, model_path: str | None = None,
                 threads_per_rank: int = 1):
        import ray

        from diffusionrl.rewards.pool import ensure_ray

        if cfg.algorithm.name != "flow_grpo":
            raise ValueError(
                f"train.world_size={cfg.train.world_size} supports algorithm.name=flow_grpo today, not "
                f"{cfg.algorithm.name!r}; train {cfg.algorithm.name} with world_size=1"
            )
        self.cfg = cfg
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.callbacks = list(callbacks or [])
        self.progress = progress
        self.prompts = prompts if prompts is not None else load_prompts(cfg.data, validate=prompt_validator(cfg.reward))
        tc = cfg.train
        ensure_ray(max(2, tc.world_size * tc.cpus_per_bundle + cfg.reward.num_actors))
        self.placement = build_placement(tc)
        addr, port = node_address_and_port()
        cls = ray.remote(TrainerRank)
        self.ranks = [
            cls.options(**self.placement.trainer_options(r, tc)).remote(
                cfg.to_dict(), r, tc.world_size, addr, port, r < tc.rollout_engines, model_path, threads_per_rank
            )
            for r in range(tc.world_size)
        ]
        self.infos = ray.get([rank.info.remote() for rank in self.ranks])
        if len({i["digest"] for i in self.infos}) != 1:
            raise RuntimeError(f"trainer ranks loaded different base weights: {self.infos}")
        self._digest = self.infos[0]["digest"]
        self.scorer = make_scorer(cfg.reward)
        self.sampler = PromptSampler(self.prompts.train, tc.prompts_per_step, tc.seed)
        self.spec = SamplingSpec.from_config(cfg)
        self.step = 0
        self.version = 0
        self.cursor = 0
        self.history: list[dict[str, float]] = []
        self.last_push_s: list[float] = []

    # -- identity --------------------------------------------------------------------------------
    @property
    def adapter(self):  # RLLoop.metadata() asks the adapter for the digest only
        return self

    def digest(self) -> str:
        return self._digest

    def _all(self, method: str, *args) -> list:
        import ray

        return ray.get([getattr(rank, method).remote(*args) for rank in self.ranks])

    # -- one step ------------------------------------------------------------------------------------
    def rollout(self, step: int):
        import ray

        prompts, group_ids, seeds, mask, metadata = self.sample_batch(step)
        tc = self.cfg.train
        shares = assign_blocks(len(prompts), tc.group_size, tc.micro_batch_size, tc.rollout_engines)
        refs = [
            self.ranks[e].rollout.remote(prompts[sl], group_ids[sl], seeds[sl], self.spec, mask[sl],
                                         metadata[sl])
            for e, sl in enumerate(shares)
        ]
        return cat_trajectories(ray.get(refs))

    def update(self, traj, active: torch.Tensor, step: int) -> dict[str, float]:
        import ray

        tc = self.cfg.train
        plan = grpo_plan(traj, active, tc, step)
        shares = assign_blocks(traj.batch_size, tc.group_size, tc.micro_batch_size, tc.world_size)
        m = traj.micro_batch_size
        refs = [
            rank.train_step.remote(select_samples(traj, sl), active[sl], plan, sl.start // m, step)
            for rank, sl in zip(self.ranks, shares)
        ]
        return ray.get(refs)[0]

    def push_weights(self, version: int) -> None:
        times = self._all("push_weights", version)
        self.last_push_s = times[: self.cfg.train.rollout_engines]
        self.version = version

    def objective_rollout_state(self) -> dict[str, torch.Tensor]:
        return self._all("lora_state")[0]

    # -- checkpoints ---------------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        tensors = {}
        ema = self._all("ema_state")[0]
        if ema is not None:
            tensors["ema"] = ema
        state = CheckpointState(
            step=self.step,
            policy_version=self.version,
            metadata=self.metadata(),
            lora=self._all("lora_state")[0],
            optimizer=self._all("optimizer_state")[0],
            scaler=self._all("scaler_state")[0],
            tensors=tensors,
            extra={"data_cursor": self.cursor, "config_digest": self.cfg.digest(), "world_size": self.cfg.train.world_size},
        )
        return self.write_checkpoint(state)

    def restore(self, path: str | Path) -> None:
        """Resume (also from a single-process checkpoint: the formats are the same)."""
        state = load_checkpoint(path)
        check_metadata(state.metadata, self.metadata(), str(path))
        self._all("load_lora_state", state.lora)
        self._all("load_optimizer_state", state.optimizer)
        self._all("load_scaler_state", state.scaler)
        if "ema" in state.tensors:
            self._all("load_ema_state", state.tensors["ema"])
        self.step = state.step
        self.cursor = int(state.extra.get("data_cursor", 0))
        self.history = _read_metrics(self.out_dir / "metrics.jsonl", upto=self.step)
        self.push_weights(state.policy_version)
        log.info("resumed from %s at step %d", path, self.step)

    def save_lora(self) -> tuple[Path, dict[str, Path]]:
        from safetensors.torch import save_file

        info = {
            "base_model": self.cfg.model.name,
            "base_model_revision": self.cfg.model.revision,
            "base_model_digest": self._digest,
            "step": self.step,
            "algorithm": self.cfg.algorithm.name,
            "config_digest": self.cfg.digest(),
            "world_size": self.cfg.train.world_size,
        }
        peft_config = self._all("peft_config")[0]

        def write(folder: Path, tensors: dict[str, torch.Tensor], extra: dict) -> Path:
            folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(folder / "adapter_model.safetensors"))
            peft_config.save_pretrained(str(folder))
            (folder / "diffusionrl.json").write_text(json.dumps({**info, **extra}, indent=1))
            return folder

        out = write(self.out_dir / "lora", self._all("peft_state")[0], {})
        extra = {}
        ema = self._all("ema_state")[0]
        if ema is not None:
            extra["ema"] = write(self.out_dir / "lora_ema", self._all("peft_state", ema)[0],
                                 {"ema_decay": self.cfg.train.ema_decay})
        return out, extra

    def run_step(self, step: int) -> dict[str, float]:
        metrics = super().run_step(step)
        if self.last_push_s:
            metrics["perf/update_weights_push_time"] = max(self.last_push_s)
        return metrics

    def close(self) -> None:
        import ray

        try:
            ray.get([rank.close.remote() for rank in self.ranks], timeout=60)
        except Exception as exc:  # noqa: BLE001 - best effort at shutdown
            log.warning("closing trainer ranks: %s", exc)
        for rank in self.ranks:
            ray.kill(rank)
        self.placement.remove()
        close = getattr(self.scorer, "close", None)
        if close:
            close()


def train_distributed(cfg: Config, out_dir: str | Path, resume: str | Path | None = "auto", **kw):
    loop = DistributedRLLoop(cfg, out_dir, **kw)
    try:
        return loop.run(resume=resume)
    finally:
        loop.close()
