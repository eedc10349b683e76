"""Pretrain ``builtin:tiny-flux-kontext-shapes`` to edit: ``python -m diffusionrl.models.pretrain_edit``.

The model (``models/tiny_flux_shapes.py``) reuses the shapes model's VAE and text encoders, frozen; only
its FLUX transformer trains. Seeded and resumable as ``models/pretrain.py`` (``--work`` holds
``state.pt``, written every ``--save-every`` steps and when the process is told to stop; a re-run with the
same ``--work`` continues where it stopped, bit for bit), ``curves.jsonl`` and ``summary.json`` alike.

1. The bank: ``--bank`` edit examples (``data.shape_edits``) drawn as row stream ``BANK_SPLIT`` (neither the
   rows a run trains on nor those it holds out). ``--instructions train`` (the shipped model's) draws only the
   training split's instructions of ``--test-fraction``/``--split-seed`` (a run's ``data.test_fraction``/
   ``data.seed``: a held-out instruction is never drawn, so every held-out edit is one the base never made);
   ``--instructions all`` draws every instruction of the world, held-out ones included, in other scenes than
   the held-out rows' (GenEval's split: the base has made edits of every kind, RL trains on some).
   ``--loose P`` makes a share P of the targets hold one more edit that the instruction does not name
   (``data.shape_edits.loosen``: the instruction is true of the change but not all of it, as a web caption
   names one object of several), so that the instruction alone leaves the rest of the scene uncertain and
   guidance on it has something to sharpen; drawn from each row's own stream, the rows stay as without. Their
   source scenes and drawn target scenes are VAE-encoded by ``FluxKontextAdapter.encode_references`` (the
   posterior's mode, shifted and scaled), their instructions by the adapter's ``encode_prompts``
   (``MAX_SEQUENCE_LENGTH`` T5 tokens), once, cached in ``--work``.
2. The transformer, by rectified-flow matching of the target latents (``x_t = (1 - s) x_0 + s e``, target
   ``e - x_0``, ``s`` logit-normal) conditioned on the instruction and the source's reference latents, through
   ``FluxKontextAdapter.velocity``: the very forward sampling and RL use (reference tokens after the noisy
   ones, first id coordinate 1; the loss on the noisy tokens' output). The transformer has no guidance
   embedding; a ``--cfg-dropout`` share of the instructions is replaced by the empty one (the source image
   stays), so that classifier-free guidance on the instruction exists (the Kontext adapter's true-CFG pass,
   ``models/flux_kontext.py``); at 0 (the shipped model's) it samples CFG-free only. The exported weights are
   the EMA (``--ema``) of the transformer's; ``--folder`` also writes them as a diffusers folder, which the
   edit preset loads with ``--set model.name=FOLDER``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from diffusionrl.data.shape_edits import edit_rows, edit_splits, edits_of, loosen
from diffusionrl.data.shapes import draw_scene

from .pretrain import Checkpointed, _lr
from .tiny_flux_shapes import KONTEXT_SHAPES_WEIGHTS, MAX_SEQUENCE_LENGTH, build_kontext_shapes_pipeline
from .tiny_shapes import SCHEDULER_SHIFT

log = logging.getLogger("diffusionrl.pretrain_edit")
BANK_SPLIT = 2  # edit_rows' stream: a run draws its training rows from 0 and its held-out rows from 1
RESOLUTION = 64
FIXED = ("seed", "batch", "lr", "bank", "ema", "test_fraction", "split_seed", "double", "single", "heads",
         "instructions", "cfg_dropout", "loose")
# what a state.pt that records none of these was written with
DEFAULTS = {"instructions": "train", "cfg_dropout": 0.0, "loose": 0.0}


def source_image(row: dict) -> np.ndarray:
    scene = json.loads(row["source"])
    return draw_scene(scene["objects"], scene["resolution"])


def target_image(row: dict) -> np.ndarray:
    scene = json.loads(row["target"])
    return draw_scene(scene["objects"], scene["resolution"])


def architecture(args) -> dict:
    """The transformer's size (``TRANSFORMER`` of ``tiny_flux_shapes`` at the defaults)."""
    return {"num_layers": args.double, "num_single_layers": args.single, "num_attention_heads": args.heads}


class EditPretrainer(Checkpointed):
    def progress(self) -> dict:
        return {"step": self.state["step"]}

    def __init__(self, args):
        from .flux_kontext import FluxKontextAdapter

        self.args = args
        self.work = Path(args.work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.adapter = FluxKontextAdapter(build_kontext_shapes_pipeline(weights=None, **architecture(args)))
        self.transformer = self.adapter.transformer
        self.ema = [p.detach().clone() for p in self.transformer.parameters()]
        self.opt = torch.optim.AdamW(self.transformer.parameters(), lr=args.lr, weight_decay=0.0)
        self.state = {"step": 0, "wall_s": 0.0, "losses": []}
        self.stop = False
        self._empty = None  # the empty instruction's embeddings, once --cfg-dropout needs them
        self.t0 = time.perf_counter()
        self._load()

    # -- state ---------------------------------------------------------------------------------------
    def _fixed_args(self) -> dict:
        return {k: vars(self.args)[k] for k in FIXED}

    def _load(self) -> None:
        path = self.work / "state.pt"
        if not path.is_file():
            return
        saved = torch.load(path, weights_only=False)
        saved["args"] = {**DEFAULTS, **saved["args"]}
        missing = [k for k in FIXED if k not in saved["args"]]
        if missing:
            raise SystemExit(f"{path} records no {', '.join(missing)}, settings a --work binds; use another --work")
        changed = sorted(k for k in FIXED if saved["args"][k] != self._fixed_args()[k])
        if changed:
            raise SystemExit(f"{path} was written with other settings ({', '.join(changed)}: "
                             f"{[saved['args'][k] for k in changed]}); use them or another --work")
        self.transformer.load_state_dict(saved["transformer"])
        self.opt.load_state_dict(saved["opt"])
        self.ema, self.state = saved["ema"], saved["state"]
        log.warning("resumed %s at step %d", path, self.state["step"])

    def save(self) -> None:
        self.state["wall_s"] += time.perf_counter() - self.t0
        self.t0 = time.perf_counter()
        tmp = self.work / "state.pt.tmp"
        torch.save({"args": self._fixed_args(), "transformer": self.transformer.state_dict(), "ema": self.ema,
                    "opt": self.opt.state_dict(), "state": self.state}, tmp)
        os.replace(tmp, self.work / "state.pt")

    # -- stages --------------------------------------------------------------------------------------
    @torch.no_grad()
    def bank(self) -> dict:
        """The encoded training examples (cached in ``--work``): source and target latents, the
        instruction of each (an index into the unique instructions' embeddings)."""
        a = self.args
        path = self.work / "bank.pt"
        if path.is_file():
            return torch.load(path)
        train_texts, test_texts = edit_splits(a.test_fraction, a.split_seed)
        texts = train_texts | test_texts if a.instructions == "all" else train_texts
        rows = edit_rows(a.bank, texts, a.seed, BANK_SPLIT, RESOLUTION)
        if a.loose:  # each row's own stream, so that the rows are drawn as without --loose
            edits = edits_of(texts)
            streams = [np.random.default_rng([a.seed, BANK_SPLIT, i, 1]) for i in range(len(rows))]
            loose = [loosen(r, edits, g) if g.random() < a.loose else r for r, g in zip(rows, streams)]
            log.warning("%d of %d targets hold an edit their instruction does not name",
                        sum(o is not r for o, r in zip(loose, rows)), len(rows))
            rows = loose
        enc = self.adapter.encode_references
        unique = sorted({r["prompt"] for r in rows})
        cond = self.adapter.encode_prompts(unique, None, MAX_SEQUENCE_LENGTH)
        bank = {"source": enc([source_image(r) for r in rows], RESOLUTION),
                "target": enc([target_image(r) for r in rows], RESOLUTION),
                "text": torch.tensor([unique.index(r["prompt"]) for r in rows]), "texts": unique,
                "embeds": cond.prompt_embeds, "pooled": cond.pooled_embeds,
                "categories": [r["category"] for r in rows]}
        torch.save(bank, path)
        return bank

    def loss(self, bank: dict, step: int) -> torch.Tensor:
        """The flow-matching loss of step ``step``'s batch (its draws seeded by the step alone)."""
        from diffusionrl.trajectory import Conditioning

        a = self.args
        gen = torch.Generator().manual_seed(a.seed * 1_000_003 + 500_000 + step)
        pick = torch.randint(len(bank["text"]), (a.batch,), generator=gen)
        x0, text = bank["target"][pick], bank["text"][pick]
        sigma = torch.sigmoid(torch.randn(a.batch, generator=gen)).view(-1, 1, 1, 1)
        noise = torch.randn(x0.shape, generator=gen)
        embeds, pooled = bank["embeds"][text], bank["pooled"][text]
        if a.cfg_dropout:  # drawn after the rest, so that a run without dropout draws as before
            drop = torch.rand(a.batch, generator=gen) < a.cfg_dropout
            empty = self.empty_instruction()
            embeds = torch.where(drop.view(-1, 1, 1), empty.prompt_embeds, embeds)
            pooled = torch.where(drop.view(-1, 1), empty.pooled_embeds, pooled)
        cond = Conditioning(embeds, pooled, image_latents=bank["source"][pick])
        v = self.adapter.velocity(self.transformer, (1 - sigma) * x0 + sigma * noise, sigma.view(-1) * 1000, cond, 1.0)
        return torch.nn.functional.mse_loss(v, noise - x0)

    @torch.no_grad()
    def empty_instruction(self):
        """The empty instruction's embeddings (the unconditional side of CFG), encoded once."""
        if self._empty is None:
            self._empty = self.adapter.encode_prompts([""], None, MAX_SEQUENCE_LENGTH)
        return self._empty

    def train(self) -> None:
        a = self.args
        bank = self.bank()
        self.transformer.train().requires_grad_(True)
        params = list(self.transformer.parameters())
        losses: list[float] = []
        for step in range(self.state["step"], a.steps):
            for g in self.opt.param_groups:
                g["lr"] = _lr(step, a.lr, 100, a.steps)
            loss = self.loss(bank, step)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            self.opt.step()
            decay = min(a.ema, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(self.ema, [p.detach() for p in params], 1 - decay)
            losses.append(loss.item())
            self.state["step"] = step + 1
            self.state["losses"].append(loss.item())
            self._tick("edit", step, losses)
        self.transformer.eval().requires_grad_(False)

    def export(self, out: Path) -> dict:
        from safetensors.torch import save_file

        self.save()
        ema = dict(zip((id(p) for p in self.transformer.parameters()), self.ema))
        params = dict(self.transformer.named_parameters(remove_duplicate=False))
        tensors = {k: ema.get(id(params.get(k)), v).detach().contiguous().clone()
                   for k, v in self.transformer.state_dict().items()}
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"scheduler_shift": self.args.scheduler_shift, "transformer": architecture(self.args),
                "instructions": self.args.instructions, "cfg_dropout": self.args.cfg_dropout,
                "loose": self.args.loose}
        save_file(tensors, str(out), metadata={"diffusionrl": json.dumps(meta, sort_keys=True)})
        if self.args.folder:  # a diffusers folder of the exported model, for model.name
            build_kontext_shapes_pipeline(weights=out).save_pretrained(self.args.folder)
        tail, losses = self.args.log_every, self.state["losses"] or [np.nan]
        summary = {"wall_s": round(self.state["wall_s"], 1), "steps": self.state["step"], "batch": self.args.batch,
                   "seed": self.args.seed, "bank": self.args.bank, "first_loss": float(np.mean(losses[:tail])),
                   "final_loss": float(np.mean(losses[-tail:])), "out": str(out),
                   "parameters": sum(t.numel() for t in tensors.values())}
        (self.work / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/pretrain-edit", help="state, bank, curves and summary (resumed if present)")
    ap.add_argument("--out", default=str(KONTEXT_SHAPES_WEIGHTS), help="where the weights go (safetensors)")
    ap.add_argument("--folder", default="",
                    help="also write the exported model as a diffusers folder here (for model.name)")
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bank", type=int, default=16384, help="encoded training edits the transformer learns from")
    ap.add_argument("--ema", type=float, default=0.995, help="EMA decay of the exported transformer")
    ap.add_argument("--instructions", choices=("train", "all"), default="train",
                    help="train: only the training split's instructions; all: every instruction of the world")
    ap.add_argument("--cfg-dropout", type=float, default=0.0,
                    help="share of empty instructions (0: no unconditional side, CFG-free only)")
    ap.add_argument("--loose", type=float, default=0.0,
                    help="share of targets with one more edit that the instruction does not name (loose instructions)")
    ap.add_argument("--double", type=int, default=2, help="double-stream blocks")
    ap.add_argument("--single", type=int, default=4, help="single-stream blocks")
    ap.add_argument("--heads", type=int, default=4, help="attention heads of 32 features (width 32 x heads)")
    ap.add_argument("--scheduler-shift", type=float, default=SCHEDULER_SHIFT,
                    help="the sampling schedule's sigma shift, stored with the weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-fraction", type=float, default=0.2, help="the held-out split to avoid (data.test_fraction)")
    ap.add_argument("--split-seed", type=int, default=0, help="the split's seed (data.seed)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--save-every", type=int, default=50)
    return ap.parse_args(argv)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    trainer = EditPretrainer(args)
    return trainer.run(Path(args.out), trainer.train)


if __name__ == "__main__":
    main()
