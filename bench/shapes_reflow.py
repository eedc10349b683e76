"""Can supervised training on the model's own noise -> picture map sharpen it, and does it carry over?

A diagnostic of GenEval in miniature (bench/README.md, "GenEval in miniature"): why RL's gain on held-out prompts
stays small. The base model's ODE map sends each initial noise ``x1`` to a picture ``x0``; per
training prompt only some noises end in a picture the strict judge accepts (pass@1 ~0.19, while
nearly every prompt has a success among 32 seeds: ``bench/shapes_base.py --seeds 32``). RL has to move the
failing noises' trajectories onto successes. This bench does that move by supervision, as directly as
it can be done: it samples ``--n`` pictures of each training prompt with the evaluation's ODE sampler
(keeping each sample's ``x1`` and ``x0``), and fits a LoRA (the preset's targets, rank and alpha) to the
straight-line velocity ``x1 - x0`` at ``x_t = (1 - t) x0 + t x1`` (``t`` on the sampler's own shifted
grid) over pairs made by ``--coupling``:

- ``reward``: every noise of a prompt paired with a success of that prompt: its own picture when it
  succeeded, else the success nearest its own picture (latent L2); prompts without a success are left
  out. A rectified flow onto the successes: in the limit, every noise of a trained prompt succeeds.
- ``own``: every noise paired with its own picture (no reward): the control; it only straightens the
  model's flow.

Both couplings train from the same samples and the same LoRA initialisation, in one run; each writes a
peft LoRA folder under ``--out`` (``reward/``, ``own/``) that ``bench/shapes_base.py --lora`` judges on
either split. Prints one JSON line per coupling.

    python bench/shapes_reflow.py [--n 16] [--steps 400] [--lr 1e-3] [--coupling reward,own] --out DIR
    python bench/shapes_base.py --split train --seeds 4 --lora DIR/reward
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import _common  # sets sys.path and offline env
import numpy as np
import torch

from diffusionrl.config import load_config
from diffusionrl.data import load_prompts
from diffusionrl.evaluation import eval_samples, eval_spec
from diffusionrl.models import load_adapter
from diffusionrl.rewards.geneval_mini import GenEvalMini
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.training.policy import LoraPolicy

COUPLINGS = ("reward", "own")


def pairs(x0: torch.Tensor, success: np.ndarray, groups: np.ndarray, coupling: str) -> tuple[list[int], list[int]]:
    """``(noise index, picture index)`` pairs of ``coupling`` (see the module docstring)."""
    noises, pictures = [], []
    for g in np.unique(groups):
        members = np.flatnonzero(groups == g)
        good = members[success[members] > 0]
        if coupling == "own":
            noises += members.tolist()
            pictures += members.tolist()
            continue
        for i in members if len(good) else []:
            j = i if success[i] > 0 else good[int(((x0[good] - x0[i]) ** 2).flatten(1).sum(1).argmin())]
            noises.append(int(i))
            pictures.append(int(j))
    return noises, pictures


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16, help="samples per training prompt")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps per coupling")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=64, help="pairs per optimizer step")
    ap.add_argument("--coupling", default="reward,own", help=f"comma-separated, of {COUPLINGS}")
    ap.add_argument("--seed", type=int, default=200_000, help="the first sample's seed (away from eval.seed's)")
    ap.add_argument("--out", required=True, help="a folder; each coupling's LoRA goes to OUT/<coupling>")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    couplings = args.coupling.split(",")
    if unknown := set(couplings) - set(COUPLINGS):
        raise SystemExit(f"--coupling: unknown {sorted(unknown)}; choose from {COUPLINGS}")
    cfg = load_config("tiny-cpu-shapes", overrides=args.overrides)
    rows = load_prompts(cfg.data).train
    adapter = load_adapter(cfg.model, cfg.train.mixed_precision)
    policy = LoraPolicy(adapter, cfg.model, seed=cfg.train.seed)
    init = {k: v.clone() for k, v in policy.lora_state().items()}
    spec = eval_spec(cfg)

    t0 = time.perf_counter()
    prompts, groups, seeds, metadata = eval_samples(rows, args.n, args.seed)
    traj = LocalRolloutEngine(adapter, policy.model, 64).generate(prompts, groups, seeds, spec, None, metadata)
    success = GenEvalMini()(traj.images, prompts, metadata).per_sample["success"]
    x1, x0 = traj.latents[:, 0].float(), traj.latents[:, -1].float()
    groups_a = np.asarray(groups)
    sample_s = time.perf_counter() - t0
    sigmas, timesteps = adapter.schedule(spec.num_steps, spec.resolution)
    sigmas = sigmas[:-1]  # the grid's T noise levels, one per timestep (the last sigma, 0, is the picture)

    for coupling in couplings:
        t1 = time.perf_counter()
        policy.load_lora_state(init)
        for p in policy.params.values():
            p.requires_grad_(True)
        noise_idx, picture_idx = (torch.tensor(v) for v in pairs(x0, success, groups_a, coupling))
        opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(cfg.train.seed)
        losses = []
        for _ in range(args.steps):
            b = torch.randint(0, len(noise_idx), (args.batch,), generator=gen)
            k = torch.randint(0, len(timesteps), (args.batch,), generator=gen)
            s = sigmas[k].view(-1, *[1] * (x0.ndim - 1))
            a1, a0 = x1[noise_idx[b]], x0[picture_idx[b]]
            v = adapter.velocity(policy.model, (1 - s) * a0 + s * a1, timesteps[k],
                                 traj.conditioning.select(noise_idx[b]), *spec.guidance)
            loss = ((v - (a1 - a0)) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out = Path(args.out) / coupling
        policy.model.save_pretrained(str(out))
        _common.emit({
            "coupling": coupling, "lora": str(out), "prompts": len(rows), "samples_per_prompt": args.n,
            "train_pass_at_1": round(float(success.mean()), 4), "pairs": len(noise_idx),
            "redirected": int((noise_idx != picture_idx).sum()), "steps": args.steps, "lr": args.lr,
            "loss_first_20": round(float(np.mean(losses[:20])), 4),
            "loss_last_20": round(float(np.mean(losses[-20:])), 4),
            "sample_s": round(sample_s, 1), "train_s": round(time.perf_counter() - t1, 1),
        })


if __name__ == "__main__":
    main()
