"""Ray placement groups for the training stage.

One bundle per GPU, ``{"GPU": 1, "CPU": train.cpus_per_bundle}``, packed (``PACK``) so a node's
GPUs fill before the next node's. ``colocate``: a single group; bundle ``i`` holds trainer rank
``i`` (``1 - engine_gpu_fraction`` of the GPU) and, for ``i < rollout_engines``, a rollout engine
(the rest). ``split``: the trainer ranks get one group, the engines another. Without GPUs the
same layout is built from CPU-only bundles, which is how it is tested on a laptop. Reward actors
stay outside the groups (plain CPU actors of the reward pool). The groups are checked against the
cluster before they are created and never waited for without a bound (``diffusionrl.raycluster``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Placement:
    mode: str  # colocate | split
    use_gpu: bool
    trainer_group: object  # ray.util.placement_group.PlacementGroup
    engine_group: object  # the trainer group when colocated
    trainer_bundles: list[dict] = field(default_factory=list)
    engine_bundles: list[dict] = field(default_factory=list)

    def trainer_options(self, rank: int, train_cfg) -> dict:
        """``.options(...)`` of trainer rank ``rank``'s actor."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opts: dict = {
            "num_cpus": 1,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.trainer_group, placement_group_bundle_index=rank
            ),
        }
        if self.use_gpu:
            # Colocated, the engine's server process (started by this actor, same GPU) gets the rest.
            opts["num_gpus"] = 1.0 - train_cfg.engine_gpu_fraction if self.mode == "colocate" else 1.0
        return opts

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.trainer_group)
        if self.engine_group is not self.trainer_group:
            remove_placement_group(self.engine_group)


def bundle_resources(train_cfg, use_gpu: bool) -> tuple[list[dict], list[dict]]:
    """(trainer bundles, engine bundles); the engine list is empty when colocated."""
    one = {"CPU": float(train_cfg.cpus_per_bundle)}
    if use_gpu:
        one["GPU"] = 1.0
    trainer = [dict(one) for _ in range(train_cfg.world_size)]
    engines = [] if train_cfg.placement == "colocate" else [dict(one) for _ in range(train_cfg.rollout_engines)]
    return trainer, engines


def build_placement(train_cfg, use_gpu: bool | None = None) -> Placement:
    """Reserve the groups: checked against the cluster first (a layout it can never hold fails at once,
    naming the resource; an autoscaling cluster is given ``$DIFFUSIONRL_RAY_AUTOSCALE_WAIT_S``), then
    waited for at most ``$DIFFUSIONRL_RAY_START_TIMEOUT_S`` (``diffusionrl.raycluster``)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from diffusionrl import raycluster

    if use_gpu is None:
        use_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    trainer_bundles, engine_bundles = bundle_resources(train_cfg, use_gpu)
    what = f"train.world_size={train_cfg.world_size}"
    if engine_bundles:
        what += f" + train.rollout_engines={train_cfg.rollout_engines} (placement=split)"
    admission = raycluster.admit(what, trainer_bundles[0], len(trainer_bundles) + len(engine_bundles),
                                 "lower train.world_size or train.cpus_per_bundle, or add nodes/GPUs")
    trainer = placement_group(trainer_bundles, strategy="PACK", name="diffusionrl-trainer")
    engine = placement_group(engine_bundles, strategy="PACK", name="diffusionrl-engines") if engine_bundles else trainer
    groups = [trainer] if engine is trainer else [trainer, engine]
    try:
        raycluster.started([pg.ready() for pg in groups], admission)
    except BaseException:
        for pg in groups:  # a pending group would keep asking the autoscaler for nodes
            remove_placement_group(pg)
        raise
    return Placement(train_cfg.placement, use_gpu, trainer, engine, trainer_bundles, engine_bundles)
