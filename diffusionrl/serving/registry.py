"""The MLflow model registry: register a run's LoRA as a version and decide ``@champion``.

A version is registered for every successful run and gets the alias ``candidate``. It becomes
``champion`` only when its evaluation score (``eval.champion_metric``) beats the current champion's,
and with ``eval.champion_over_base`` the base model's, by more than ``eval.champion_margin`` on the
*same* evaluation (held-out prompts, seeds, steps, guidance,
reward and base weights, hashed into the ``eval_key`` tag). When the champion was evaluated
differently, its adapter is re-evaluated on this run's evaluation first; a champion on other base
weights cannot be compared and is kept. The decision and both scores are recorded as version tags;
the version's description says what it is (``model_card.version_description``), and the logged
adapter's ``README.md`` is its model card.

A version whose MLflow run is ``FAILED`` (its execution failed after registering, or was killed and
closed for a missing heartbeat: ``tracking.heartbeat``) is never a champion: the decision passes
over it to the champion before it (its ``champion_before`` tag, and so on back), compares with
that one and moves ``@champion`` off the failed version; ``show`` lists no champion then
(``champion_ignored`` says why). The decision's parts are in ``champion``, the model that is
registered in ``mlflow_model``, the registry view and its CLI (``python -m diffusionrl.serving
show``) in ``cli``.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from diffusionrl.tracking import Heartbeat, TrackingRun, client, run_url

from .champion import (
    CANDIDATE,
    CHAMPION,
    champion_scores,
    close_if_stale,
    current_champion,
    decide,
    eval_key,
    valid_champion,
)
from .lora_export import PEFT_SUBDIR
from .mlflow_model import log_lora_model

log = logging.getLogger(__name__)


@dataclass
class Registration:
    """A registered version and the champion decision; also the workflows' ``register`` task output
    (a plain dataclass for flytekit: no NaN default, which its JSON schema of the type cannot hold)."""

    name: str
    version: str
    aliases: list[str]
    promoted: bool
    decision: str
    score: float
    champion_version: str  # after the decision
    previous_champion_score: float  # NaN when there was no champion to compare with
    previous_champion: str = ""
    model_uri: str = ""
    run_url: str = ""
    version_url: str = ""
    tags: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def links(self) -> dict[str, str]:
        """The report's lines about the registry and the MLflow run."""
        return {"registered model": f"{self.name} v{self.version} ({', '.join(self.aliases)}): {self.decision} "
                                    f"-> {self.version_url}",
                "MLflow run": self.run_url}


# -- registration and the champion decision ---------------------------------------------------------------


def register(run: TrackingRun, cfg, model_info, score: float, key: str, lineage: dict[str, str],
             rescore: Callable[[Path], float] | None = None, description: str = "",
             base_score: float | None = None) -> Registration:
    """Register ``model_info`` as a version (alias candidate) and move ``champion`` only if better
    than the champion and than ``base_score`` (the base model's on the same evaluation; None: no bar).

    ``rescore(model_dir) -> score`` re-evaluates another version (its downloaded MLflow model
    folder) on this run's evaluation; it is used when the champion's ``eval_key`` differs from
    ``key`` (same base weights only). ``description`` becomes the version's description.
    """
    import mlflow
    from mlflow.artifacts import download_artifacts

    name = cfg.tracking.registered_model
    margin = cfg.eval.champion_margin
    c = client(run.uri)
    mlflow.set_registry_uri(run.uri)
    alive = Heartbeat(run.uri, [run.run_id])
    alive()  # this run is alive (and set back to RUNNING if it was taken for dead)
    close_if_stale(c, run, current_champion(c, name))
    champion, passed_over = valid_champion(c, name)
    base_tags = {**lineage, "eval_score": repr(score), "eval_key": key, "run_id": run.run_id}
    mv = mlflow.register_model(model_info.model_uri, name, tags=base_tags)
    c.set_registered_model_alias(name, CANDIDATE, mv.version)
    if description:
        c.update_model_version(name, mv.version, description=description)

    champion_score, note = None, ""
    if champion is not None:
        ctags = champion.tags
        if ctags.get("eval_key") == key:
            champion_score = float(ctags["eval_score"])
        elif ctags.get("base_model_digest") == lineage.get("base_model_digest") and rescore is not None:
            with tempfile.TemporaryDirectory() as tmp:
                local = Path(download_artifacts(f"models:/{name}/{champion.version}", dst_path=tmp))
                champion_score = float(rescore(local))
            alive(force=True)
            note = f" (champion v{champion.version} re-evaluated on this run's evaluation)"
        else:
            note = (f"not comparable: champion v{champion.version} was trained on other base weights "
                    f"({ctags.get('base_model_digest', '?')[:16]})")
    if champion is not None and champion_score is None:
        promoted, decision = False, f"kept champion: {note}"
    else:
        promoted, decision = decide(score, champion_score, margin, base_score)
        decision += note
    if passed_over:
        decision += f"; passed over {'; '.join(passed_over)}"
    tags = {
        "decision": decision,
        "promoted": str(promoted).lower(),
        "champion_before": str(champion.version) if champion is not None else "",
        "champion_score_compared": repr(champion_score) if champion_score is not None else "",
        "champion_margin": repr(margin),
        "champion_metric": getattr(cfg.eval, "champion_metric", "eval/reward_mean"),
        "base_score": repr(base_score) if base_score is not None else "",
        **({"champion_passed_over": "; ".join(passed_over)[:5000]} if passed_over else {}),
    }
    for k, v in tags.items():
        c.set_model_version_tag(name, mv.version, k, v)
    if promoted:
        c.set_registered_model_alias(name, CHAMPION, mv.version)
    elif passed_over and champion is not None:  # @champion is on a failed run's version: back to the valid one
        c.set_registered_model_alias(name, CHAMPION, champion.version)
    log.info("registered %s v%s: %s", name, mv.version, decision)
    after = current_champion(c, name)
    aliases = [CANDIDATE] + ([CHAMPION] if promoted else [])
    return Registration(
        name=name,
        version=str(mv.version),
        aliases=aliases,
        promoted=promoted,
        decision=decision,
        score=score,
        champion_version=str(after.version) if after is not None else "",
        previous_champion=str(champion.version) if champion is not None else "",
        previous_champion_score=champion_score if champion_score is not None else float("nan"),
        model_uri=f"models:/{name}/{mv.version}",
        run_url=run_url(run),
        version_url=version_url(run.uri, name, mv.version),
        tags={**base_tags, **tags},
    )


# What every saved LoRA's diffusionrl.json records (the run loop's ``save_outputs`` and ``model_card.adapter_facts``)
LORA_INFO_KEYS = ("base_model", "base_model_revision", "base_model_digest", "step", "algorithm", "config_digest",
                  "family", "pipeline_class", "max_sequence_length", "registered_model")


def lora_info(lora_dir: str | Path) -> dict:
    """What the trainer recorded beside the LoRA (``diffusionrl.json``: the model card's and
    description's facts, ``LORA_INFO_KEYS`` and, for a two-expert LoRA, ``lora_experts``); a folder
    without it, or without one of those keys, is refused in one line naming the file."""
    import json

    from diffusionrl.errors import UserError

    path = Path(lora_dir) / "diffusionrl.json"
    fix = "register a LoRA folder this version's trainer saved (a run's <out>/lora), which records them all"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; {fix}") from None
    except ValueError as exc:
        raise UserError(f"{path} is not JSON ({exc}); {fix}") from None
    missing = [k for k in LORA_INFO_KEYS if k not in info] if isinstance(info, dict) else list(LORA_INFO_KEYS)
    if missing:
        raise UserError(f"{path} records no {', '.join(missing)}; {fix}")
    return info


def register_lora(run: TrackingRun, cfg, lora_dir: str | Path, model_path: str, model_digest: str,
                  test_rows: list[dict], test_digest: str, summary: dict[str, float],
                  lineage: dict[str, str]) -> Registration:
    """The image workflow's registration: log the LoRA (base weights referenced by hub id, folder or
    the persistent copy of a builtin model) with its model card (``README.md`` of the adapter folder,
    with the held-out ``summary`` of ``evaluation.evaluate_lora``; also the run's artifact
    ``model_card/README.md``), register it with a description (base model, objective, reward,
    steps, held-out score vs base, run id), and re-score a champion evaluated otherwise on this
    run's held-out prompts. The score is ``summary``'s ``eval.champion_metric``, and the base model's
    the bar it must beat (``champion.champion_scores``)."""
    from diffusionrl.data.images import image_bytes
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.models.fetch import base_model_reference

    from .full_model import log_full_model
    from .model_card import DIFFUSERS, render_card, render_full_card, version_description

    facts = lora_info(lora_dir)
    score, base_score = champion_scores(cfg, summary)
    results = summary
    full = facts.get("finetune") == "full"
    card = render_full_card(facts, results) if full else render_card(facts, results, layout=DIFFUSERS)
    log = log_full_model if full else log_lora_model
    info = log(run, cfg, lora_dir, base_model_reference(cfg.model.name, model_path, model_digest),
               example_prompt=test_rows[0]["prompt"], metadata=lineage, card=card,
               example_image=image_bytes(test_rows[0]["image"]) if test_rows[0].get("image") else None)
    client(run.uri).log_text(run.run_id, card, "model_card/README.md")

    def rescore(model_dir: Path) -> float:
        # mlflow.diffusers keeps the adapter in adapter_weights/, the video pyfunc in artifacts/adapter/, a full
        # fine-tune's pyfunc its model folder in artifacts/model/
        trained = next(p for p in (model_dir / "adapter_weights" / PEFT_SUBDIR,
                                   model_dir / "artifacts" / "adapter" / PEFT_SUBDIR,
                                   model_dir / "artifacts" / "model") if p.is_dir())
        return evaluate_lora(cfg, test_rows, trained, model_path=model_path).summary[cfg.eval.champion_metric]

    key = eval_key(cfg, test_digest, model_digest)
    return register(run, cfg, info, score, key, lineage, rescore=rescore,
                    description=version_description(facts, results, run.run_id), base_score=base_score)


def version_url(uri: str, name: str, version: str) -> str:
    if urlparse(uri).scheme in ("http", "https"):
        return f"{uri.rstrip('/')}/#/models/{name}/versions/{version}"
    return f"models:/{name}/{version} in {uri}"
