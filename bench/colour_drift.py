"""Colours a shapes-world run draws, and what the advantages say about them: is RL trading colours away?

Reads a run's stored rollouts (``RUN/trajectories/step-*.parquet``: each sample's picture, prompt spec and
advantage), finds every picture's objects with ``geneval_mini``'s detector, and prints one JSON line with,
for the first and the last ``--window`` steps:

- ``share``: each colour's share of all detected objects (``other``: off-colour smudges);
- ``blobs``: the share of each colour's objects that are shapeless blobs (how crisply the policy draws it);
- ``advantage``: the mean advantage of the samples whose picture holds a colour, apart for prompts that
  ask no colour (``colourless``: single, two, counting, position) and prompts that ask one (``coloured``).

On prompts that ask no colour any colour is right, so when one colour comes out crisper, its pictures score
higher and RL favours that colour there; the LoRA is shared by every prompt, so the drift can reach prompts
that ask for a colour, which the strict judge then fails (``bench/README.md``, "CFG-free DiffusionNFT on the
web base"). A colour whose share grows far beyond the others' between the windows is such a drift.

    python bench/colour_drift.py RUN [--window 10]
"""

from __future__ import annotations

import argparse
import io
import json
from collections import defaultdict
from pathlib import Path

import _common  # sets sys.path and offline env
import numpy as np

from diffusionrl.rewards.geneval_mini import BLOB, detect, parse_spec
from diffusionrl.trajectory import list_step_files
from diffusionrl.trajectory.store import step_of

COLUMNS = ["advantage", "metadata_json", "image_png"]


def window_stats(files: list[Path]) -> dict:
    """Colour shares, blob rates and mean advantages over the samples of ``files`` (trajectory parquets)."""
    import pyarrow.parquet as pq
    from PIL import Image

    count: dict[str, int] = defaultdict(int)
    blobs: dict[str, int] = defaultdict(int)
    adv_sum: dict[tuple[str, str], float] = defaultdict(float)
    adv_n: dict[tuple[str, str], int] = defaultdict(int)
    samples = 0
    for path in files:
        for row in pq.read_table(path, columns=COLUMNS).to_pylist():
            samples += 1
            spec = parse_spec(json.loads(row["metadata_json"]))
            kind = "coloured" if any(o["color"] for o in spec["objects"]) else "colourless"
            found = detect(np.asarray(Image.open(io.BytesIO(row["image_png"])).convert("RGB")))
            for d in found:
                count[d.color] += 1
                blobs[d.color] += d.shape == BLOB
            for colour in {d.color for d in found}:
                adv_sum[kind, colour] += float(row["advantage"])
                adv_n[kind, colour] += 1
    total = max(1, sum(count.values()))
    return {"steps": [step_of(files[0]), step_of(files[-1])], "samples": samples,
            "share": {c: round(count[c] / total, 3) for c in sorted(count)},
            "blobs": {c: round(blobs[c] / count[c], 3) for c in sorted(count)},
            "advantage": {kind: {c: round(adv_sum[k, c] / adv_n[k, c], 3) for (k, c) in sorted(adv_n) if k == kind}
                          for kind in ("colourless", "coloured")}}


def drift(run: Path, window: int) -> dict:
    files = list_step_files(run / "trajectories")
    if not files:
        raise SystemExit(f"{run}/trajectories: no step-*.parquet; give a run folder that stored its rollouts")
    window = max(1, min(window, len(files)))
    return {"run": str(run), "stored_steps": len(files), "first": window_stats(files[:window]),
            "last": window_stats(files[-window:])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a run folder (its trajectories/ holds step-*.parquet)")
    ap.add_argument("--window", type=int, default=10, help="steps at each end of the run")
    args = ap.parse_args(argv)
    _common.emit(drift(args.run, args.window))


if __name__ == "__main__":
    main()
