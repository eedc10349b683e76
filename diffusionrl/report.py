"""The run report: one self-contained HTML page that a person reads in one screen, rendered from the
Jinja2 template ``templates/report.html.j2`` (autoescaped: prompts and config values are text, never HTML).

From the top: one line each for the base, the base with CFG (``eval/base_cfg_*``, when
``eval.base_guidance_scale`` > 0) and the tuned model on the held-out prompts, strict success first
(``..._success``, GenEval's overall ``.../category_mean`` when the prompts have categories), then the
reward, pass@seeds and diversity; the per-category strict accuracy (base, base with CFG, tuned); one
training plot (the rollout reward per step, the held-out probes' strict success, else their reward,
per step, reward-hacking alarms marked); each held-out prompt a row of up to ``SEEDS_SHOWN`` seeds,
base | tuned (an edit's input first), thumbnails with their strict verdict; where the run's files are.
Everything else (every summary key, the per-sample table, loss and KL curves, the probes' diversity
plot, training samples, the last step's metrics, the configuration) is folded in ``<details>``. A run
without categories or success keys (another reward, a block-diffusion LM) shows what it has."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from diffusionrl.video import gif_bytes, png_bytes

TEMPLATE = "report.html.j2"
SEEDS_SHOWN = 4  # seeds per prompt and side in the sample grid
THUMB_PX = 128  # a thumbnail's width at most (a 64 px image is shown at 2x)


def data_uri(image: np.ndarray) -> str:
    """An image ``[H, W, 3]`` as a PNG ``data:`` URI, frames ``[F, H, W, 3]`` as an animated GIF one."""
    if image.ndim == 4:
        return "data:image/gif;base64," + base64.b64encode(gif_bytes(image)).decode()
    return "data:image/png;base64," + base64.b64encode(png_bytes(np.ascontiguousarray(image))).decode()


def fmt(value, spec: str = ".2f") -> str:
    """A figure for the page: ``-`` where there is none (missing, None or NaN)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec) if isinstance(value, (int, float, np.floating, np.integer)) else str(value)


def curves_png(metrics: pd.DataFrame) -> np.ndarray | None:
    """Reward, loss and KL curves against the step, as an RGB array (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("rollout/reward/raw_mean", "reward (mean)"),
        ("train/loss", "loss"),
        ("train/kl_loss", "KL to reference"),
        ("train/approx_kl", "approx KL (old vs new)"),
    ]
    panels = [(k, t) for k, t in panels if k in metrics.columns]
    if metrics.empty or not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3), dpi=80)
    axes = np.atleast_1d(axes)
    for ax, (key, title) in zip(axes, panels):
        ax.plot(metrics["step"], metrics[key], marker=".")
        if key == "rollout/reward/raw_mean" and "rollout/reward/raw_std" in metrics.columns:
            m, s = metrics[key], metrics["rollout/reward/raw_std"]
            ax.fill_between(metrics["step"], m - s, m + s, alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return image


def paired_bootstrap(diff: dict[str, np.ndarray], resamples: int = 2000, seed: int = 0) -> dict[str, np.ndarray]:
    """A paired, stratified bootstrap of per-sample differences (tuned - base) grouped by category: each draw
    resamples every category's samples with replacement; ``{category: [resamples, n] resampled differences}``,
    drawn in the dict's order from one generator seeded ``seed``."""
    rng = np.random.default_rng(seed)
    return {c: d[rng.integers(0, len(d), (resamples, len(d)))] for c, d in diff.items()}


def category_table(eval_table: pd.DataFrame | None, resamples: int = 2000, seed: int = 0,
                   reward: str | None = None) -> pd.DataFrame | None:
    """GenEval's table: per category the prompts, the samples and the base and tuned accuracy, then
    ``overall`` by GenEval's rule (the mean of the category accuracies, each category counting once
    however many prompts it holds) and ``all samples`` (the mean over samples), from an evaluation table
    with a ``category`` column and ``base_<reward>_success`` / ``tuned_<reward>_success`` columns
    (geneval_mini's; ``reward`` names which, by default the first); None for other tables. With
    ``base_cfg_<reward>_success`` (``eval.base_guidance_scale``), a ``base_cfg`` column between them.

    ``gain_lo`` / ``gain_hi``: the 5th and 95th percentiles of each row's gain over ``resamples`` paired
    bootstrap draws of the samples, within each category (a category of one prompt and a few seeds moves
    ``overall`` as much as one of fourteen prompts: the interval says how far the seeds alone move it)."""
    if eval_table is None or "category" not in eval_table:
        return None
    base = (f"base_{reward}_success" if reward else
            next((c for c in eval_table.columns if c.startswith("base_") and c.endswith("_success")), None))
    if base not in eval_table:
        return None
    tuned = "tuned_" + base[len("base_"):]
    sides = {"base": base, **({"base_cfg": f"base_cfg_{base[len('base_'):]}"}
                              if f"base_cfg_{base[len('base_'):]}" in eval_table else {}), "tuned": tuned}
    table = eval_table.groupby("category").agg(prompts=("prompt", "nunique"), samples=("prompt", "size"),
                                                **{side: (column, "mean") for side, column in sides.items()})
    n_prompts = eval_table["prompt"].nunique()
    table.loc["overall"] = [n_prompts, len(eval_table), *(table[side].mean() for side in sides)]
    table.loc["all samples"] = [n_prompts, len(eval_table), *(eval_table[column].mean() for column in sides.values())]
    table["gain"] = table["tuned"] - table["base"]
    cats = [c for c in table.index if c not in ("overall", "all samples")]
    diff = {c: (eval_table.loc[eval_table["category"] == c, tuned].to_numpy(float)
                - eval_table.loc[eval_table["category"] == c, base].to_numpy(float)) for c in cats}
    draws = paired_bootstrap(diff, resamples, seed)
    gains = {c: v.mean(axis=1) for c, v in draws.items()}
    gains["overall"] = np.mean([gains[c] for c in cats], axis=0)
    gains["all samples"] = np.concatenate([draws[c] for c in cats], axis=1).mean(axis=1)
    table["gain_lo"] = [float(np.percentile(gains[c], 5)) for c in table.index]
    table["gain_hi"] = [float(np.percentile(gains[c], 95)) for c in table.index]
    return table.reset_index()


def alarm_png(metrics: pd.DataFrame) -> tuple[np.ndarray | None, list]:
    """The reward-hacking plot: the training reward per step and the held-out probes' reward (and
    diversity, right axis) against the policy version, each alarm a red line; and the alarms
    (``heldout.hacking_alarms``). (None, []) when the run has no probes."""
    from diffusionrl.heldout import DIVERSITY_KEY, HELDOUT_KEY, TRAIN_KEY, hacking_alarms

    if metrics is None or metrics.empty or HELDOUT_KEY not in metrics.columns:
        return None, []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{k: v for k, v in r.items() if not (isinstance(v, float) and np.isnan(v))}
            for r in metrics.to_dict("records")]
    alarms = hacking_alarms(rows)
    probes = metrics.dropna(subset=[HELDOUT_KEY])
    fig, ax = plt.subplots(figsize=(8, 3.2), dpi=80)
    if TRAIN_KEY in metrics.columns:
        ax.plot(metrics["step"] - 1, metrics[TRAIN_KEY], ".-", alpha=0.6, label="training reward (rollouts)")
    ax.plot(probes["heldout/policy_version"], probes[HELDOUT_KEY], "o-", color="C2", label="held-out reward (ODE)")
    ax.set_xlabel("policy version (updates)")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    if DIVERSITY_KEY in probes.columns:
        ax2 = ax.twinx()
        ax2.plot(probes["heldout/policy_version"], probes[DIVERSITY_KEY], "s--", color="C4", label="diversity")
        ax2.set_ylabel("diversity")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="lower right", fontsize=8)
    for alarm in alarms:
        ax.axvline(alarm.policy_version, color="red", alpha=0.6)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("reward-hacking alarm" + (f": {len(alarms)} alarm(s)" if alarms else ": no alarm"))
    fig.tight_layout()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return image, alarms


def _figure_rgb(fig) -> np.ndarray:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.canvas.draw()
    image = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return image


def success_rewards(columns) -> list[str]:
    """The rewards with a strict success (``base_<reward>_success`` in an evaluation table's columns, or
    ``eval/base_<reward>_success`` among a summary's keys, not its ``.../<figure>`` keys)."""
    names = [c.removeprefix("eval/") for c in columns]
    return sorted(n[len("base_"):-len("_success")] for n in names if n.startswith("base_")
                  and n.endswith("_success") and "/" not in n and not n.startswith("base_cfg_"))


def report_judge(config: dict[str, Any], columns) -> str | None:
    """The judge whose strict verdict the report's table, curve and thumbnails show: the first reward of
    ``reward.weights`` with a strict success among ``columns`` (the trained one; a judge at weight 0 beside
    it stays in the headline), else the first with one; None without any."""
    found = success_rewards(columns)
    weights = ((config.get("reward") or {}).get("weights") or {}) if isinstance(config, dict) else {}
    return next((n for n in weights if n in found), found[0] if found else None)


def training_curve_png(metrics: pd.DataFrame | None, alarms=(), judge: str | None = None) -> np.ndarray | None:
    """One plot against the step: the rollout reward (partial credit on the shapes world; its spread
    shaded) or, without rollouts (SFT), the loss; the held-out probes' strict success (``judge``'s, by
    default the first), else their reward; each reward-hacking alarm a red line. None without either curve."""
    from diffusionrl.heldout import HELDOUT_KEY, TRAIN_KEY

    if metrics is None or metrics.empty or "step" not in metrics:
        return None
    train = next((k for k in (TRAIN_KEY, "train/loss") if k in metrics and metrics[k].notna().any()), None)
    strict = sorted((c for c in metrics.columns if c.startswith("heldout/") and c.endswith("_success")),
                    key=lambda c: (c != f"heldout/{judge}_success", c))  # the judge's first, then by name
    held = next((k for k in [*strict, HELDOUT_KEY] if k in metrics and metrics[k].notna().any()), None)
    if train is None and held is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 2.9), dpi=100)
    if train is not None:
        rows = metrics.dropna(subset=[train])
        label = ("train: loss" if train != TRAIN_KEY else
                 "train: rollout reward (partial credit)" if strict else "train: rollout reward")
        ax.plot(rows["step"], rows[train], ".-", color="C0", alpha=0.8, label=label)
        if train == TRAIN_KEY and "rollout/reward/raw_std" in rows:
            ax.fill_between(rows["step"], rows[train] - rows["rollout/reward/raw_std"],
                            rows[train] + rows["rollout/reward/raw_std"], color="C0", alpha=0.15)
    if held is not None:
        probes = metrics.dropna(subset=[held])
        label = ("held-out: reward (ODE)" if held not in strict else "held-out: strict success" +
                 (f" ({held[len('heldout/'):-len('_success')]})" if len(strict) > 1 else ""))
        ax.plot(probes["step"], probes[held], "o-", color="C2", label=label)
    for alarm in alarms:
        ax.axvline(alarm.step, color="red", alpha=0.6)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return _figure_rgb(fig)


def headline(summary: dict[str, float] | None, config: dict[str, Any]) -> dict | None:
    """The top lines: base, base with CFG (when evaluated) and tuned, each a row of figures."""
    if not summary:
        return None
    eval_cfg = config.get("eval", {}) if isinstance(config, dict) else {}
    scale = eval_cfg.get("guidance_scale")
    how = "" if scale is None else ", CFG-free" if scale <= 1 else f", CFG {scale:g}"
    sides = [("base" + how, "eval/base_", False)]
    if "eval/base_cfg_guidance_scale" in summary:
        sides.append((f"base, CFG {summary['eval/base_cfg_guidance_scale']:g}", "eval/base_cfg_", False))
    sides.append(("tuned" + how, "eval/", True))
    weights = (config.get("reward", {}) or {}).get("weights", {}) if isinstance(config, dict) else {}
    seeds = int(summary.get("eval/seeds_per_prompt", 0))
    columns: list[tuple[str, Any]] = []
    for name in success_rewards(summary):
        tag = f" ({name})" if len(success_rewards(summary)) > 1 else ""
        columns += [(f"strict success{tag}", lambda p, n=name: summary.get(f"{p}{n}_success")),
                    (f"GenEval overall{tag}", lambda p, n=name: summary.get(f"{p}{n}_success/category_mean")),
                    (f"prompts with a success in {seeds} seeds{tag}",
                     lambda p, n=name: summary.get(f"{p}{n}_success/prompts_with_a_success"))]

    def reward(prefix: str):
        if prefix != "eval/base_cfg_":
            return summary.get(f"{prefix}reward_mean")
        parts = [(w, summary.get(f"eval/base_cfg_{n}_mean")) for n, w in weights.items()]
        return sum(w * v for w, v in parts) if parts and all(v is not None for _, v in parts) else None

    columns += [("reward", reward),
                ("diversity", lambda p: summary.get({"eval/": "eval/diversity"}.get(p, f"{p}diversity"))),
                ("wins over base", lambda p: summary.get("eval/win_rate") if p == "eval/" else None)]
    rows = [{"label": label, "lead": lead, "values": [fmt(get(prefix), ".3g" if title == "reward" else ".2f")
                                                      for title, get in columns]}
            for label, prefix, lead in sides]
    keep = [i for i in range(len(columns)) if any(r["values"][i] != "-" for r in rows)]
    for r in rows:
        r["values"] = [r["values"][i] for i in keep]
    note = f"{int(summary.get('eval/num_prompts', 0))} held-out prompts x {seeds} seeds, the same seeds on every line"
    return {"columns": [columns[i][0] for i in keep], "rows": rows, "note": note}


def category_rows(eval_table: pd.DataFrame | None, judge: str | None = None) -> dict | None:
    table = category_table(eval_table, reward=judge)
    if table is None:
        return None
    sides = [s for s in ("base", "base_cfg", "tuned") if s in table]
    columns = ["category", "prompts", "samples", *(s.replace("base_cfg", "base with CFG") for s in sides),
               "gain (tuned - base)", "5-95% over seeds"]
    rows = [{"lead": r["category"] in ("overall", "all samples"),
             "values": [r["category"], int(r["prompts"]), int(r["samples"]), *(fmt(r[s]) for s in sides),
                        fmt(r["gain"], "+.2f"), f"{r['gain_lo']:+.2f} .. {r['gain_hi']:+.2f}"]}
            for r in table.to_dict("records")]
    several = len(success_rewards(eval_table.columns)) > 1
    return {"columns": columns, "rows": rows, "judge": f" ({judge})" if judge and several else ""}


def sample_rows(eval_table: pd.DataFrame, grid: np.ndarray, judge: str | None = None) -> dict:
    """Each held-out prompt (and input image, for edits) a row: up to ``SEEDS_SHOWN`` of its samples per
    side, cut from the evaluation grid (base band above tuned, an edit's input band above both; one
    column per sample, a prompt's samples side by side), each with its strict verdict when there is one."""
    n = len(eval_table)
    editing = "input_image_sha256" in eval_table.columns
    sides = ("input", "base", "tuned") if editing else ("base", "tuned")
    h, w = grid.shape[-3] // len(sides), grid.shape[-2] // n
    judge = judge or next(iter(success_rewards(eval_table.columns)), None)  # whose verdict: by default the first
    samples = eval_table.to_dict("records")
    key = ["prompt", "input_image_sha256"] if editing else ["prompt"]
    rows, start, most = [], 0, 0
    while start < n:
        end = start
        while end < n and all(samples[end][k] == samples[start][k] for k in key):
            end += 1
        most = max(most, end - start)
        cells = []
        for k, side in enumerate(sides):
            shown = range(start, start + 1) if side == "input" else range(start, min(end, start + SEEDS_SHOWN))
            cells.append([{"alt": side, "width": min(2 * w, THUMB_PX),
                           "src": data_uri(grid[..., k * h:(k + 1) * h, i * w:(i + 1) * w, :]),
                           "ok": (bool(samples[i][f"{side}_{judge}_success"] >= 0.5)
                                  if judge and side != "input" else None)} for i in shown])
        rows.append({"prompt": samples[start]["prompt"], "category": samples[start].get("category", ""),
                     "cells": cells})
        start = end
    title = "Held-out edits: input, base | tuned" if editing else "Held-out prompts: base | tuned"
    note = (f"the first {SEEDS_SHOWN} of {most} seeds per prompt; every sample is in the per-sample table below"
            if most > SEEDS_SHOWN else "")
    verdict = f", {chr(10003)} / {chr(10007)}: {judge}'s strict verdict" if judge else ""
    return {"title": f"{title}, same seeds{verdict}", "sides": sides, "rows": rows, "note": note}


def build_report(
    *,
    config: dict[str, Any],
    metrics: pd.DataFrame | None,
    eval_table: pd.DataFrame | None,
    eval_summary: dict[str, float] | None,
    grid: np.ndarray | None,
    sample_grids: dict[str, np.ndarray] | None = None,
    artifacts: dict[str, str] | None = None,
    title: str = "diffusionrl run report",
) -> str:
    """The run report as one self-contained HTML page.

    Args:
        config (`dict`): the run's config (``Config.to_dict()``); its ``eval.guidance_scale`` names the lines.
        metrics (`pd.DataFrame` or `None`): one row per step (``metrics.jsonl``), with ``step``.
        eval_table (`pd.DataFrame` or `None`): the evaluation's per-sample table (``EvalResult.table``).
        eval_summary (`dict[str, float]` or `None`): the evaluation's summary (``EvalResult.summary``).
        grid (`np.ndarray` or `None`): the evaluation grid (``EvalResult.grid``), uint8 ``[H, W, 3]`` or frames.
        sample_grids (`dict[str, np.ndarray]`, *optional*): training sample grids by name (folded).
        artifacts (`dict[str, str]`, *optional*): where the run's files are, by name.
        title (`str`, *optional*, defaults to ``"diffusionrl run report"``): the page's title.

    Returns:
        `str`: the HTML page.
    """
    import jinja2

    from diffusionrl.heldout import hacking_alarms

    alarms = []
    if metrics is not None and not metrics.empty:
        records = [{k: v for k, v in r.items() if not (isinstance(v, float) and np.isnan(v))}
                   for r in metrics.to_dict("records")]
        alarms = hacking_alarms(records)
    judge = report_judge(config, eval_table.columns if eval_table is not None else [])
    curve = training_curve_png(metrics, alarms, judge)
    plots = []
    more = curves_png(metrics) if metrics is not None else None
    if more is not None:
        plots.append({"title": "Loss and KL curves", "src": data_uri(more), "width": None})
    probe_plot, _ = alarm_png(metrics)
    if probe_plot is not None:
        plots.append({"title": "Held-out probes: reward and diversity per policy version", "src": data_uri(probe_plot),
                      "width": None})
    plots += [{"title": f"Training samples: {name}", "src": data_uri(image), "width": min(1400, image.shape[-2] * 2)}
              for name, image in (sample_grids or {}).items()]
    has_table = eval_table is not None and len(eval_table) > 0
    samples = sample_rows(eval_table, grid, judge) if grid is not None and has_table else None
    whole = ({"src": data_uri(grid), "width": min(1400, grid.shape[-2] * 2)}
             if grid is not None and samples is None else None)
    eval_cfg = config.get("eval", {}) if isinstance(config, dict) else {}
    model, algorithm = (config.get("model", {}) or {}).get("name"), (config.get("algorithm", {}) or {}).get("name")
    guidance = eval_cfg.get("guidance_scale")
    subtitle = " | ".join(x for x in (f"model {model}" if model else "", f"algorithm {algorithm}" if algorithm else "",
                                      f"evaluated at guidance {guidance:g}" if guidance is not None else "") if x)
    last = metrics.iloc[-1].to_dict() if metrics is not None and not metrics.empty else {}
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    return env.get_template(TEMPLATE).render(
        title=title, subtitle=subtitle, headline=headline(eval_summary, config),
        categories=category_rows(eval_table, judge),
        curve=data_uri(curve) if curve is not None else None, alarms=alarms, samples=samples, whole_grid=whole,
        artifacts=list((artifacts or {}).items()),
        summary_rows=[(k, fmt(v, ".6g")) for k, v in sorted((eval_summary or {}).items())],
        eval_rows={"columns": list(eval_table.columns),
                   "rows": [[fmt(v, ".4g") if isinstance(v, float) else v for v in r]
                            for r in eval_table.itertuples(index=False)]} if has_table else None,
        plots=plots, last_rows=[(str(k), fmt(v, ".6g")) for k, v in sorted(last.items(), key=lambda kv: str(kv[0]))
                                if isinstance(v, (int, float)) and not isinstance(v, bool)],
        config_json=json.dumps(config, indent=1, sort_keys=True, default=str))
