"""The run report: one self-contained HTML page (config, curves, eval table, grids, artifacts).

On the shapes world (an evaluation table with categories and geneval_mini successes) it shows
GenEval's per-category accuracy table, base vs tuned, and each held-out prompt's base and tuned
images (every evaluation seed) side by side with their verdicts. Every run with held-out probes gets
the reward-hacking plot (training reward, held-out reward and diversity, alarms marked)."""

from __future__ import annotations

import base64
import html
import json
from typing import Any

import numpy as np
import pandas as pd

from diffusionrl.video import gif_bytes, png_bytes


def _png_b64(image: np.ndarray) -> str:
    return base64.b64encode(png_bytes(image)).decode()


def _img(image: np.ndarray, alt: str, width: int | None = None) -> str:
    """An ``<img>`` of an image ``[H, W, 3]`` (PNG) or of frames ``[F, H, W, 3]`` (animated GIF)."""
    style = f' style="width:{width}px;image-rendering:pixelated"' if width else ' style="image-rendering:pixelated"'
    if image.ndim == 4:
        src = "data:image/gif;base64," + base64.b64encode(gif_bytes(image)).decode()
    else:
        src = f"data:image/png;base64,{_png_b64(image)}"
    return f'<img alt="{html.escape(alt)}" src="{src}"{style}>'


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


def category_table(eval_table: pd.DataFrame | None, resamples: int = 2000, seed: int = 0) -> pd.DataFrame | None:
    """GenEval's table: per category the prompts, the samples and the base and tuned accuracy, then
    ``overall`` by GenEval's rule (the mean of the category accuracies, each category counting once
    however many prompts it holds) and ``all samples`` (the mean over samples), from an evaluation table
    with a ``category`` column and ``base_<reward>_success`` / ``tuned_<reward>_success`` columns
    (geneval_mini's); None for other tables.

    ``gain_lo`` / ``gain_hi``: the 5th and 95th percentiles of each row's gain over ``resamples`` paired
    bootstrap draws of the samples, within each category (a category of one prompt and a few seeds moves
    ``overall`` as much as one of fourteen prompts: the interval says how far the seeds alone move it)."""
    if eval_table is None or "category" not in eval_table:
        return None
    base = next((c for c in eval_table.columns if c.startswith("base_") and c.endswith("_success")), None)
    if base is None:
        return None
    tuned = "tuned_" + base[len("base_"):]
    table = eval_table.groupby("category").agg(prompts=("prompt", "nunique"), samples=("prompt", "size"),
                                                base=(base, "mean"), tuned=(tuned, "mean"))
    n_prompts = eval_table["prompt"].nunique()
    table.loc["overall"] = [n_prompts, len(eval_table), table["base"].mean(), table["tuned"].mean()]
    table.loc["all samples"] = [n_prompts, len(eval_table), eval_table[base].mean(), eval_table[tuned].mean()]
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


def _side_by_side(eval_table: pd.DataFrame, grid: np.ndarray) -> list[str]:
    """One row per held-out prompt: its category, its base and its tuned images (cut from the eval grid:
    base row above tuned row, one column per sample, a prompt's samples side by side) and whether
    each succeeded; for an editing dataset (an ``input_image_sha256`` column) the input image first (the
    grid's top band), one row per prompt and input."""
    n = len(eval_table)
    editing = "input_image_sha256" in eval_table.columns
    sides = ("input", "base", "tuned") if editing else ("base", "tuned")
    h, w = grid.shape[0] // len(sides), grid.shape[1] // n
    success = next((c[len("base_"):] for c in eval_table.columns if c.startswith("base_") and c.endswith("_success")),
                   None)
    rows = ["<table><tr><th>prompt</th><th>category</th>" + "".join(f"<th>{s}</th>" for s in sides) + "</tr>"]
    samples = list(eval_table.itertuples(index=False))

    def key(i: int) -> tuple:
        return (samples[i].prompt, samples[i].input_image_sha256 if editing else "")

    start = 0
    while start < n:
        end = start
        while end < n and key(end) == key(start):
            end += 1
        cells = []
        for k, side in enumerate(sides):
            band = grid[k * h:(k + 1) * h]
            images = []
            for i in range(start, end if side != "input" else start + 1):  # one input per row
                mark = ""
                if success is not None and side != "input":
                    ok = getattr(samples[i], f"{side}_{success}") >= 0.5
                    mark = f"<br><span class='{'ok' if ok else 'bad'}'>{'&#10003;' if ok else '&#10007;'}</span>"
                image = _img(band[:, i * w:(i + 1) * w], side, width=3 * w)
                images.append(f"<span class='sample'>{image}{mark}</span>")
            cells.append(f"<td>{''.join(images)}</td>")
        row = samples[start]
        rows.append(f"<tr><td>{html.escape(str(row.prompt))}</td><td>{html.escape(str(getattr(row, 'category', '')))}"
                    f"</td>{''.join(cells)}</tr>")
        start = end
    return rows + ["</table>"]


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


def build_report(
    *,
    config: dict[str, Any],
    metrics: pd.DataFrame,
    eval_table: pd.DataFrame | None,
    eval_summary: dict[str, float] | None,
    grid: np.ndarray | None,
    sample_grids: dict[str, np.ndarray] | None = None,
    artifacts: dict[str, str] | None = None,
    title: str = "diffusionrl run report",
) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;margin:1.5em;max-width:1400px}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:2px 6px;font-size:13px}th{background:#f4f4f4}"
        "h2{border-bottom:1px solid #ddd}.ok{color:#070}.bad{color:#a00}"
        ".sample{display:inline-block;text-align:center;margin:0 2px}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    if eval_summary:
        gain = eval_summary.get("eval/reward_gain", 0.0)
        verdict = "ok" if gain > 0 else "bad"
        parts.append(
            f"<p class='{verdict}'><b>Tuned vs base on held-out prompts:</b> reward "
            f"{eval_summary.get('eval/base_reward_mean', float('nan')):.6g} &rarr; "
            f"{eval_summary.get('eval/reward_mean', float('nan')):.6g} (gain {gain:+.3g}), "
            f"win rate {eval_summary.get('eval/win_rate', float('nan')):.2f} over "
            f"{int(eval_summary.get('eval/num_prompts', 0))} prompts.</p>"
        )
        success = sorted(k for k in eval_summary  # eval/base_<reward>_success itself, not its .../<figure> keys
                         if k.startswith("eval/base_") and k.endswith("_success") and "/" not in k[len("eval/"):])
        for key in success:  # e.g. geneval_mini's strict success
            tuned = "eval/" + key[len("eval/base_"):]
            line = (f"<p><b>Strict success ({html.escape(key[len('eval/base_'):-len('_success')])}):</b> "
                    f"{eval_summary[key]:.2f} &rarr; {eval_summary.get(tuned, float('nan')):.2f} over samples")
            if f"{key}/category_mean" in eval_summary:  # GenEval's overall: each category counts once
                line += (f"; GenEval's overall (mean of the categories) {eval_summary[f'{key}/category_mean']:.2f} "
                         f"&rarr; {eval_summary.get(f'{tuned}/category_mean', float('nan')):.2f}")
            if f"{key}/prompts_with_a_success" in eval_summary:
                seeds = int(eval_summary.get("eval/seeds_per_prompt", 0))
                line += (f"; prompts with at least one success among their {seeds} seeds "
                         f"{eval_summary[f'{key}/prompts_with_a_success']:.2f} &rarr; "
                         f"{eval_summary.get(f'{tuned}/prompts_with_a_success', float('nan')):.2f}")
            parts.append(line + "</p>")
        if "eval/diversity" in eval_summary:
            parts.append(f"<p><b>Diversity</b> (mean distance between images of different prompts): "
                         f"{eval_summary.get('eval/base_diversity', float('nan')):.3f} &rarr; "
                         f"{eval_summary['eval/diversity']:.3f}</p>")
    curves = curves_png(metrics) if metrics is not None else None
    if curves is not None:
        parts += ["<h2>Training curves</h2>", _img(curves, "training curves")]
    alarm_plot, alarms = alarm_png(metrics)
    if alarm_plot is not None:
        parts += ["<h2>Held-out probes and the reward-hacking alarm</h2>",
                  "<p>Every <code>eval.every</code> steps the rollout weights draw the held-out prompts (ODE, fixed "
                  "seeds); an alarm marks a probe where the training reward has risen while the held-out reward fell "
                  "or the diversity (mean distance between images of different prompts) halved.</p>",
                  _img(alarm_plot, "reward-hacking alarm")]
        parts += [f"<p class='bad'><b>Alarm at step {a.step}</b> (policy version {a.policy_version}): "
                  f"{html.escape(a.reason)}</p>" for a in alarms]
    if eval_summary:
        parts.append("<h2>Evaluation summary</h2><table>")
        parts += [f"<tr><th>{html.escape(k)}</th><td>{v:.6g}</td></tr>" for k, v in sorted(eval_summary.items())]
        parts.append("</table>")
    per_category = category_table(eval_table)
    if per_category is not None:
        parts += ["<h2>Accuracy per category (held-out prompts): base vs tuned</h2>",
                  per_category.to_html(index=False, float_format=lambda x: f"{x:.2f}")]
    editing = eval_table is not None and "input_image_sha256" in eval_table.columns
    if grid is not None and (per_category is not None or editing) and len(eval_table):
        title = "Held-out edits: input, base vs tuned" if editing else "Held-out prompts: base vs tuned"
        parts += [f"<h2>{title}, same seeds</h2>", *_side_by_side(eval_table, grid)]
    elif grid is not None:
        parts += ["<h2>Held-out prompts: base (top) vs tuned (bottom), same seeds</h2>",
                  _img(grid, "eval grid", width=min(1400, grid.shape[-2] * 2))]
    if eval_table is not None and not eval_table.empty:
        parts += ["<h2>Per-prompt evaluation</h2>", eval_table.to_html(index=False, float_format=lambda x: f"{x:.6g}")]
    for name, image in (sample_grids or {}).items():
        parts += [f"<h2>Training samples: {html.escape(name)}</h2>",
                  _img(image, name, width=min(1400, image.shape[-2] * 2))]
    if artifacts:
        parts.append("<h2>Where everything lives</h2><table>")
        parts += [f"<tr><th>{html.escape(k)}</th><td><code>{html.escape(str(v))}</code></td></tr>"
                  for k, v in artifacts.items()]
        parts.append("</table>")
    if metrics is not None and not metrics.empty:
        last = metrics.iloc[-1].to_dict()
        parts += ["<h2>Last step metrics</h2><table>"]
        parts += [f"<tr><th>{html.escape(str(k))}</th><td>{v:.6g}</td></tr>"
                  for k, v in sorted(last.items()) if isinstance(v, (int, float))]
        parts.append("</table>")
    parts += ["<h2>Configuration</h2>", f"<pre>{html.escape(json.dumps(config, indent=1, sort_keys=True))}</pre>"]
    parts.append("</body></html>")
    return "\n".join(parts)
