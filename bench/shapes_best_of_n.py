"""How far sharpening could go on the shapes world, and the model's own successes as SFT data.

Samples every prompt of a split of the ``tiny-cpu-shapes`` world (``--split train`` by default: the
prompts RL trains on) ``--n`` times with the evaluation's ODE sampler (``eval.num_steps``,
``eval.guidance_scale``; ``--set`` to change them), from the base model or with a run's ``--lora``,
judges each image strictly with ``geneval_mini`` and prints one JSON line: per category and overall,
the success of one sample (pass@1) and the share of prompts with a success among their ``--n`` samples
(pass@n: what a policy that always drew its best seed would reach).

``--parquet PATH`` writes up to ``--cap`` successful samples of each prompt as ``prompt`` and ``image``
(PNG bytes) columns: the input of ``algorithm.name=sft`` (``algorithm.sft_source=PATH``), i.e.
rejection-sampling fine-tuning on the model's own strict successes. The seeds start at ``--seed``,
away from the evaluation's (``eval.seed``), so no evaluated sample is trained on.

    python bench/shapes_best_of_n.py [--n 32] [--split train] [--parquet runs/successes.parquet --cap 8]
                                     [--lora runs/x/lora] [--set eval.num_steps=10]
"""

from __future__ import annotations

import argparse
import io
import time

import _common  # sets sys.path and offline env
import numpy as np
from shapes_base import with_lora

from diffusionrl.config import load_config
from diffusionrl.data import load_prompts
from diffusionrl.data.shapes import CATEGORIES
from diffusionrl.evaluation import eval_samples, eval_spec, prompts_with_a_success
from diffusionrl.models import load_adapter
from diffusionrl.rewards.geneval_mini import GenEvalMini
from diffusionrl.rollout.local import LocalRolloutEngine

CHUNK = 512  # samples decoded at a time (bounds memory, not the result)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32, help="samples per prompt")
    ap.add_argument("--split", choices=("test", "train"), default="train")
    ap.add_argument("--seed", type=int, default=100_000, help="the first sample's seed")
    ap.add_argument("--lora", default=None, help="a run's lora/ folder or one of its checkpoints")
    ap.add_argument("--parquet", default=None, help="write the successes here (prompt, PNG image bytes)")
    ap.add_argument("--cap", type=int, default=8, help="at most this many successes of a prompt in --parquet")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    cfg = load_config("tiny-cpu-shapes", overrides=args.overrides)
    rows = getattr(load_prompts(cfg.data), args.split)
    adapter = load_adapter(cfg.model, cfg.train.mixed_precision)
    engine = LocalRolloutEngine(adapter, with_lora(adapter, args.lora), 64)
    prompts, groups, seeds, metadata = eval_samples(rows, args.n, args.seed)
    t0 = time.perf_counter()
    images = np.concatenate([
        engine.generate(prompts[s:s + CHUNK], groups[s:s + CHUNK], seeds[s:s + CHUNK], eval_spec(cfg), None,
                        metadata[s:s + CHUNK]).images
        for s in range(0, len(prompts), CHUNK)
    ])
    success = GenEvalMini()(images, prompts, metadata).per_sample["success"]
    groups_a = np.asarray(groups)
    cats = np.array([m["category"] for m in metadata])
    present = [c for c in CATEGORIES if (cats == c).any()]
    out = {
        "split": args.split, "lora": args.lora, "prompts": len(rows), "samples_per_prompt": args.n,
        "pass_at_1": {c: round(float(success[cats == c].mean()), 4) for c in present},
        "pass_at_n": {c: round(prompts_with_a_success(success[cats == c], groups_a[cats == c]), 4) for c in present},
        "overall_pass_at_1": round(float(success.mean()), 4),
        "overall_pass_at_n": round(prompts_with_a_success(success, groups), 4),
        "eval_num_steps": cfg.eval.num_steps, "eval_guidance_scale": cfg.eval.guidance_scale,
    }
    if args.parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq
        from PIL import Image

        kept: dict[int, int] = {}
        texts, pngs = [], []
        for prompt, group, image, ok in zip(prompts, groups, images, success):
            if ok and kept.get(group, 0) < args.cap:
                kept[group] = kept.get(group, 0) + 1
                buf = io.BytesIO()
                Image.fromarray(image).save(buf, format="PNG")
                texts.append(prompt)
                pngs.append(buf.getvalue())
        pq.write_table(pa.table({"prompt": texts, "image": pngs}), args.parquet)
        out.update(parquet=args.parquet, kept=len(texts), prompts_kept=len(kept))
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    _common.emit(out)


if __name__ == "__main__":
    main()
