"""Sharded checkpoints (``train.checkpoint_format=sharded``, ``diffusionrl.distributed.sharded``) in one process:
the driver's side for a rank on another machine, which does not see the driver's checkpoint folder. (Ranks that
see it, and resharding between 2 ranks and one process: ``tests/test_distributed.py``; a full fine-tune's:
``tests/test_full_finetune.py``.)"""

from __future__ import annotations

import torch

from diffusionrl.distributed import sharded

from .conftest import tiny_config


def test_a_rank_on_another_machine_sends_its_shards_and_receives_the_checkpoint(tmp_path):
    from diffusionrl.train import build_loop

    cfg = tiny_config("train.steps=1", "train.ema=true", "train.checkpoint_format=sharded", preset="tiny-cpu-nft")
    loop = build_loop(cfg, tmp_path / "run", progress=False)
    try:
        loop.run(resume=None)
        w = loop.backend.worker

        def call(method, *args):  # one rank that never sees the driver's folder
            if method == "save_sharded":
                return [sharded.save(w.policy, w.trainer, w.objective, None, no_dist=True)]
            if method == "sees_sharded":
                return [False]
            folder, _listing, plain, files = args
            return [sharded.load(w.policy, w.trainer, w.objective, folder, plain, files[0], no_dist=True)]

        folder = tmp_path / "checkpoint"
        folder.mkdir()
        record = sharded.write_from_ranks(call, folder, 1)
        assert sorted(p.name for p in folder.iterdir()) == [".metadata", "__0_0.distcp"]  # the driver's marker is gone
        assert record["world_size"] == 1 and record["optimizer"]  # the optimizer's hyper-parameters
        saved = sharded.read_tensors(folder)
        assert {k.split(".")[0] for k in saved} == {"model", "optim", "ema", "old"}

        live, _ = sharded.training_state(w.policy, w.trainer, w.objective)
        assert live.keys() == saved.keys() and all(torch.equal(live[k], saved[k]) for k in saved)
        with torch.no_grad():  # move everything the checkpoint holds
            for p in w.policy.parameters():
                p.add_(1.0)
            for t in [*w.trainer.ema.shadow.values(), *w.objective.old.shadow.values()]:
                t.add_(1.0)
            for per in w.trainer.optimizer.state.values():
                per["exp_avg"].add_(1.0)
        sharded.load_on_ranks(call, {**record, "folder": str(folder)}, put=lambda files: files)
        back, _ = sharded.training_state(w.policy, w.trainer, w.objective)
        assert all(torch.equal(back[k], saved[k]) for k in saved)
    finally:
        loop.close()
