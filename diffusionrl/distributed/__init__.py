"""Scale-out of the training stage (docs/scaling.md): Ray placement, torch.distributed ranks in Ray
actors, FSDP2 sharding of the LoRA policy, a rank-consistent grad scaler, CUDA IPC weight sync.

``ranks.RankGroup`` is the entry point (``train.world_size > 1``, picked by ``diffusionrl.train.build_loop``);
the modules are its parts.
"""

from .placement import Placement, build_placement, bundle_resources
from .shards import assign_blocks, cat_trajectories

__all__ = ["Placement", "assign_blocks", "build_placement", "bundle_resources", "cat_trajectories"]
