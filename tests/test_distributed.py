"""Scale-out on CPU (docs/scaling.md): placement on CPU-only bundles, 2 gloo ranks in Ray actors
with FSDP2 giving one process's LoRA gradient, the synced grad scaler's skip decision, and a
colocated 2-step training run with an SGLang engine and Ray reward actors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.conftest import tiny_config

ray = pytest.importorskip("ray")

DIST = ["train.world_size=2", "train.rollout_engines=1"]


@pytest.fixture(scope="module")
def ray_cluster():
    # Logical CPUs: 2 bundles x 1 CPU for the ranks, plus room for reward actors.
    started = not ray.is_initialized()
    if started:
        from diffusionrl.raycluster import start_local_ray

        start_local_ray(4, log_to_driver=False)  # on loopback, as a run starts it
    yield
    if started:
        ray.shutdown()


def test_placement_layout_on_cpu_bundles(ray_cluster):
    from ray.util.placement_group import placement_group_table

    from diffusionrl.distributed.placement import build_placement

    cfg = tiny_config(*DIST)
    colo = build_placement(cfg.train)
    try:
        assert colo.mode == "colocate" and not colo.use_gpu and colo.engine_group is colo.trainer_group
        table = placement_group_table(colo.trainer_group)
        assert table["strategy"] == "PACK"
        assert list(table["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
        opts = colo.trainer_options(1, cfg.train)
        assert opts["scheduling_strategy"].placement_group_bundle_index == 1 and "num_gpus" not in opts
    finally:
        colo.remove()
    split = build_placement(tiny_config(*DIST, "train.placement=split").train)
    try:
        assert split.engine_group is not split.trainer_group
        assert len(placement_group_table(split.engine_group)["bundles"]) == 1
    finally:
        split.remove()


def _ranks(cfg):
    from diffusionrl.distributed.group import node_address_and_port
    from diffusionrl.distributed.placement import build_placement
    from diffusionrl.distributed.worker import TrainerRank

    placement = build_placement(cfg.train)
    addr, port = node_address_and_port()
    cls = ray.remote(TrainerRank)
    ranks = [cls.options(**placement.trainer_options(r, cfg.train)).remote(cfg.to_dict(), r, 2, addr, port)
             for r in range(2)]
    return placement, ranks


# Every family's block stacks become FSDP units (distributed/fsdp.block_units): SD3, FLUX.1's two stacks,
# Wan's ``blocks``, Wan2.2's two experts' ``blocks``. On tiny-wan22 (timesteps 1000, 858, 602, 9: step 0 on the
# high-noise expert, the rest on the low-noise one) rank 0 trains steps 0 and 1 (high, low), rank 1 steps 1 and
# 2 (low, low): in plan order rank 0's high-noise unit would meet a low-noise one of rank 1 in the same
# all-gathers (same shapes: wrong weights, no error); worker.aligned_work runs every rank's high-noise units
# first (rank 1 pads one), then the low-noise ones (rank 0 pads one). With the LoRA on the high-noise expert
# alone, no low-noise unit has a loss to backpropagate: every rank skips those backwards together.
@pytest.mark.parametrize("preset,experts", [("tiny-cpu", "both"), ("tiny-cpu-flux", "both"), ("tiny-cpu-wan", "both"),
                                            ("tiny-cpu-wan22", "both"), ("tiny-cpu-wan22", "high")])
def test_two_gloo_fsdp_ranks_give_one_process_gradient(ray_cluster, preset, experts):
    from diffusionrl.distributed.shards import assign_blocks, select_samples
    from diffusionrl.distributed.worker import grpo_plan
    from diffusionrl.models import load_adapter
    from diffusionrl.rollout.base import SamplingSpec
    from diffusionrl.rollout.local import LocalRolloutEngine
    from diffusionrl.training.flow_grpo import FlowGRPOObjective
    from diffusionrl.training.policy import LoraPolicy
    from diffusionrl.training.trainer import Trainer, UpdateStats

    cfg = tiny_config(*DIST, f"model.lora_experts={experts}", preset=preset)  # both: every model's default
    placement, ranks = _ranks(cfg)  # the actors start while this process builds its own copy
    try:
        torch.manual_seed(cfg.train.seed)
        adapter = load_adapter(cfg.model)
        policy = LoraPolicy(adapter, cfg.model, seed=cfg.train.seed)
        engine = LocalRolloutEngine(adapter, policy.engine_copy(), cfg.train.micro_batch_size)
        b, k = 8, cfg.train.group_size
        mask = np.zeros((b, cfg.sampling.num_steps), dtype=bool)
        mask[:4, 0:2] = True  # the two groups train different steps: the ranks run different units
        mask[4:, 1:3] = True
        traj = engine.generate([f"a red cat {i // k}" for i in range(b)], torch.arange(b) // k,
                               torch.arange(b) + 100, SamplingSpec.from_config(cfg), mask, None)
        adv = torch.linspace(-1.5, 2.0, b)
        traj = traj.with_rewards(adv.clone(), {}, adv)
        active = torch.ones(b, dtype=torch.bool)
        plan = grpo_plan(traj, active, cfg.train, step=0)

        # one process: every unit of the optimizer step, sum / total count
        objective, trainer = FlowGRPOObjective(cfg, policy), Trainer(cfg, policy)
        rng = np.random.default_rng(0)
        units = objective.units(traj, traj.micro_batches(), active, rng)
        trainer.optimizer.zero_grad(set_to_none=True)
        assert trainer.accumulate(units, UpdateStats())
        ref = {n: p.grad.detach().clone() for n, p in policy.params.items()}

        shares = assign_blocks(b, k, cfg.train.micro_batch_size, 2)
        got = ray.get([r.gradients.remote(select_samples(traj, sl), active[sl], plan[0], sl.start // 4)
                       for r, sl in zip(ranks, shares)])
        assert got[0].keys() == ref.keys()
        for name, g in ref.items():
            for rank_grads in got:  # every rank gathers the same full gradient
                err = (rank_grads[name] - g).norm() / g.norm().clamp_min(1e-12)
                assert err <= 1e-5, (name, float(err))
        assert sum(float(g.abs().sum()) for g in ref.values()) > 0
        if preset == "tiny-cpu-wan22":  # both experts' LoRA tensors train, each in its own FSDP units
            from diffusionrl.distributed.fsdp import block_units

            assert len(block_units(adapter.transformer)) == 2 * len(adapter.transformer.high.blocks)
            assert traj.timesteps[0] >= 875 > traj.timesteps[1]
            for expert in ("high", "low"):
                grads = [g for n, g in ref.items() if f".{expert}.blocks." in n and ".lora_B." in n]
                if experts in ("both", expert):
                    assert grads and all(float(g.abs().sum()) > 0 for g in grads), expert
                else:
                    assert not grads, expert
    finally:
        for r in ranks:
            ray.kill(r)
        placement.remove()


@ray.remote(num_cpus=1)
def _scaler_rank(rank: int, addr: str, port: int, inf_rank: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from diffusionrl.distributed.group import init_group
    from diffusionrl.distributed.scaler import SyncedGradScaler

    torch.set_num_threads(1)
    init_group(rank, 2, addr, port, torch.device("cpu"))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = SyncedGradScaler("cpu", init_scale=1024.0, enabled=True)
    out = []
    for it in range(2):  # step 0: inf on one rank -> all skip; step 1: finite -> all step
        before = [p.full_tensor().clone() for p in model.parameters()]
        scaler.scale(model(torch.ones(2, 4) * (rank + 1)).sum()).backward()
        if it == 0 and rank == inf_rank:
            model.weight.grad.to_local().view(-1)[0] = float("inf")  # only this rank's shard
        scaler.unscale_(opt)
        skipped = scaler.found_inf(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
        out.append({"skipped": skipped, "scale": scaler.get_scale(), "changed": changed})
    dist.destroy_process_group()
    return out


def test_scaler_skip_decision_is_identical_on_all_ranks(ray_cluster):
    from diffusionrl.distributed.group import node_address_and_port

    addr, port = node_address_and_port()
    results = ray.get([_scaler_rank.remote(r, addr, port, 1) for r in range(2)])
    assert results[0] == results[1]
    first, second = results[0]
    assert first == {"skipped": True, "scale": 512.0, "changed": False}
    assert second["skipped"] is False and second["changed"] and second["scale"] == 512.0


def test_colocated_two_step_training_with_sglang_engine_and_reward_actors(ray_cluster, tmp_path):
    from diffusionrl.rollout.sglang import sglang_available

    if not sglang_available():
        pytest.skip("no SGLang environment (.venv-sglang): run `make sglang-env`")
    from diffusionrl.train import build_loop

    cfg = tiny_config(*DIST, "reward.num_actors=1", "train.offload_optimizer=true", preset="tiny-cpu-sglang")
    loop = build_loop(cfg, tmp_path / "run", progress=False)
    try:
        assert [i["engine"] for i in loop.backend.worker.infos] == ["sglang", None]
        assert {i["backend"] for i in loop.backend.worker.infos} == {"gloo"}
        result = loop.run(resume=None)
    finally:
        loop.close()
    assert result.steps_done == 2 and [m["policy_version"] for m in result.metrics] == [1.0, 2.0]
    for m in result.metrics:
        assert math.isfinite(m["train/loss"]) and m["train/optimizer_steps"] == 1.0
        assert m["train/log_prob_mean_abs_diff"] <= 1e-5  # the trainer recomputes the server's samples
        assert m["perf/update_weights_time"] > 0
    assert (result.model_dir / "adapter_model.safetensors").is_file()
    assert (result.checkpoint / "state.json").is_file()
