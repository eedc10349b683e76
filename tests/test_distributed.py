"""Scale-out on CPU (docs/scaling.md): placement on CPU-only bundles, 2 gloo ranks in Ray actors
with FSDP2 giving one process's LoRA gradient, the synced grad scaler's skip decision, and a
colocated 2-step training run with an SGLang engine and Ray reward actors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.conftest import run_interrupted_and_uninterrupted, saved_lora, tiny_config

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


def _ranks(cfg, world_size: int = 2):
    from diffusionrl.distributed.group import node_address_and_port
    from diffusionrl.distributed.placement import build_placement
    from diffusionrl.distributed.worker import TrainerRank

    placement = build_placement(cfg.train)
    addr, port = node_address_and_port()
    cls = ray.remote(TrainerRank)
    ranks = [cls.options(**placement.trainer_options(r, cfg.train)).remote(cfg.to_dict(), r, world_size, addr, port)
             for r in range(world_size)]
    return placement, ranks


# Each objective's own algorithm keys over the family preset (the model section stays the family's, so
# one group of ranks serves every objective: TrainerRank.reset). kl_beta > 0 runs the reference forwards
# too; dppo's two minibatches make the first optimizer step a shuffled half of the batch.
OBJECTIVES = {
    "flow_grpo": ["algorithm.kl_beta=0.04"],
    "grpo_guard": ["algorithm.name=grpo_guard", "train.minibatches=2"],
    "dppo": ["algorithm.name=dppo", "algorithm.kl_beta=0", "train.minibatches=2"],
    "nft": ["algorithm.name=nft", "algorithm.kl_beta=0.0001", "train.minibatches=2"],
    "awm": ["algorithm.name=awm", "algorithm.kl_beta=0.001", "algorithm.kl_space=v"],
    "dpo": ["algorithm.name=dpo", "algorithm.kl_beta=0", "algorithm.dpo_pairs=all", "algorithm.dpo_beta=5"],
}


def _scored_batch(cfg, adapter, policy, ode: bool):
    """8 samples of 2 prompt groups, scored with spread advantages; the two groups train different SDE steps."""
    from diffusionrl.rollout.base import SamplingSpec
    from diffusionrl.rollout.local import LocalRolloutEngine

    engine = LocalRolloutEngine(adapter, policy.engine_copy(), cfg.train.micro_batch_size)
    b, k = 8, cfg.train.group_size
    mask = np.zeros((b, cfg.sampling.num_steps), dtype=bool)
    mask[:4, 0:2] = True
    mask[4:, 1:3] = True
    spec = SamplingSpec.from_config(cfg, **({"sde_type": "ode"} if ode else {}))
    traj = engine.generate([f"a red cat {i // k}" for i in range(b)], torch.arange(b) // k,
                           torch.arange(b) + 100, spec, mask, None)
    adv = torch.tensor([-1.5, 0.3, 2.0, -0.2, 0.9, -1.1, 0.1, 1.4])
    return traj.with_rewards(adv.clone(), {}, adv), torch.ones(b, dtype=torch.bool)


def _one_process_gradient(cfg, policy, start, traj, active) -> dict[str, torch.Tensor]:
    """The gradient of the first optimizer step of the objective's own train_step, in this process."""
    from diffusionrl.training.objective import build_objective
    from diffusionrl.training.trainer import Trainer

    class FirstGradient(Trainer):
        grads: dict = {}

        def apply(self, units, stats, prefix=""):
            if not self.grads:
                self.optimizer.zero_grad(set_to_none=True)
                assert self.accumulate(list(units), stats, prefix)
                self.grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                              for n, p in self.policy.params.items()}
            return False

    policy.load_lora_state(start)
    trainer = FirstGradient(cfg, policy)
    build_objective(cfg, policy).train_step(trainer, traj, active, 0)
    return trainer.grads


# Every family's block stacks become FSDP units (distributed/fsdp.block_units): SD3, FLUX.1's two stacks,
# Wan's ``blocks``, Wan2.2's two experts' ``blocks``. Every objective runs its own train_step on every rank
# over the whole scored batch, each rank computing its share of the units (worker.deal): the gradient of
# 2 and 4 ranks is one process's. On tiny-wan22 (timesteps 1000, 858, 602, 9: step 0 on the high-noise
# expert, the rest on the low-noise one) the units run grouped by expert, every rank the same count of each
# (padded), so no all-gather pairs one expert's block with the other's; with the LoRA on the high-noise
# expert alone no low-noise unit has a loss to backpropagate, and every rank skips those backwards together.
@pytest.mark.parametrize("preset,world_size,objectives,experts", [
    ("tiny-cpu", 2, tuple(OBJECTIVES), "both"),
    ("tiny-cpu", 4, tuple(OBJECTIVES), "both"),
    ("tiny-cpu-flux", 2, tuple(OBJECTIVES), "both"),
    ("tiny-cpu-wan", 2, tuple(OBJECTIVES), "both"),
    ("tiny-cpu-wan22", 2, ("flow_grpo", "grpo_guard"), "both"),
    ("tiny-cpu-wan22", 2, ("flow_grpo",), "high"),
    ("tiny-cpu", 2, ("flow_grpo", "nft"), "full"),  # model.finetune=full: every weight, the reference a copy
])
def test_fsdp_ranks_give_one_process_gradient_for_every_objective(ray_cluster, preset, world_size, objectives,
                                                                  experts):
    from diffusionrl.models import load_adapter
    from diffusionrl.training.full import build_policy

    dist = [f"train.world_size={world_size}", "train.rollout_engines=1",
            "model.finetune=full" if experts == "full" else f"model.lora_experts={experts}"]
    cfgs = {name: tiny_config(*dist, *OBJECTIVES[name], preset=preset) for name in objectives}
    first = cfgs[objectives[0]]
    placement, ranks = _ranks(first, world_size)  # the actors start while this process builds its own copy
    try:
        torch.manual_seed(first.train.seed)
        adapter = load_adapter(first.model)
        policy = build_policy(adapter, first)
        start = policy.lora_state()
        batches = {ode: _scored_batch(first, adapter, policy, ode) for ode in (False, True)}
        ray.get([r.mark_start.remote() for r in ranks])
        refs = {}
        for name, cfg in cfgs.items():
            from diffusionrl.config import objective

            traj, active = batches[not objective(name).sde]
            ref = refs[name] = _one_process_gradient(cfg, policy, start, traj, active)
            ray.get([r.reset.remote(cfg.to_dict()) for r in ranks])
            got = ray.get([r.gradients.remote(traj, active, 0) for r in ranks])
            assert got[0].keys() == ref.keys(), name
            assert sum(float(g.abs().sum()) for g in ref.values()) > 0, name
            for param, g in ref.items():
                for rank_grads in got:  # every rank gathers the same full gradient
                    err = (rank_grads[param] - g).norm() / g.norm().clamp_min(1e-12)
                    assert err <= 1e-5, (name, param, float(err))
        if preset == "tiny-cpu-wan22":  # both experts' LoRA tensors train, each in its own FSDP units
            from diffusionrl.distributed.fsdp import block_units

            assert len(block_units(adapter.transformer)) == 2 * len(adapter.transformer.high.blocks)
            assert batches[False][0].timesteps[0] >= 875 > batches[False][0].timesteps[1]
            for expert in ("high", "low"):
                grads = [g for n, g in refs["flow_grpo"].items() if f".{expert}.blocks." in n and ".lora_B." in n]
                if experts in ("both", expert):
                    assert grads and all(float(g.abs().sum()) > 0 for g in grads), expert
                else:
                    assert not grads, expert
    finally:
        for r in ranks:
            ray.kill(r)
        placement.remove()


def test_every_objective_on_two_ranks_resumes_bitwise_and_steps_as_one_process(ray_cluster):
    """For every objective, on one group of 2 ranks: two RL steps straight through equal one step, a checkpoint
    of the ranks' state (LoRA, AdamW, EMA, the objective's tensors: what RankGroup.checkpoint_parts gathers),
    a fresh trainer and objective loading it (a restart) and the second step, bit for bit; and the first
    step's LoRA equals one process's to fp32 tolerance."""
    from diffusionrl.models import load_adapter
    from diffusionrl.training.objective import build_objective
    from diffusionrl.training.policy import LoraPolicy
    from diffusionrl.training.trainer import Trainer

    cfgs = {name: tiny_config(*DIST, "train.ema=true", *OBJECTIVES[name]) for name in OBJECTIVES}
    placement, ranks = _ranks(cfgs["flow_grpo"])
    try:
        torch.manual_seed(0)
        adapter = load_adapter(cfgs["flow_grpo"].model)
        policy = LoraPolicy(adapter, cfgs["flow_grpo"].model, seed=cfgs["flow_grpo"].train.seed)
        start = policy.lora_state()
        batches = {ode: _scored_batch(cfgs["flow_grpo"], adapter, policy, ode) for ode in (False, True)}
        ray.get([r.mark_start.remote() for r in ranks])

        def on_all(method, *args):
            return ray.get([getattr(r, method).remote(*args) for r in ranks])

        for name, cfg in cfgs.items():
            from diffusionrl.config import objective

            traj, active = batches[not objective(name).sde]
            on_all("reset", cfg.to_dict())
            on_all("train_step", traj, active, 0)
            first = on_all("lora_state")[0]
            saved = {k: on_all(k)[0] for k in ("optimizer_state", "ema_state", "objective_state")}
            on_all("train_step", traj, active, 1)
            straight = on_all("lora_state")[0], on_all("ema_state")[0], on_all("objective_state")[0]
            on_all("reset", cfg.to_dict())  # a restart: fresh trainer, optimizer and objective
            on_all("load_lora_state", first)
            on_all("load_optimizer_state", saved["optimizer_state"])
            on_all("load_ema_state", saved["ema_state"])
            on_all("load_objective_state", saved["objective_state"])
            on_all("train_step", traj, active, 1)
            resumed = on_all("lora_state")[0], on_all("ema_state")[0], on_all("objective_state")[0]
            for a, b in zip(straight[:2], resumed[:2]):
                assert all(torch.equal(a[k], b[k]) for k in a), name
            for group in straight[2]:
                assert all(torch.equal(straight[2][group][k], resumed[2][group][k]) for k in straight[2][group])

            policy.load_lora_state(start)
            trainer, one = Trainer(cfg, policy), build_objective(cfg, policy)
            trainer.begin_step(0)
            one.train_step(trainer, traj, active, 0)
            mine = policy.lora_state()
            assert any(not torch.equal(mine[k], start[k]) for k in mine), name
            # AdamW's first step moves a weight by about lr * g / (|g| + eps): where a gradient is within fp32
            # rounding of zero (summed over two ranks in another order), its step is not fixed to better than
            # ~1e-4 of lr (DPO: 2.1e-6 at lr 1e-2 on one CPU). The gradients are compared to 1e-5 of their norm in
            # test_fsdp_ranks_give_one_process_gradient_for_every_objective; a wrong one moves weights by ~lr.
            atol = 1e-3 * cfg.train.learning_rate
            for k, t in mine.items():
                assert torch.allclose(first[k], t, rtol=1e-4, atol=atol), (name, k, float((first[k] - t).abs().max()))
    finally:
        for r in ranks:
            ray.kill(r)
        placement.remove()


def test_two_rank_nft_run_resumes_bitwise_and_its_first_step_is_one_process(ray_cluster, tmp_path):
    """DiffusionNFT end to end on 2 ranks (local engine on rank 0, EMA on) with sharded checkpoints (each rank
    writes its shards through torch.distributed.checkpoint): a run stopped after step 1 and resumed equals the
    uninterrupted run bit for bit (LoRA, AdamW, EMA, old policy, metrics); its first step equals one process's
    (the tiny rewards are discontinuous: later steps may drift apart, each run repeatable); and one process
    resumes its step-1 checkpoint (DCP reshards it to one) and takes the second step as the 2 ranks did."""
    import shutil

    from diffusionrl.distributed.sharded import read_tensors
    from diffusionrl.run.checkpoint import list_checkpoints, load_checkpoint
    from diffusionrl.train import build_loop

    quick = ["eval.every=0", "train.ema=true", "train.checkpoint_format=sharded"]
    cfg = tiny_config(*DIST, *quick, preset="tiny-cpu-nft")
    full, resumed, result = run_interrupted_and_uninterrupted(cfg, tmp_path)
    assert result.steps_done == 2 and full.backend.worker.info() == {"world_size": 2}
    for folder in ("lora", "lora_ema"):
        a, b = saved_lora(tmp_path / "full", folder), saved_lora(tmp_path / "part", folder)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), folder
    ckpts = {run: list_checkpoints(tmp_path / run / "checkpoints") for run in ("full", "part")}
    assert load_checkpoint(ckpts["part"][-1], restore_rng=False).sharded["world_size"] == 2
    assert sorted(p.name for p in (ckpts["part"][-1] / "sharded").iterdir()) == [".metadata", "__0_0.distcp",
                                                                                  "__1_0.distcp"]
    ends = [read_tensors(ckpts[run][-1] / "sharded") for run in ("full", "part")]
    assert {k.split(".")[0] for k in ends[0]} == {"model", "optim", "ema", "old"}
    assert ends[0].keys() == ends[1].keys() and all(torch.equal(ends[0][k], ends[1][k]) for k in ends[0])
    assert [m["train/loss"] for m in full.history] == [m["train/loss"] for m in resumed.history]
    assert result.metrics[-1]["train/old_policy_eta"] > 0

    one = build_loop(tiny_config("train.steps=1", *quick, preset="tiny-cpu-nft"), tmp_path / "one", progress=False)
    try:
        first = one.run(resume=None).metrics[0]
    finally:
        one.close()
    two = read_tensors(ckpts["part"][0] / "sharded")
    mine = read_tensors(list_checkpoints(tmp_path / "one" / "checkpoints")[-1] / "sharded")
    assert load_checkpoint(ckpts["part"][0], restore_rng=False).step == 1 and two.keys() == mine.keys()
    for k, t in mine.items():
        assert torch.allclose(two[k], t, rtol=1e-5, atol=1e-6), k
    assert first["train/loss"] == pytest.approx(full.history[0]["train/loss"], rel=1e-5)

    shutil.copytree(ckpts["part"][0], tmp_path / "cross" / "checkpoints" / ckpts["part"][0].name)
    cross = build_loop(tiny_config(*quick, preset="tiny-cpu-nft"), tmp_path / "cross", progress=False)
    try:
        assert cross.run(resume="auto").steps_done == 2
    finally:
        cross.close()
    assert cross.history[-1]["rollout/reward/raw_mean"] == full.history[-1]["rollout/reward/raw_mean"]
    a, b = saved_lora(tmp_path / "full"), saved_lora(tmp_path / "cross")
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), k


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
