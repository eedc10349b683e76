"""Held-out probes during training and the reward-hacking alarm (diffusionrl.heldout)."""

import json

import numpy as np
import pandas as pd

from diffusionrl.heldout import ALARM_KEY, diversity, hacking_alarms


def _probe(step, version, score, div=0.2, std=0.05, n=25):
    return {"heldout/reward_mean": score, "heldout/reward_std": std, "heldout/num_samples": n,
            "heldout/policy_version": version, "heldout/diversity": div, "step": step}


def _rows(train, probes):
    """One metrics row per step with the training reward; ``probes`` maps a version to its probe fields."""
    rows = []
    for version, reward in enumerate(train):
        row = {"step": version + 1, "rollout/reward/raw_mean": reward}
        if version in probes:
            row.update(_probe(version + 1, version, *probes[version]))
        rows.append(row)
    return rows


def test_diversity_is_zero_for_one_picture_and_ignores_pairs_of_one_prompt():
    rng = np.random.default_rng(0)
    same = np.repeat(rng.integers(0, 255, (1, 16, 16, 3), dtype=np.uint8), 4, axis=0)
    assert diversity(same, ["a", "b", "c", "d"]) == 0.0
    different = rng.integers(0, 255, (4, 16, 16, 3), dtype=np.uint8)
    assert diversity(different, ["a", "b", "c", "d"]) > 0.2
    # pairs of the same prompt do not count: two prompts, each drawn twice alike
    pairs = np.concatenate([same[:2], np.full((2, 16, 16, 3), 255, np.uint8)])
    assert diversity(pairs, ["a", "a", "b", "b"]) == diversity(pairs[[0, 2]], ["a", "b"])
    assert np.isnan(diversity(different, ["a"] * 4))


def test_the_alarm_goes_off_when_training_reward_rises_and_held_out_falls():
    train = list(np.linspace(0.2, 0.6, 30))
    rows = _rows(train, {0: (0.30,), 10: (0.32,), 20: (0.20,)})
    (alarm,) = hacking_alarms(rows)
    assert alarm.step == 21 and alarm.policy_version == 20 and "held-out reward fell to 0.2" in alarm.reason


def test_no_alarm_when_both_rise_or_the_drop_is_within_noise_or_training_reward_is_flat():
    train = list(np.linspace(0.2, 0.6, 30))
    assert hacking_alarms(_rows(train, {0: (0.30,), 10: (0.35,), 20: (0.45,)})) == []
    assert hacking_alarms(_rows(train, {0: (0.30,), 10: (0.31,), 20: (0.29,)})) == []  # 2 se is 0.028
    flat = [0.3] * 30
    assert hacking_alarms(_rows(flat, {0: (0.30,), 10: (0.25,), 20: (0.10,)})) == []


def test_a_watched_judge_that_falls_while_the_trained_one_holds_is_an_alarm():
    """Training on GenEval's rules with the exact-scene judge at weight 0: the policy crowds its
    pictures, the trained judge's held-out mean holds and the watched one's falls."""
    train = list(np.linspace(0.55, 0.75, 30))
    watched = {0: (0.61, 0.47), 10: (0.66, 0.38), 20: (0.65, 0.30)}
    rows = _rows(train, {v: (trained,) for v, (trained, _) in watched.items()})
    for row in rows:
        if "heldout/reward_mean" in row:
            trained, exact = watched[int(row["heldout/policy_version"])]
            row.update({"heldout/geneval_mini_rules_mean": trained, "heldout/geneval_mini_rules_std": 0.2,
                        "heldout/geneval_mini_mean": exact, "heldout/geneval_mini_std": 0.2})
    (alarm,) = hacking_alarms(rows)
    assert alarm.policy_version == 20 and "held-out geneval_mini fell to 0.3 from 0.47" in alarm.reason
    assert "geneval_mini_rules fell" not in alarm.reason and "held-out reward fell" not in alarm.reason


def test_the_alarm_goes_off_when_diversity_collapses():
    train = list(np.linspace(0.2, 0.6, 30))
    (alarm,) = hacking_alarms(_rows(train, {0: (0.30, 0.20), 10: (0.40, 0.15), 20: (0.45, 0.08)}))
    assert alarm.policy_version == 20 and "diversity collapsed to 0.08" in alarm.reason


def test_every_image_run_probes_held_out_prompts_and_records_the_alarm(tmp_path):
    from diffusionrl.config import load_config
    from diffusionrl.report import alarm_png
    from diffusionrl.train import train

    cfg = load_config("tiny-cpu", overrides=[
        "train.steps=3", "train.prompts_per_step=2", "train.group_size=2", "train.micro_batch_size=2",
        "sampling.num_steps=3", "sampling.window_range=[0, 2]", "eval.num_steps=3", "eval.every=2",
        "eval.probe_prompts=3", "train.checkpoint_every=0", "train.log_images_every=0"])
    result = train(cfg, tmp_path / "run", resume=None, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    probed = [r for r in rows if "heldout/reward_mean" in r]
    assert [r["heldout/policy_version"] for r in probed] == [0.0, 2.0]  # the base, then every 2 updates
    # 3 held-out prompts, then a 4th sample to fill whole micro-batches of 2
    assert all(r[ALARM_KEY] in (0.0, 1.0) and r["heldout/num_samples"] == 4 and r["heldout/diversity"] > 0
               for r in probed)
    assert "heldout/jpeg_compressibility_mean" in probed[0] and ALARM_KEY not in rows[1]
    assert result.metrics[0]["heldout/reward_mean"] == probed[0]["heldout/reward_mean"]
    plot, alarms = alarm_png(pd.DataFrame(rows))
    assert plot is not None and plot.ndim == 3 and alarms == hacking_alarms(rows)
