"""The registry's @champion is decided on the configured held-out figure (``eval.champion_metric``)
and, with ``eval.champion_over_base``, only above the base model's on the same evaluation: a tuned
model worse than the weights it started from stays ``candidate``, the first version included.
A SQLite store (fast); tests/test_tracking.py covers the server and the whole workflow."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from diffusionrl import serving, tracking
from diffusionrl.bdlm.config import load_bdlm_config
from diffusionrl.config import ConfigError
from diffusionrl.errors import UserError

from .conftest import tiny_config

STRICT = "eval/geneval_mini_success/category_mean"


def shapes_config(*extra: str):
    return tiny_config("reward.weights={geneval_mini: 1.0}", f"eval.champion_metric={STRICT}", *extra)


def test_champion_scores_reads_the_metric_and_the_base_models_figure():
    summary = {"eval/reward_mean": 0.46, "eval/base_reward_mean": 0.40, STRICT: 0.28,
               "eval/base_geneval_mini_success/category_mean": 0.32}
    assert serving.base_metric(STRICT) == "eval/base_geneval_mini_success/category_mean"
    assert serving.champion_scores(shapes_config(), summary) == (0.28, 0.32)
    assert serving.champion_scores(tiny_config(), summary) == (0.46, 0.40)
    assert serving.champion_scores(shapes_config("eval.champion_over_base=false"), summary) == (0.28, None)
    assert serving.champion_scores(shapes_config(), {STRICT: 0.3}) == (0.3, None)  # no base figure: no bar
    with pytest.raises(UserError, match=r"champion_metric='eval/geneval_mini_success/category_mean' is not in .*"
                                        r"it has: eval/reward_mean$"):
        serving.champion_scores(shapes_config(), {"eval/reward_mean": 0.4, "eval/base_reward_mean": 0.3})


def test_decide_against_the_base_model():
    assert not serving.decide(0.28, None, 0.0, base_score=0.32)[0]  # the first version, worse than its base
    promoted, why = serving.decide(0.32, None, 0.0, base_score=0.32)  # a tie is no gain
    assert not promoted and why.startswith("not promoted: eval score 0.32 <= base model 0.32")
    assert not serving.decide(0.35, None, 0.05, base_score=0.32)[0]  # the margin applies to the base too
    assert serving.decide(0.40, None, 0.05, base_score=0.32)[0]
    assert not serving.decide(0.40, 0.45, 0.0, base_score=0.32)[0]  # above the base, below the champion


@pytest.mark.parametrize("metric", ["eval/base_reward_mean", "reward_mean", "eval/jpeg_mean", "eval/geneval_mini_"])
def test_a_champion_metric_that_names_no_tuned_figure_is_refused(metric):
    with pytest.raises(ConfigError, match=r"eval\.champion_metric=.* names no figure"):
        shapes_config(f"eval.champion_metric={metric}")


def test_bdlm_champion_metric_is_one_of_its_figures():
    assert load_bdlm_config(overrides=["eval.champion_metric=eval/exact_match"]).eval.champion_metric
    with pytest.raises(ConfigError, match="eval.champion_metric"):
        load_bdlm_config(overrides=["eval.champion_metric=eval/base_exact_match"])


def test_a_version_worse_than_its_base_is_registered_but_never_champion(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    name = "champion-bar"
    exp = tracking.ensure_experiment(uri, "champion")
    c = tracking.client(uri)
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.txt").write_text("w")

    def register(cfg, summary: dict[str, float]):
        run_id = c.create_run(exp, tags={tracking.STAGE_TAG: "workflow"}).info.run_id
        run = tracking.TrackingRun(uri, exp, run_id, f"exec-{run_id[:6]}")
        score, base = serving.champion_scores(cfg, summary)
        return serving.register(run, cfg, SimpleNamespace(model_uri=str(model)), score, "same-eval",
                                {"base_model_digest": "base"}, base_score=base)

    cfg = shapes_config(f"tracking.uri={uri}", f"tracking.registered_model={name}")
    base = {"eval/base_geneval_mini_success/category_mean": 0.32, "eval/base_reward_mean": 0.40}
    # The demo's outcome: partial credit up, strict score down -- registered, not champion.
    v1 = register(cfg, {**base, STRICT: 0.28, "eval/reward_mean": 0.46})
    assert not v1.promoted and v1.aliases == ["candidate"] and v1.champion_version == ""
    assert "base model 0.32" in v1.decision
    tags = c.get_model_version(name, v1.version).tags
    assert tags["champion_metric"] == STRICT and float(tags["base_score"]) == 0.32 and tags["promoted"] == "false"
    assert serving.show(uri, name)["champion"] is None

    v2 = register(cfg, {**base, STRICT: 0.36, "eval/reward_mean": 0.41})  # strict gain
    assert v2.promoted and serving.show(uri, name)["champion"] == v2.version
    v3 = register(cfg, {**base, STRICT: 0.34, "eval/reward_mean": 0.60})  # above the base, below the champion
    assert not v3.promoted and v3.previous_champion == v2.version and "kept champion" in v3.decision

    # Without the bar a first version is champion whatever its base scored (the old rule).
    loose = shapes_config(f"tracking.uri={uri}", "tracking.registered_model=no-bar", "eval.champion_over_base=false")
    assert register(loose, {**base, STRICT: 0.10}).promoted
