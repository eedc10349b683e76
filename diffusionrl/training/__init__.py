"""Policy, trainer, checkpoints and the RL loop."""

from .checkpoint import CheckpointMismatch, latest_checkpoint, load_checkpoint, save_checkpoint
from .loop import RLLoop, TrainResult, train
from .nft import NFTObjective
from .policy import EMA, LoraPolicy
from .trainer import FlowGRPOObjective, Trainer

__all__ = [
    "CheckpointMismatch",
    "EMA",
    "FlowGRPOObjective",
    "LoraPolicy",
    "NFTObjective",
    "RLLoop",
    "TrainResult",
    "Trainer",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "train",
]
