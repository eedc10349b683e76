"""The run report (diffusionrl/report.py + templates/report.html.j2): one screen from the top, everything
else folded; shapes runs with and without a CFG base, other rewards, edits, videos, text escaped."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import numpy as np
import pandas as pd

from diffusionrl.report import build_report

ROOT = Path(__file__).resolve().parents[1]
SEEDS = 6


def shapes_run(cfg: bool = True):
    rng = np.random.default_rng(0)
    prompts = [("a red circle", "single"), ("two blue squares", "counting"), ("<script>alert(1)</script>", "colors")]
    rows = []
    for prompt, category in prompts:
        for seed in range(SEEDS):
            row = {"prompt": prompt, "category": category, "seed": seed, "base_reward": rng.random(),
                   "tuned_reward": rng.random(), "base_geneval_mini_success": float(seed == 0),
                   "tuned_geneval_mini_success": float(seed < 3)}
            if cfg:
                row["base_cfg_geneval_mini_success"] = float(seed < 2)
            rows.append(row)
    table = pd.DataFrame(rows)
    summary = {"eval/base_geneval_mini_success": 1 / 6, "eval/geneval_mini_success": 0.5,
               "eval/base_geneval_mini_success/category_mean": 0.17, "eval/geneval_mini_success/category_mean": 0.5,
               "eval/base_reward_mean": 0.4, "eval/reward_mean": 0.6, "eval/win_rate": 0.55, "eval/num_prompts": 3,
               "eval/seeds_per_prompt": SEEDS, "eval/geneval_mini_mean": 0.6, "eval/base_geneval_mini_mean": 0.4}
    if cfg:
        summary.update({"eval/base_cfg_geneval_mini_success": 1 / 3, "eval/base_cfg_geneval_mini_success/category_mean":
                        0.33, "eval/base_cfg_guidance_scale": 4.5, "eval/base_cfg_geneval_mini_mean": 0.5})
    steps = np.arange(1, 11)
    metrics = pd.DataFrame({"step": steps, "rollout/reward/raw_mean": 0.3 + 0.02 * steps, "train/loss": 0.1})
    metrics["heldout/geneval_mini_success"] = np.where(steps % 5 == 0, 0.2 + 0.01 * steps, np.nan)
    metrics["heldout/reward_mean"] = np.where(steps % 5 == 0, 0.5, np.nan)
    metrics["heldout/policy_version"] = np.where(steps % 5 == 0, steps - 1, np.nan)
    grid = np.zeros((2 * 64, len(table) * 64, 3), np.uint8)
    config = {"eval": {"guidance_scale": 1.0}, "reward": {"weights": {"geneval_mini": 1.0}}}
    return config, metrics, table, summary, grid


def headline_rows(page: str) -> list[list[str]]:
    top = page[page.index("<table>"):page.index("</table>")]
    return [re.findall(r"<t[hd][^>]*>([^<]*)</t[hd]>", row) for row in top.split("<tr")[1:]]


def test_shapes_report_reads_from_the_top():
    config, metrics, table, summary, grid = shapes_run()
    page = build_report(config=config, metrics=metrics, eval_table=table, eval_summary=summary, grid=grid)
    rows = headline_rows(page)
    assert rows[0][:4] == ["held-out prompts", "strict success", "GenEval overall", "reward"]
    assert [r[:4] for r in rows[1:]] == [["base, CFG-free", "0.17", "0.17", "0.4"],
                                         ["base, CFG 4.5", "0.33", "0.33", "0.5"],
                                         ["tuned, CFG-free", "0.50", "0.50", "0.6"]]
    order = [page.index(s) for s in ("<th>held-out prompts</th>", "Strict accuracy per category",
                                     'alt="training curve"', "Held-out prompts: base | tuned", "<details>")]
    assert order == sorted(order)
    assert "<th class=\"num\">base with CFG</th>" in page
    # each prompt a row, 4 of its 6 seeds per side, the verdicts under them
    assert page.count('alt="base"') == page.count('alt="tuned"') == 3 * 4
    assert page.count("&#10003;") == 3 * 1 + 3 * 3  # base: seed 0; tuned: seeds 0-2 (of the 4 shown)
    assert "the first 4 of 6 seeds per prompt" in page
    assert 'width="128"' in page  # 64 px shown at 2x
    # text is escaped, never markup; every figure is still there, folded
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    folded = page[page.index("<details>"):]
    assert "eval/base_cfg_guidance_scale" in folded and "Per-sample evaluation" in folded
    assert "Loss and KL curves" in folded and "Held-out probes: reward and diversity" in folded


def test_without_a_cfg_base_and_without_metrics():
    config, _, table, summary, grid = shapes_run(cfg=False)
    page = build_report(config=config, metrics=None, eval_table=table, eval_summary=summary, grid=grid)
    assert [r[0] for r in headline_rows(page)[1:]] == ["base, CFG-free", "tuned, CFG-free"]
    assert "base with CFG" not in page and 'alt="training curve"' not in page


def test_another_reward_shows_what_it_has():
    config, metrics, table, summary, grid = shapes_run(cfg=False)
    table = table.drop(columns=[c for c in table.columns if "success" in c or c == "category"])
    summary = {k: v for k, v in summary.items() if "success" not in k}
    metrics = metrics.drop(columns=["heldout/geneval_mini_success"])
    page = build_report(config={"eval": {"guidance_scale": 4.5}}, metrics=metrics, eval_table=table,
                        eval_summary=summary, grid=grid)
    rows = headline_rows(page)
    assert rows[0] == ["held-out prompts", "reward", "wins over base"]
    assert rows[1] == ["base, CFG 4.5", "0.4", "-"] and rows[2] == ["tuned, CFG 4.5", "0.6", "0.55"]
    assert "Strict accuracy" not in page and "&#10003;" not in page and "&#10007;" not in page
    assert page.count('alt="base"') == 3 * 4 and 'alt="training curve"' in page


def test_edits_videos_and_a_run_without_pictures():
    config, _, table, summary, _ = shapes_run(cfg=False)
    edits = table.copy()
    edits.insert(1, "input_image_sha256", ["a"] * 3 + ["b"] * 3 + ["c"] * (len(table) - 6))
    grid = np.zeros((3 * 16, len(table) * 16, 3), np.uint8)
    page = build_report(config={}, metrics=None, eval_table=edits, eval_summary=None, grid=grid)
    assert "<th>input</th><th>base</th><th>tuned</th>" in page and page.count('alt="input"') == 4
    assert 'width="32"' in page  # 16 px shown at 2x
    video = np.zeros((3, 2 * 16, len(table) * 16, 3), np.uint8)  # frames
    page = build_report(config={}, metrics=None, eval_table=table, eval_summary=None, grid=video)
    assert page.count("data:image/gif;base64,") == 2 * 3 * 4
    text = pd.DataFrame({"prompt": ["1+1="], "base_reward": [0.0], "tuned_reward": [1.0]})
    page = build_report(config={}, metrics=pd.DataFrame(), eval_table=text, eval_summary={"eval/reward_mean": 1.0},
                        grid=None, title="block-diffusion LM report")
    assert "<img" not in page and "1+1=" in page and "<title>block-diffusion LM report</title>" in page


def test_the_template_ships_with_the_package():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["diffusionrl"]
    assert "templates/*.html.j2" in data and (ROOT / "diffusionrl" / "templates" / "report.html.j2").is_file()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.startswith("jinja2") for d in deps)
