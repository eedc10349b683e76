"""Time of one policy update on 1, 2 and 4 gloo FSDP ranks, side by side, and the share of it spent in
collectives, for flow_grpo and nft on the tiny SD3 (CPU).

One scored rollout (the preset's batch) is trained on by one process (``Trainer`` + the objective, what
``train.world_size=1`` runs) and by groups of W ``TrainerRank`` Ray actors (one thread each), every rank
running the objective's step on the whole batch and computing its share of the units
(``distributed.worker.deal``). Each timing is the median of ``--repeats`` steps after one warm-up step;
ranks report their wall time and the time inside torch.distributed collectives (torch.profiler,
``c10d``/``gloo`` events). The LoRA is reset before every step (``TrainerRank.reset``), so every step
does the same work. Also printed: the bytes the engines receive per step, of the LoRA and, with
``model.finetune=full``, of every transformer weight (fp32).

    python bench/ranks.py [--objectives flow_grpo,nft] [--world-sizes 1,2,4] [--repeats 3] [--set k=v ...]

On a machine with fewer cores than ranks the ranks share cores: the ratios then show the overhead of
ranks, not their speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common  # sets sys.path and offline env
import numpy as np
import torch

from diffusionrl.config import load_config

OBJECTIVE_KEYS = {"flow_grpo": [], "nft": ["algorithm.name=nft", "algorithm.kl_beta=0.0001"]}


def scored_batch(cfg, adapter, policy, ode: bool):
    from diffusionrl.algorithms.sde import sde_step_mask
    from diffusionrl.rollout.base import SamplingSpec
    from diffusionrl.rollout.local import LocalRolloutEngine

    train_cfg = cfg.train
    b = train_cfg.prompts_per_step * train_cfg.group_size
    engine = LocalRolloutEngine(adapter, policy.engine_copy(), train_cfg.micro_batch_size)
    rng = np.random.default_rng(0)
    sampling = cfg.sampling
    mask = sde_step_mask(sampling.step_strategy, sampling.num_steps, np.arange(train_cfg.prompts_per_step),
                         num_sde_steps=sampling.num_sde_steps,
                         window_range=sampling.window_range, seed=train_cfg.seed)
    mask = np.repeat(mask, train_cfg.group_size, axis=0)
    spec = SamplingSpec.from_config(cfg, **({"sde_type": "ode"} if ode else {}))
    group_ids = torch.arange(b) // train_cfg.group_size
    traj = engine.generate([f"a photo of object {int(g)}" for g in group_ids], group_ids, torch.arange(b) + 7,
                           spec, mask, None)
    adv = torch.from_numpy(rng.standard_normal(b).astype(np.float32))
    return traj.with_rewards(adv.clone(), {}, adv), torch.ones(b, dtype=torch.bool)


def profiled_rank_class():
    import ray

    from diffusionrl.distributed.worker import TrainerRank

    class ProfiledRank(TrainerRank):
        def timed_step(self, traj, active) -> dict[str, float]:
            from torch.profiler import ProfilerActivity, profile

            self.reset(self.cfg.to_dict())
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                self.trainer.begin_step(0)
                self.objective.train_step(self.trainer, traj, active, 0)
                wall = time.perf_counter() - t0
            comm = sum(e.self_cpu_time_total for e in prof.key_averages()
                       if any(k in e.key.lower() for k in ("c10d", "gloo", "all_gather", "reduce_scatter",
                                                           "all_reduce", "allreduce", "allgather")))
            return {"wall_s": wall, "collective_s": comm / 1e6}

    return ray.remote(ProfiledRank)


def one_process(cfg, policy, start, traj, active, repeats: int) -> float:
    from diffusionrl.training.objective import build_objective
    from diffusionrl.training.trainer import Trainer

    times = []
    for _ in range(repeats + 1):
        policy.load_lora_state(start)
        trainer, objective = Trainer(cfg, policy), build_objective(cfg, policy)
        t0 = time.perf_counter()
        trainer.begin_step(0)
        objective.train_step(trainer, traj, active, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def ranks(cfg, world_size: int, traj, active, repeats: int) -> dict[str, float]:
    import ray

    from diffusionrl.distributed.group import node_address_and_port
    from diffusionrl.distributed.placement import build_placement

    cls = profiled_rank_class()
    placement = build_placement(cfg.train)
    addr, port = node_address_and_port()
    group = [cls.options(**placement.trainer_options(r, cfg.train)).remote(cfg.to_dict(), r, world_size, addr, port)
             for r in range(world_size)]
    try:
        ray.get([r.mark_start.remote() for r in group])
        batch = ray.put(traj)
        rows = [ray.get([r.timed_step.remote(batch, active) for r in group]) for _ in range(repeats + 1)][1:]
        walls = [max(x["wall_s"] for x in row) for row in rows]
        comm = [statistics.mean(x["collective_s"] / x["wall_s"] for x in row) for row in rows]
        return {"step_s": statistics.median(walls), "collective_share": statistics.median(comm)}
    finally:
        for r in group:
            ray.kill(r)
        placement.remove()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-cpu")
    ap.add_argument("--objectives", default="flow_grpo,nft")
    ap.add_argument("--world-sizes", default="1,2,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    sizes = [int(x) for x in args.world_sizes.split(",")]

    import ray

    from diffusionrl.config import objective
    from diffusionrl.models import load_adapter
    from diffusionrl.raycluster import start_local_ray
    from diffusionrl.training.policy import LoraPolicy

    torch.set_num_threads(1)
    start_local_ray(max(sizes), log_to_driver=False)
    out: dict = {"preset": args.preset, "overrides": args.overrides, "threads_per_rank": 1, "objectives": {}}
    try:
        for name in args.objectives.split(","):
            cfg = load_config(args.preset, overrides=[*OBJECTIVE_KEYS[name], *args.overrides])
            torch.manual_seed(cfg.train.seed)
            adapter = load_adapter(cfg.model)
            policy = LoraPolicy(adapter, cfg.model, seed=cfg.train.seed)
            start = policy.lora_state()
            traj, active = scored_batch(cfg, adapter, policy, ode=not objective(name).sde)
            weights = policy.model.get_base_model().named_parameters()
            row: dict = {"samples": traj.batch_size,
                         "lora_bytes_pushed": sum(t.numel() * t.element_size() for t in start.values()),
                         "full_bytes_pushed": sum(p.numel() * 4 for n, p in weights if "lora_" not in n)}
            base = None
            for w in sizes:
                if w == 1:
                    base = one_process(cfg, policy, start, traj, active, args.repeats)
                    row["1"] = {"step_s": base, "collective_share": 0.0}
                else:
                    wcfg = load_config(args.preset, overrides=[*OBJECTIVE_KEYS[name], *args.overrides,
                                                               f"train.world_size={w}", "train.rollout_engines=1"])
                    row[str(w)] = ranks(wcfg, w, traj, active, args.repeats)
                if base:
                    row[str(w)]["vs_one_process"] = row[str(w)]["step_s"] / base
            out["objectives"][name] = row
    finally:
        ray.shutdown()
    _common.emit(out)


if __name__ == "__main__":
    main()
