"""``RankGroup``: the policy side of an image run as ``train.world_size`` trainer ranks in Ray actors.

It has the interface of ``training.local_worker.LocalPolicyWorker`` so that
``training.backend.ImageBackend`` drives either, for every objective but ``sft``; the driver (the
Flyte Ray task's process) keeps what is cheap and global: prompt sampling, reward scoring (Ray CPU
actors), advantages, metrics, checkpoints. Per step:

1. rollout: each engine rank samples its share of whole blocks (``shards.assign_blocks``); the
   driver concatenates the shares (same per-sample seeds and micro-batches as one process);
2. score + advantages over the whole batch (global std), in the backend;
3. update: the scored batch goes once into the object store and every rank runs the objective's
   step on it, computing its share of each optimizer step's units (``worker.deal``); metrics are
   reduced over ranks;
4. push: every rank joins the gather of the LoRA the engines sample with (the live policy, or
   NFT's old policy), engine ranks push it to their engine (CUDA IPC when colocated on a GPU, by
   value otherwise) and report the push time.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from diffusionrl import raycluster
from diffusionrl.config import RANKED, objective
from diffusionrl.run import CheckpointState

from .group import node_address_and_port
from .placement import build_placement
from .shards import assign_blocks, cat_trajectories
from .worker import TrainerRank

log = logging.getLogger(__name__)


class RankGroup:
    """``train.world_size`` ``TrainerRank`` actors placed by ``placement.build_placement``."""

    def __init__(self, cfg, model_path: str | None = None, threads_per_rank: int = 1, engine_factory=None):
        import ray

        if not objective(cfg.algorithm.name).ranks:
            raise ValueError(
                f"train.world_size={cfg.train.world_size} runs algorithm.name={'/'.join(RANKED)}, not "
                f"{cfg.algorithm.name!r}; train {cfg.algorithm.name} with world_size=1"
            )
        from diffusionrl.training.preflight import check_inputs

        check_inputs(cfg, model_path)  # here, in one line, not as a traceback from every rank's actor
        self.cfg = cfg
        train_cfg = cfg.train
        # A Ray this group starts is sized for it: it stops with the group (a later run in the same process,
        # with more ranks, starts its own instead of finding this one too small).
        self.started_ray = raycluster.ensure_ray(
            max(2, train_cfg.world_size * train_cfg.cpus_per_bundle + cfg.reward.num_actors))
        try:
            self.placement = build_placement(train_cfg)
        except BaseException:
            self.started_ray = raycluster.release_ray(self.started_ray)
            raise
        addr, port = node_address_and_port()
        cls = ray.remote(TrainerRank)
        self.ranks = [
            cls.options(**self.placement.trainer_options(r, train_cfg)).remote(
                cfg.to_dict(), r, train_cfg.world_size, addr, port, r < train_cfg.rollout_engines, model_path,
                threads_per_rank, engine_factory,
            )
            for r in range(train_cfg.world_size)
        ]
        # The group holds their resources: what is left to wait for is each rank loading its model.
        loading = raycluster.Admission(f"{train_cfg.world_size} trainer ranks",
                                       raycluster.seconds(raycluster.START_TIMEOUT_ENV))
        try:
            self.infos = raycluster.started([rank.info.remote() for rank in self.ranks], loading)
        except BaseException:
            self.close()
            raise
        if len({i["digest"] for i in self.infos}) != 1:
            self.close()
            raise RuntimeError(f"trainer ranks loaded different base weights: {self.infos}")
        self._digest = self.infos[0]["digest"]

    def _all(self, method: str, *args) -> list:
        return raycluster.get([getattr(rank, method).remote(*args) for rank in self.ranks], f"trainer ranks' {method}")

    def digest(self) -> str:
        return self._digest

    def info(self) -> dict[str, Any]:
        return {"world_size": self.cfg.train.world_size}

    # -- one step ----------------------------------------------------------------------------------
    def generate(self, prompts, group_ids, seeds, spec, mask, metadata):
        train_cfg = self.cfg.train
        shares = assign_blocks(len(prompts), train_cfg.group_size, train_cfg.micro_batch_size,
                               train_cfg.rollout_engines)
        refs = [
            self.ranks[e].rollout.remote(prompts[sl], group_ids[sl], seeds[sl], spec,
                                         None if mask is None else mask[sl], metadata[sl])
            for e, sl in enumerate(shares)
        ]
        return cat_trajectories(raycluster.get(refs, "rollout on the engine ranks"))

    def train_step(self, traj, active: torch.Tensor, step: int) -> dict[str, float]:
        import ray

        batch = ray.put(traj)  # one copy in the object store, read by every rank
        return self._all("train_step", batch, active, step)[0]

    def push_weights(self, version: int) -> dict[str, float]:
        times = self._all("push_weights", version)[: self.cfg.train.rollout_engines]
        return {"perf/update_weights_push_time": max(times)} if times else {}

    # -- checkpoint state --------------------------------------------------------------------------
    def checkpoint_parts(self) -> dict[str, Any]:
        """The gathered format (full tensors, written by the driver), or with ``train.checkpoint_format=sharded``
        a writer that has every rank write its shards (``distributed.sharded``)."""
        scaler = self._all("scaler_state")[0]
        if self.cfg.train.checkpoint_format == "sharded":
            from .sharded import write_from_ranks

            def write(folder: Path) -> dict[str, Any]:
                return write_from_ranks(self._all, folder, len(self.ranks))

            return {"lora": {}, "optimizer": {}, "scaler": scaler, "tensors": {}, "write_shards": write}
        ema = self._all("ema_state")[0]
        tensors = {"ema": ema} if ema is not None else {}
        tensors.update(self._all("objective_state")[0])
        return {"lora": self._all("lora_state")[0], "optimizer": self._all("optimizer_state")[0],
                "scaler": scaler, "tensors": tensors}

    def load_checkpoint_parts(self, state: CheckpointState) -> None:
        """Either format, whatever world size wrote it (a gathered checkpoint is one process's format; a
        sharded one is resharded by DCP)."""
        self._all("load_scaler_state", state.scaler)
        if state.sharded is not None:
            from .sharded import load_on_ranks

            return load_on_ranks(self._all, state.sharded)
        self._all("load_lora_state", state.lora)
        self._all("load_optimizer_state", state.optimizer)
        if "ema" in state.tensors:
            self._all("load_ema_state", state.tensors["ema"])
        self._all("load_objective_state", {k: v for k, v in state.tensors.items() if k != "ema"})

    # -- outputs -----------------------------------------------------------------------------------
    def save_lora(self, out_dir: Path, info: dict[str, Any]) -> tuple[Path, dict[str, Path]]:
        from safetensors.torch import save_file

        from diffusionrl.serving.model_card import adapter_facts, describe_folder

        rank0 = self.infos[0]
        info = {**info, **adapter_facts(self.cfg, rank0["family"], rank0["pipeline_class"])}
        if self.cfg.model.finetune == "full":  # every rank joins the gather; the driver writes the folders
            from diffusionrl.training.full import write_full_outputs

            parts, state = self._all("full_model")[0]
            ema = self._all("full_model", True)[0][1] if self.cfg.train.ema else None
            return write_full_outputs(parts, state, ema, out_dir, info, self.cfg.train.ema_decay)
        peft_config = self._all("peft_config")[0]

        def write(folder: Path, tensors: dict[str, torch.Tensor], extra: dict) -> Path:
            folder.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(folder / "adapter_model.safetensors"))
            peft_config.save_pretrained(str(folder))
            describe_folder(folder, {**info, **extra})
            return folder

        out = write(out_dir / "lora", self._all("peft_state")[0], {})
        extra = {}
        ema = self._all("ema_state")[0]
        if ema is not None:
            extra["ema"] = write(out_dir / "lora_ema", self._all("peft_state", ema)[0],
                                 {"ema_decay": self.cfg.train.ema_decay})
        return out, extra

    def close(self) -> None:
        import ray

        try:
            ray.get([rank.close.remote() for rank in self.ranks], timeout=60)
        except Exception as exc:  # best effort at shutdown
            log.warning("closing trainer ranks: %s", exc)
        for rank in self.ranks:
            ray.kill(rank)
        self.placement.remove()
        self.started_ray = raycluster.release_ray(self.started_ray)
