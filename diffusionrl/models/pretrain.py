"""Pretrain ``builtin:tiny-sd3-shapes`` on the shapes world: ``python -m diffusionrl.models.pretrain``.

What it trains on (``--world``): ``web`` (the default, how ``builtin:tiny-sd3-shapes`` is made) draws
scenes of every kind the world holds, held-out specs included and often with extra objects, each
captioned by a true but often partial prompt (``data.shapes.web_scenes``; ``--own-caption`` of them by
the spec they were drawn from, the rest by any true caption, drawn afresh each step), with
``--cfg-dropout`` empty captions: the loose captions leave a gap that classifier-free guidance closes
and CFG-free RL can distil (docs/shapes.md). ``train`` draws only scenes of the training prompts
(``data.shapes.world_splits``), each captioned by its own prompt: a base that never drew a held-out
combination (``--world train --transformer-steps 7000 --bank 8192 --cfg-dropout 0.1`` made the
harder benchmark's base).

Two stages, seeded and resumable (``--work`` holds ``state.pt``, written every ``--save-every`` steps
and when the process is told to stop, e.g. by ``timeout``; a re-run with the same ``--work`` continues):

1. the VAE: scenes of the world, reconstruction MSE plus a small KL term, so that
   ``decode(encode(x))`` reproduces them; then the latents' mean and std become the VAE's
   ``shift_factor`` and ``1 / scaling_factor``;
2. the transformer and the three text encoders together by rectified-flow matching (SD3's
   objective: ``x_t = (1 - s) x_0 + s e``, target ``e - x_0``, ``s`` logit-normal) on a bank of
   encoded scenes, conditioned on the text encoders' embeddings of each scene's caption (a
   ``--cfg-dropout`` share replaced by the empty prompt's, so that classifier-free guidance works); an
   exponential moving average of their weights (``--ema``) is what is exported. With ``--fresh`` every
   step draws and encodes new scenes instead (seeded by the step, so a resume repeats them; a slower
   step: bench/README.md, "Sharpening and transfer"): no scene is seen twice, and the bank only gives
   the latents' mean and std.

``curves.jsonl`` gets one line per ``--log-every`` steps (stage, step, mean loss, wall seconds),
``summary.json`` the wall time and final losses, ``--out`` the weights (safetensors; by default the
file this package ships, ``models/tiny_sd3_shapes.safetensors``; the metadata holds the VAE's latent
shift and scale and ``--scheduler-shift``), and ``--folder`` the same model as a diffusers folder, which
any preset loads with ``--set model.name=FOLDER``. Re-running a finished ``--work`` only exports again.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch

from diffusionrl.data.shapes import (
    DEFAULT_SPLIT_SEED,
    DEFAULT_TEST_FRACTION,
    WEB_DISTRACTORS,
    WEB_OWN_CAPTION,
    all_specs,
    prompt_of,
    scene_pairs,
    web_caption,
    web_scenes,
    world_splits,
)

from .tiny_shapes import MAX_SEQUENCE_LENGTH, SCHEDULER_SHIFT, SHAPES_WEIGHTS, TRAINED, build_shapes_pipeline

log = logging.getLogger("diffusionrl.pretrain")

TRANSFORMER_ARGS = ("lr", "bank", "cfg_dropout", "ema", "fresh", "own_caption")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


class Stop(Exception):
    """Raised (after saving) when a SIGTERM/SIGINT arrived."""


def _images(batch) -> torch.Tensor:
    return torch.as_tensor(np.stack([b["image"] for b in batch])).permute(0, 3, 1, 2).float() / 127.5 - 1


def _lr(step: int, base: float, warmup: int, total: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


class Checkpointed:
    """What both pretraining scripts share (``pretrain_edit.py`` too): ``curves.jsonl`` lines, a save every
    ``--save-every`` steps and on a stop signal (``Stop`` after saving). Needs ``args`` (``log_every``,
    ``save_every``), ``work``, ``state`` (with ``wall_s``), ``t0``, ``stop`` and ``save()``."""

    def _log(self, stage: str, step: int, losses: list[float]) -> None:
        wall = self.state["wall_s"] + time.perf_counter() - self.t0
        row = {"stage": stage, "step": step, "loss": float(np.mean(losses)), "wall_s": round(wall, 1)}
        with (self.work / "curves.jsonl").open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)

    def _tick(self, stage: str, step: int, losses: list[float]) -> None:
        a = self.args
        if (step + 1) % a.log_every == 0:
            self._log(stage, step + 1, losses[-a.log_every:])
        if (step + 1) % a.save_every == 0 or self.stop:
            self.save()
        if self.stop:
            raise Stop

    def catch_signals(self) -> None:
        """SIGTERM/SIGINT (e.g. from ``timeout``) end the run at the next step, after a save."""
        def on_signal(signum, _frame):
            self.stop = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def progress(self) -> dict:
        """Where a stopped run is (its steps), for the line ``run`` prints."""
        raise NotImplementedError

    def run(self, out: Path, *stages) -> dict | None:
        """The command's body: catch stop signals, run ``stages`` in order, export to ``out`` and print
        and return the summary; a stop signal ends it after a save, printing where (``progress``), and
        returns None."""
        self.catch_signals()
        try:
            for stage in stages:
                stage()
        except Stop:
            print(json.dumps({"stopped": True, **self.progress(), "work": str(self.work)}), flush=True)
            return None
        summary = self.export(out)
        print(json.dumps(summary), flush=True)
        return summary


class Pretrainer(Checkpointed):
    def progress(self) -> dict:
        return {"vae_step": self.state["vae_step"], "transformer_step": self.state["tr_step"]}

    def __init__(self, args):
        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(args.seed)
        self.pipe = build_shapes_pipeline(weights=None)
        self.vae, self.transformer = self.pipe.vae, self.pipe.transformer
        # the flow-matching stage trains the transformer and the text encoders as one module list
        self.denoiser = torch.nn.ModuleList([self.transformer, *(getattr(self.pipe, n) for n in TEXT_ENCODERS)])
        self.ema = [p.detach().clone() for p in self.denoiser.parameters()]
        self.train_rows, _ = world_splits(args.test_fraction, args.split_seed)
        self.specs = [prompt_of(s) for s in all_specs()]  # a web caption is an index into these
        self.vae_opt = torch.optim.AdamW(self.vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
        self.tr_opt = torch.optim.AdamW(self.denoiser.parameters(), lr=args.lr, weight_decay=0.0)
        self.state = {"vae_step": 0, "tr_step": 0, "wall_s": 0.0, "stats": None}
        self.stop = False
        self.t0 = time.perf_counter()
        self._load()
        if args.init_from and not self.state["vae_step"]:
            self._start_from(Path(args.init_from), "--init-from", TRAINED)
        elif args.vae_from and not self.state["vae_step"]:
            self._start_from(Path(args.vae_from), "--vae-from", ("vae",))

    # -- state ---------------------------------------------------------------------------------------
    def _load(self) -> None:
        path = self.work / "state.pt"
        if not path.is_file():
            return
        saved = torch.load(path, weights_only=False)
        fixed = self._fixed_args()
        if missing := sorted(set(fixed) - set(saved["args"])):  # save() records every setting
            raise SystemExit(f"{path} records no {', '.join(missing)}, settings a --work binds; use another --work")
        if not saved["state"]["tr_step"]:  # the transformer's settings bind once its stage has started
            fixed = {k: v for k, v in fixed.items() if k not in TRANSFORMER_ARGS}
        if changed := sorted(k for k in fixed if saved["args"][k] != fixed[k]):
            raise SystemExit(f"{path} was written with other settings ({', '.join(changed)}: "
                             f"{[saved['args'][k] for k in changed]}); use them or another --work")
        self.vae.load_state_dict(saved["vae"])
        self.vae_opt.load_state_dict(saved["vae_opt"])
        self.state = saved["state"]
        if self.state["tr_step"]:  # before its stage starts the denoiser is the code's seeded init
            self.denoiser.load_state_dict(saved["denoiser"])
            self.tr_opt.load_state_dict(saved["tr_opt"])
            self.ema = saved["ema"]
        log.warning("resumed %s at VAE step %d, transformer step %d", path, self.state["vae_step"],
                    self.state["tr_step"])

    def _start_from(self, path: Path, option: str, names: tuple[str, ...]) -> None:
        """Load the ``names`` modules of an exported shapes model and skip the VAE stage: ``--vae-from``
        its VAE (a new caption policy over the same pictures), ``--init-from`` the whole model, its
        latent scaling and EMA included (continued pretraining)."""
        from safetensors import safe_open

        if not path.is_file():
            raise SystemExit(f"{option} {path}: no such file; give a shapes model's .safetensors")
        with safe_open(str(path), "pt") as f:
            keys, meta = list(f.keys()), json.loads((f.metadata() or {}).get("diffusionrl", "{}"))
            for name in names:
                part = {k.removeprefix(f"{name}."): f.get_tensor(k) for k in keys if k.startswith(f"{name}.")}
                if not part:
                    raise SystemExit(f"{option} {path}: no {name}.* tensors; give a shapes model this module exported")
                getattr(self.pipe, name).load_state_dict(part)
        if option == "--init-from":
            if "shift_factor" not in meta:
                raise SystemExit(f"{option} {path}: no latent scaling in its metadata; give a model pretrain exported")
            self.ema = [p.detach().clone() for p in self.denoiser.parameters()]
            self.state["stats"] = {k: float(meta[k]) for k in ("shift_factor", "scaling_factor")}
        self.state["vae_step"] = self.args.vae_steps
        log.warning("%s %s: the VAE stage is skipped", option, path)

    def _fixed_args(self) -> dict:
        a = vars(self.args)
        return {k: a[k] for k in ("seed", "batch", "resolution", "vae_lr", "lr", "test_fraction", "split_seed",
                                  "bank", "kl_weight", "cfg_dropout", "ema", "fresh", "world", "own_caption",
                                  "distractors", "vae_from", "init_from")}

    def save(self) -> None:
        self.state["wall_s"] += time.perf_counter() - self.t0
        self.t0 = time.perf_counter()
        tmp = self.work / "state.pt.tmp"
        torch.save({"args": self._fixed_args(), "vae": self.vae.state_dict(),
                    "denoiser": self.denoiser.state_dict(), "ema": self.ema, "vae_opt": self.vae_opt.state_dict(),
                    "tr_opt": self.tr_opt.state_dict(), "state": self.state}, tmp)
        os.replace(tmp, self.work / "state.pt")

    # -- stages --------------------------------------------------------------------------------------
    def train_vae(self) -> None:
        a = self.args
        self.vae.train().requires_grad_(True)
        losses: list[float] = []
        for step in range(self.state["vae_step"], a.vae_steps):
            x = _images(self.scenes(a.batch, seed=a.seed * 1_000_003 + step))
            for g in self.vae_opt.param_groups:
                g["lr"] = _lr(step, a.vae_lr, 100, a.vae_steps)
            dist = self.vae.encode(x).latent_dist
            gen = torch.Generator().manual_seed(a.seed * 1_000_003 + 900_000 + step)  # a resume draws the same
            recon = self.vae.decode(dist.sample(generator=gen)).sample
            loss = torch.nn.functional.mse_loss(recon, x) + a.kl_weight * dist.kl().mean() / dist.mean[0].numel()
            self.vae_opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.vae.parameters(), 1.0)
            self.vae_opt.step()
            losses.append(loss.item())
            self.state["vae_step"] = step + 1
            self.state.setdefault("vae_losses", []).append(loss.item())
            self._tick("vae", step, losses)
        self.vae.eval().requires_grad_(False)

    def scenes(self, num: int, seed: int) -> list[dict]:
        """``num`` scenes of ``--world``: ``{"image", ...}`` with ``"prompt"`` (``train``: the training
        prompts' scenes, captioned exactly) or ``"own"`` and ``"captions"`` (``web``: every kind of
        scene, ``data.shapes.web_scenes``)."""
        a = self.args
        if a.world == "web":
            return web_scenes(num, a.resolution, seed=seed, distractors=a.distractors)
        return scene_pairs(self.train_rows, num, a.resolution, seed=seed)

    def captions(self, scenes: list[dict], seed: int) -> list[str]:
        """One caption per scene: its prompt (``train``) or a true caption drawn by ``web_caption``."""
        if self.args.world == "train":
            return [s["prompt"] for s in scenes]
        rng = np.random.default_rng(seed)
        return [self.specs[web_caption(s, rng, self.args.own_caption)] for s in scenes]

    @torch.no_grad()
    def latent_bank(self) -> tuple[torch.Tensor, list[dict]]:
        """``--bank`` encoded scenes (VAE posterior means) and what captions them (their images
        dropped), cached."""
        a = self.args
        path = self.work / f"bank-vae{self.state['vae_step']}.pt"
        if path.is_file():
            saved = torch.load(path, weights_only=False)
            return saved["latents"], saved["scenes"]
        scenes = self.scenes(a.bank, seed=a.seed + 7)
        latents = torch.cat([self.vae.encode(_images(scenes[i:i + 64])).latent_dist.mode()
                             for i in range(0, len(scenes), 64)])
        scenes = [{k: v for k, v in s.items() if k != "image"} for s in scenes]
        torch.save({"latents": latents, "scenes": scenes}, path)
        return latents, scenes

    def train_transformer(self) -> None:
        a = self.args
        raw, bank = self.latent_bank()
        if self.state["stats"] is None:
            self.state["stats"] = {"shift_factor": float(raw.mean()), "scaling_factor": float(1 / raw.std())}
        stats = self.state["stats"]
        self.vae.register_to_config(**stats)
        latents = (raw - stats["shift_factor"]) * stats["scaling_factor"]
        # the prompts encoded each step: every caption the world's scenes can get, and the empty one
        unique = sorted({r["prompt"] for r in self.train_rows} if a.world == "train" else set(self.specs)) + [""]
        position = {p: i for i, p in enumerate(unique)}
        self.denoiser.train().requires_grad_(True)
        losses: list[float] = []
        for step in range(self.state["tr_step"], a.transformer_steps):
            gen = torch.Generator().manual_seed(a.seed * 1_000_003 + 500_000 + step)
            if a.fresh:  # scenes drawn afresh each step, seeded by (seed, step): no scene is seen twice
                scenes = self.scenes(a.batch, seed=a.seed * 1_000_003 + 300_000 + step)
                with torch.no_grad():
                    x0 = (self.vae.encode(_images(scenes)).latent_dist.mode() - stats["shift_factor"]) \
                        * stats["scaling_factor"]
            else:
                pick = torch.randint(len(latents), (a.batch,), generator=gen)
                x0 = latents[pick]
                scenes = [bank[int(i)] for i in pick]
            captions = self.captions(scenes, seed=a.seed * 1_000_003 + 700_000 + step)
            cond = torch.tensor([position[c] for c in captions])
            cond[torch.rand(a.batch, generator=gen) < a.cfg_dropout] = len(unique) - 1
            sigma = torch.sigmoid(torch.randn(a.batch, generator=gen)).view(-1, 1, 1, 1)
            noise = torch.randn(x0.shape, generator=gen)
            xt = (1 - sigma) * x0 + sigma * noise
            for g in self.tr_opt.param_groups:
                g["lr"] = _lr(step, a.lr, 100, a.transformer_steps)
            # the step's distinct captions are encoded, with gradients (a caption's embedding does not
            # depend on the others encoded beside it: the same gradient as encoding every caption)
            used, row = torch.unique(cond, return_inverse=True)
            embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompt=[unique[i] for i in used.tolist()], prompt_2=None, prompt_3=None, device="cpu",
                num_images_per_prompt=1, do_classifier_free_guidance=False, max_sequence_length=MAX_SEQUENCE_LENGTH)
            v = self.transformer(hidden_states=xt, timestep=sigma.view(-1) * 1000, encoder_hidden_states=embeds[row],
                                 pooled_projections=pooled[row], return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(v, noise - x0)
            self.tr_opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.denoiser.parameters(), 1.0)
            self.tr_opt.step()
            decay = min(a.ema, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(self.ema, [p.detach() for p in self.denoiser.parameters()], 1 - decay)
            losses.append(loss.item())
            self.state["tr_step"] = step + 1
            self.state.setdefault("tr_losses", []).append(loss.item())
            self._tick("transformer", step, losses)
        self.denoiser.eval().requires_grad_(False)

    def export(self, out: Path) -> dict:
        from safetensors.torch import save_file

        self.save()  # the training weights, before the EMA takes their place in the export
        ema = dict(zip((id(p) for p in self.denoiser.parameters()), self.ema)) if self.state["tr_step"] else {}
        tensors = {}
        for name in TRAINED:
            module = getattr(self.pipe, name)
            params = dict(module.named_parameters(remove_duplicate=False))
            for k, v in module.state_dict().items():  # the EMA weights are the model
                tensors[f"{name}.{k}"] = ema.get(id(params.get(k)), v).detach().contiguous().clone()
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {**self.state["stats"], "scheduler_shift": self.args.scheduler_shift}
        save_file(tensors, str(out), metadata={"diffusionrl": json.dumps(meta, sort_keys=True)})
        if self.args.folder:  # a diffusers folder of the exported model, for model.name
            build_shapes_pipeline(weights=out).save_pretrained(self.args.folder)
        tail = self.args.log_every
        summary = {
            "wall_s": round(self.state["wall_s"], 1), "vae_steps": self.state["vae_step"],
            "transformer_steps": self.state["tr_step"], "batch": self.args.batch, "seed": self.args.seed,
            "vae_final_loss": float(np.mean(self.state.get("vae_losses", [np.nan])[-tail:])),
            "transformer_final_loss": float(np.mean(self.state.get("tr_losses", [np.nan])[-tail:])),
            "vae_first_loss": float(np.mean(self.state.get("vae_losses", [np.nan])[:tail])),
            "transformer_first_loss": float(np.mean(self.state.get("tr_losses", [np.nan])[:tail])),
            "out": str(out),
        }
        (self.work / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def _probabilities(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(","))
    if any(v < 0 for v in values) or abs(sum(values) - 1) > 1e-6:
        raise argparse.ArgumentTypeError(f"{text!r}: give non-negative probabilities that sum to 1, e.g. 0.4,0.35,0.25")
    return values


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/pretrain-shapes", help="state, curves and summary (resumed if present)")
    ap.add_argument("--out", default=str(SHAPES_WEIGHTS), help="where the weights go (safetensors)")
    ap.add_argument("--folder", default="",
                    help="also save the exported model as a diffusers folder (model.name=FOLDER loads it)")
    ap.add_argument("--vae-steps", type=int, default=1500)
    ap.add_argument("--vae-from", default="",
                    help="take the VAE of this exported shapes model (.safetensors) instead of training one")
    ap.add_argument("--init-from", default="",
                    help="start from this exported shapes model (.safetensors): its VAE as is, its transformer and "
                         "text encoders trained on for --transformer-steps")
    ap.add_argument("--transformer-steps", type=int, default=9000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--vae-lr", type=float, default=1e-3)
    ap.add_argument("--lr", type=float, default=1e-3, help="transformer learning rate")
    ap.add_argument("--kl-weight", type=float, default=1e-4, help="weight of the per-element VAE KL term")
    ap.add_argument("--world", choices=("web", "train"), default="web",
                    help="web: scenes of every kind (held-out specs too, often with extra objects), each "
                    "captioned by a true, often partial prompt (data.shapes.web_scenes); train: only scenes of "
                    "the training prompts, each captioned by its own prompt")
    ap.add_argument("--own-caption", type=float, default=WEB_OWN_CAPTION,
                    help="web: share of scenes captioned by the prompt they were drawn from (else any true one)")
    ap.add_argument("--distractors", type=_probabilities, default=WEB_DISTRACTORS,
                    help="web: probabilities of 0, 1, 2, ... extra objects beside a spec's own (comma-separated)")
    ap.add_argument("--cfg-dropout", type=float, default=0.15, help="share of empty-prompt conditioning")
    ap.add_argument("--bank", type=int, default=32768,
                    help="encoded scenes the transformer trains on (with --fresh, only the latents' mean and std)")
    ap.add_argument("--fresh", action="store_true",
                    help="train the transformer on scenes drawn and encoded afresh each step instead of the bank")
    ap.add_argument("--ema", type=float, default=0.999, help="EMA decay of the exported transformer and text encoders")
    ap.add_argument("--scheduler-shift", type=float, default=SCHEDULER_SHIFT,
                    help="the sampling schedule's sigma shift, stored with the weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-fraction", type=float, default=DEFAULT_TEST_FRACTION, help="the held-out split to avoid")
    ap.add_argument("--split-seed", type=int, default=DEFAULT_SPLIT_SEED)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--save-every", type=int, default=100)
    return ap.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer = Pretrainer(args)
    return trainer.run(Path(args.out), trainer.train_vae, trainer.train_transformer)


if __name__ == "__main__":
    main()
