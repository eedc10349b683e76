"""``python -m diffusionrl.plan --config sd35m-ocr --gpus 8 --gpu-memory 141GiB``: the predicted
per-rank peak memory by part, time per training step and per rollout, and the knobs that make a
config fit (exit status 1 when it does not). ``--table`` prints the GPU presets' tables of
docs/scaling.md (``--write`` puts them there, between the ``plan-table`` markers).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from diffusionrl.config import ConfigError, load_config
from diffusionrl.errors import run_cli

from .knobs import advise, scaled
from .model import GIB, GPUS, MFU, plan

TABLE_PRESETS = ("sd35m-ocr", "sd35m-pickscore-nft", "sd35m-pickscore-nft-full", "flux1-dev-pickscore",
                 "wan21-t2v-1.3b-ocr")
TABLE_GPUS = (1, 2, 8)
DOC = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"
BEGIN, END = "<!-- plan-table: begin (python -m diffusionrl.plan --table --write) -->", "<!-- plan-table: end -->"


def parse_memory(text: str) -> float:
    """``141GiB``, ``80GB``, ``46068MiB`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(GiB|GB|MiB|MB|TiB)?\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"--gpu-memory={text!r}: give a size above 0 such as 141GiB, 80GB or 46068MiB")
    unit = {"GiB": 2**30, "GB": 1e9, "MiB": 2**20, "MB": 1e6, "TiB": 2**40, None: 2**30}[match.group(2)]
    return float(match.group(1)) * unit


def parse_mfu(text: str) -> float:
    """``--mfu``: a share of the GPU's peak FLOP/s, above 0 and at most 1."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text!r} is not a utilisation; give a share in (0, 1], e.g. 0.4")
    return value


def load(config: str, overrides: list[str]):
    path = Path(config)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        return load_config(file=path, overrides=overrides)
    return load_config(preset=config, overrides=overrides)


def on_gpus(cfg, gpus: int | None):
    if not gpus or gpus == cfg.train.world_size:
        return cfg
    new = scaled(cfg, gpus)
    if new is None:
        raise ConfigError(f"--gpus {gpus}: train.world_size={gpus} does not divide this config's batch into whole "
                          "blocks per rank (python -m diffusionrl.config says which multiple)")
    return new


def show(cfg, gpu: str, memory: float | None, mfu: float) -> int:
    p = plan(cfg, gpu, memory, mfu)
    print(f"{cfg.preset or 'config'}: {cfg.model.name} on {p.gpus} x {gpu} ({p.gpu_memory / GIB:.1f} GiB), "
          f"rank 0 (the busiest)")
    names = list(dict.fromkeys(list(p.train) + list(p.rollout)))
    print(f"  {'part':58s} {'train GiB':>10s} {'rollout GiB':>12s}")
    for name in names:
        print(f"  {name:58s} {p.train.get(name, 0.0) / GIB:10.2f} {p.rollout.get(name, 0.0) / GIB:12.2f}")
    print(f"  {'total':58s} {sum(p.train.values()) / GIB:10.2f} {sum(p.rollout.values()) / GIB:12.2f}")
    verdict = "fits" if p.fits else "DOES NOT FIT"
    print(f"peak {p.peak / GIB:.1f} GiB ({p.phase} phase): {verdict}")
    print(f"time at MFU {mfu:.2f}: ~{p.step_s:.1f} s per training step (this rank's units), ~{p.rollout_s:.1f} s per "
          "rollout (transformer only)")
    for note in p.notes:
        print(f"note: {note}")
    if not p.fits:
        for line in advise(cfg, gpu, memory, base=p, mfu=mfu) or ["no single knob fixes it"]:
            print(f"fix: {line}")
    return 0 if p.fits else 1


def table() -> str:
    """The GPU presets' plan tables (markdown)."""
    from diffusionrl.config import get_preset

    out = []
    for name in TABLE_PRESETS:
        cfg = get_preset(name)
        out.append(f"### `{name}` ({cfg.model.name}, {cfg.sampling.resolution} px, micro-batch "
                   f"{cfg.train.micro_batch_size}, checkpointing {'on' if cfg.model.gradient_checkpointing else 'off'}"
                   f"; documented cluster: {cfg.train.world_size} GPU)\n")
        out.append("| GPUs | GPU | peak GiB (phase) | fits | weights | activations | step s | rollout s | fix |")
        out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for n in TABLE_GPUS:
            try:
                c = on_gpus(cfg, n)
            except ConfigError as err:
                out.append(f"| {n} | all | - | refused | | | | | {err} |")
                continue
            for gpu in GPUS:
                p = plan(c, gpu)
                weights = sum(v for k, v in p.train.items() if "weights" in k or "engine" in k or "encoders" in k)
                acts = sum(v for k, v in p.train.items() if k.startswith(("activations", "backward")))
                if p.refused:
                    out.append(f"| {n} | {gpu} | {p.peak / GIB:.1f} ({p.phase}) | {'yes' if p.fits else 'no'}, but "
                               f"not runnable | | | | | {p.refused} |")
                    continue
                fixes = [] if p.fits else [x.split(":")[0] for x in advise(c, gpu, base=p) if "still over" not in x]
                fix = "; ".join(fixes) if fixes or p.fits else "none of the knobs alone or together"
                out.append(f"| {n} | {gpu} | {p.peak / GIB:.1f} ({p.phase}) | {'yes' if p.fits else 'no'} | "
                           f"{weights / GIB:.1f} | {acts / GIB:.1f} | {p.step_s:.0f} | {p.rollout_s:.0f} | {fix} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diffusionrl.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="tiny-cpu", help="a preset name or a config file")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="dotted override key=value")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs = trainer ranks (default: the config's world_size)")
    ap.add_argument("--gpu", default="H200", choices=sorted(GPUS), help="GPU kind (its memory and peak FLOP/s)")
    ap.add_argument("--gpu-memory", default="", help="override the GPU's memory, e.g. 141GiB")
    ap.add_argument("--mfu", type=parse_mfu, default=MFU, help="assumed model FLOPs utilisation, in (0, 1]")
    ap.add_argument("--table", action="store_true", help="print the GPU presets' plan tables")
    ap.add_argument("--write", action="store_true", help="with --table: write them into docs/scaling.md")
    args = ap.parse_args(argv)

    def body() -> int:
        if args.table:
            text = table()
            if args.write:
                doc = DOC.read_text()
                start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
                DOC.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])
            else:
                print(text)
            return 0
        cfg = on_gpus(load(args.config, args.overrides), args.gpus)
        return show(cfg, args.gpu, parse_memory(args.gpu_memory) if args.gpu_memory else None, args.mfu)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
