"""Which version is ``@champion``: comparable evaluations, the decision, and champions whose run failed.

Two evaluation scores are comparable when the evaluations match (held-out prompts, seeds, steps,
guidance, reward and base weights, hashed into the ``eval_key`` tag). A version whose MLflow run is
``FAILED`` (its execution failed after registering, or was killed and closed for a missing
heartbeat: ``tracking.heartbeat``) is never a champion: ``valid_champion`` passes over it to the
champion before it (its ``champion_before`` tag, and so on back).

The score is the evaluation summary's ``eval.champion_metric`` (``eval/reward_mean`` by default; the
shapes presets use the strict success). With ``eval.champion_over_base`` a version must also beat the
base model's score on the same evaluation (``eval/base_...``, ``champion_scores``) by more than
``eval.champion_margin``: a tuned model worse than the weights it started from is registered (alias
``candidate``) but never ``champion``, the first version included.
"""

from __future__ import annotations

import hashlib
import json
import logging

from diffusionrl.tracking import TrackingRun, fail_stale_runs

log = logging.getLogger(__name__)

CANDIDATE = "candidate"
CHAMPION = "champion"
DECISION_ONLY = ("champion_margin", "champion_over_base")  # eval settings that change no score


def base_metric(metric: str) -> str:
    """The base model's key of an evaluation summary key: ``eval/x`` -> ``eval/base_x``."""
    return "eval/base_" + metric.removeprefix("eval/")


def champion_scores(cfg, summary: dict[str, float]) -> tuple[float, float | None]:
    """(the tuned model's ``eval.champion_metric`` in ``summary``, the base model's on the same
    evaluation, or None when ``eval.champion_over_base`` is off or the summary has no base score)."""
    from diffusionrl.errors import UserError

    metric = cfg.eval.champion_metric
    if metric not in summary:
        known = ", ".join(sorted(k for k in summary if k.startswith("eval/") and not k.startswith("eval/base_")))
        raise UserError(f"eval.champion_metric={metric!r} is not in this evaluation's summary; it has: {known}")
    base = summary.get(base_metric(metric)) if cfg.eval.champion_over_base else None
    return float(summary[metric]), (float(base) if base is not None else None)


def eval_key(cfg, test_digest: str, base_model_digest: str) -> str:
    """What makes two evaluation scores comparable (16 hex chars)."""
    what = {
        "test_prompts": test_digest,
        "eval": {k: v for k, v in vars(cfg.eval).items() if k not in DECISION_ONLY},
        "resolution": cfg.sampling.eval_resolution or cfg.sampling.resolution,  # evaluation.eval_resolution
        "negative_prompt": cfg.sampling.negative_prompt,
        "ode_solver": cfg.sampling.ode_solver,
        "reward": dict(sorted(cfg.reward.weights.items())),
        "base_model_digest": base_model_digest,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def current_champion(c, name: str):
    try:
        return c.get_model_version_by_alias(name, CHAMPION)
    except Exception:  # no such model or alias yet
        return None


def run_state(c, mv) -> tuple[str, str]:
    """(status of the version's MLflow run, why it cannot be champion: "" unless that run FAILED)."""
    run_id = (mv.tags or {}).get("run_id") or mv.run_id
    if not run_id:
        return "", ""
    try:
        run = c.get_run(run_id)
    except Exception:  # a run the store no longer has: nothing says it failed
        return "", ""
    if run.info.status != "FAILED":
        return run.info.status, ""
    failure = " ".join(run.data.tags.get("failure", "").split())[:300]
    return "FAILED", f"v{mv.version}: its run {run_id} FAILED" + (f" ({failure})" if failure else "")


def close_if_stale(c, run: TrackingRun, mv) -> None:
    """A champion whose run is still RUNNING in another experiment: close that experiment's runs of
    killed executions first (``start_workflow_run`` did it for this run's experiment)."""
    run_id = ((mv.tags or {}).get("run_id") or mv.run_id) if mv is not None else ""
    try:
        other = c.get_run(run_id) if run_id else None
        if other is not None and other.info.status == "RUNNING" and other.info.experiment_id != run.experiment_id:
            fail_stale_runs(run.uri, other.info.experiment_id, run.execution_id)
    except Exception as exc:  # housekeeping: the decision then sees the run as it is
        log.warning("could not check the champion's run %s for a heartbeat: %s", run_id, exc)


def valid_champion(c, name: str):
    """(the champion whose run did not fail, or None; why each version passed over was) -- from the
    ``@champion`` version back along the ``champion_before`` tags."""
    passed_over: list[str] = []
    seen: set[str] = set()
    mv = current_champion(c, name)
    while mv is not None and str(mv.version) not in seen:
        seen.add(str(mv.version))
        _, why = run_state(c, mv)
        if not why:
            return mv, passed_over
        passed_over.append(why)
        before = (mv.tags or {}).get("champion_before", "")
        try:
            mv = c.get_model_version(name, before) if before else None
        except Exception:  # a deleted version
            mv = None
    return None, passed_over


def decide(score: float, champion_score: float | None, margin: float,
           base_score: float | None = None) -> tuple[bool, str]:
    """(promote?, the decision in words): better than the champion, and than the base model when
    ``base_score`` is given, by more than ``margin``."""
    if base_score is not None and not score > base_score + margin:
        return False, (f"not promoted: eval score {score:.6g} <= base model {base_score:.6g} + margin {margin:g} "
                       "(eval.champion_over_base)")
    if champion_score is None:
        return True, "promoted: first comparable version (no champion yet)"
    if score > champion_score + margin:
        return True, f"promoted: eval score {score:.6g} > champion {champion_score:.6g} + margin {margin:g}"
    return False, f"kept champion: eval score {score:.6g} <= champion {champion_score:.6g} + margin {margin:g}"
