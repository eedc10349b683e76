"""The MLflow model registry: log a LoRA as an ``mlflow.diffusers`` model, register a version,
decide ``@champion``, and show the registry.

A version is registered for every successful run and gets the alias ``candidate``. It becomes
``champion`` only when its evaluation score beats the current champion's by more than
``eval.champion_margin`` on the *same* evaluation (held-out prompts, seeds, steps, guidance,
reward and base weights, hashed into the ``eval_key`` tag). When the champion was evaluated
differently, its adapter is re-evaluated on this run's evaluation first; a champion on other base
weights cannot be compared and is kept. The decision and both scores are recorded as version tags.

A version whose MLflow run is ``FAILED`` (its execution failed after registering, or was killed and
closed for a missing heartbeat: ``tracking.heartbeat``) is never a champion: the decision passes
over it to the champion before it (its ``champion_before`` tag, and so on back), compares with
that one and moves ``@champion`` off the failed version; ``show`` lists no champion then
(``champion_ignored`` says why).

    python -m diffusionrl.registry show [--name NAME] [--tracking-uri URI]

prints one JSON object: ``name``, ``champion`` and ``versions`` (each with ``version``,
``aliases``, ``eval_score``, ``run_id`` and the lineage tags).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from diffusionrl.tracking import LINEAGE_KEYS, Heartbeat, TrackingRun, client, fail_stale_runs, resolve_uri, run_url

log = logging.getLogger(__name__)

CANDIDATE = "candidate"
CHAMPION = "champion"
ADAPTER_FILE = "pytorch_lora_weights.safetensors"  # what diffusers' load_lora_weights() reads
PEFT_SUBDIR = "peft"  # our own format, for re-evaluation and warm starts


@dataclass
class Registration:
    name: str
    version: str
    aliases: list[str]
    promoted: bool
    decision: str
    score: float
    champion_version: str  # after the decision
    previous_champion: str = ""
    previous_champion_score: float = float("nan")
    model_uri: str = ""
    run_url: str = ""
    version_url: str = ""
    tags: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


# -- the model --------------------------------------------------------------------------------------


def eval_key(cfg, test_digest: str, base_model_digest: str) -> str:
    """What makes two evaluation scores comparable (16 hex chars)."""
    what = {
        "test_prompts": test_digest,
        "eval": {k: v for k, v in vars(cfg.eval).items() if k != "champion_margin"},
        "resolution": cfg.sampling.eval_resolution or cfg.sampling.resolution,  # evaluation.eval_resolution
        "negative_prompt": cfg.sampling.negative_prompt,
        "ode_solver": cfg.sampling.ode_solver,
        "reward": dict(sorted(cfg.reward.weights.items())),
        "base_model_digest": base_model_digest,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def diffusers_adapter_dir(peft_dir: str | Path, out: str | Path, pipeline_class: str = "StableDiffusion3Pipeline"
                          ) -> Path:
    """A LoRA folder both diffusers (``pytorch_lora_weights.safetensors`` with its adapter metadata,
    so rank and alpha survive, written by the base model's pipeline class: its LoRA loader's key
    layout) and we (``peft/``) can load."""
    import diffusers
    from safetensors.torch import load_file

    peft_dir, out = Path(peft_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(peft_dir / "adapter_model.safetensors"))
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    metadata = {k: config[k] for k in ("r", "lora_alpha", "target_modules", "init_lora_weights", "lora_dropout",
                                        "bias", "use_dora", "use_rslora", "rank_pattern", "alpha_pattern")
                if k in config}
    getattr(diffusers, pipeline_class).save_lora_weights(str(out), transformer_lora_layers=state,
                                                         weight_name=ADAPTER_FILE,
                                                         transformer_lora_adapter_metadata=metadata)
    shutil.copytree(peft_dir, out / PEFT_SUBDIR, dirs_exist_ok=True)
    return out


def image_params(cfg) -> dict:
    """The served image model's generation params: this run's evaluation settings, which must lie
    within ``request_limits.LIMITS`` (a model whose own defaults it would refuse is not logged)."""
    from diffusionrl.request_limits import check_params

    res = cfg.sampling.eval_resolution or cfg.sampling.resolution  # evaluation.eval_resolution
    params = {"num_inference_steps": cfg.eval.num_steps, "guidance_scale": float(cfg.eval.guidance_scale),
              "height": res, "width": res, "negative_prompt": cfg.sampling.negative_prompt}
    return check_params(params, where="the served model's defaults (eval.num_steps, eval.guidance_scale, "
                                      "sampling.eval_resolution, sampling.negative_prompt)")


def model_signature(cfg):
    """prompt -> PNG bytes; generation params default to this run's evaluation settings. ``ParamSpec``
    has no bounds: ``predict`` checks them (``request_limits``; the model's ``request_limits`` metadata)."""
    from mlflow.models import ModelSignature
    from mlflow.types import DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import ColSpec

    types = {int: DataType.integer, float: DataType.double, str: DataType.string}
    return ModelSignature(
        inputs=Schema([ColSpec(type=DataType.string, name="prompt")]),
        outputs=Schema([ColSpec(type=DataType.binary, name="image")]),
        params=ParamSchema([ParamSpec(name=k, dtype=types[type(v)], default=v) for k, v in image_params(cfg).items()]),
    )


def log_lora_model(run: TrackingRun, cfg, peft_dir: str | Path, base_ref: str, example_prompt: str,
                   metadata: dict[str, str]):
    """The LoRA as an ``mlflow.diffusers`` model of the workflow run -> ModelInfo.

    MLflow checks the input example by loading the model through pyfunc and generating from it
    (a failure there is logged as a warning): the registered model is known to serve. Its pyfunc
    refuses requests outside ``request_limits`` (listed in the model's ``request_limits`` metadata)."""
    import mlflow
    import pandas as pd
    from mlflow.models import Model

    from diffusionrl import request_limits
    from diffusionrl.models.families import adapter_class

    mlflow.set_tracking_uri(run.uri)
    mlflow.set_registry_uri(run.uri)
    mlflow.set_experiment(experiment_id=run.experiment_id)  # the logged model lives beside its run
    family = adapter_class(base_ref, cfg.model.revision)
    with tempfile.TemporaryDirectory() as tmp:
        adapter = diffusers_adapter_dir(peft_dir, Path(tmp) / "adapter", family.pipeline_class)
        if family.video:  # mlflow.diffusers serves images only: our pyfunc returns GIFs (video_serving.py)
            from diffusionrl.video_serving import log_video_lora_model

            return log_video_lora_model(run, cfg, adapter, base_ref, ADAPTER_FILE, example_prompt, metadata)
        signature = model_signature(cfg)
        # what mlflow.diffusers.log_model does, its pyfunc loader behind the bounds (request_limits.save_model)
        return Model.log(
            artifact_path=None,
            name="lora",
            flavor=request_limits,
            flavor_name="mlflow.diffusers",
            run_id=run.run_id,
            adapter_path=str(adapter),
            base_model=base_ref,
            signature=signature,
            input_example=pd.DataFrame({"prompt": [example_prompt]}),
            metadata={**metadata, "request_limits": request_limits.describe(p.name for p in signature.params)},
        )


# -- registration and the champion decision ---------------------------------------------------------------


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


def decide(score: float, champion_score: float | None, margin: float) -> tuple[bool, str]:
    if champion_score is None:
        return True, "promoted: first comparable version (no champion yet)"
    if score > champion_score + margin:
        return True, f"promoted: eval score {score:.6g} > champion {champion_score:.6g} + margin {margin:g}"
    return False, f"kept champion: eval score {score:.6g} <= champion {champion_score:.6g} + margin {margin:g}"


def register(run: TrackingRun, cfg, model_info, score: float, key: str, lineage: dict[str, str],
             rescore: Callable[[Path], float] | None = None) -> Registration:
    """Register ``model_info`` as a version (alias candidate) and move ``champion`` only if better.

    ``rescore(model_dir) -> score`` re-evaluates another version (its downloaded MLflow model
    folder) on this run's evaluation; it is used when the champion's ``eval_key`` differs from
    ``key`` (same base weights only).
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
        promoted, decision = decide(score, champion_score, margin)
        decision += note
    if passed_over:
        decision += f"; passed over {'; '.join(passed_over)}"
    tags = {
        "decision": decision,
        "promoted": str(promoted).lower(),
        "champion_before": str(champion.version) if champion is not None else "",
        "champion_score_compared": repr(champion_score) if champion_score is not None else "",
        "champion_margin": repr(margin),
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


def register_lora(run: TrackingRun, cfg, lora_dir: str | Path, model_path: str, model_digest: str,
                  test_rows: list[dict], test_digest: str, score: float, lineage: dict[str, str]) -> Registration:
    """The image workflow's registration: log the LoRA (base weights referenced by hub id, folder or
    the persistent copy of a builtin model), register it, and re-score a champion evaluated
    otherwise on this run's held-out prompts (``evaluation.evaluate_lora``)."""
    from diffusionrl.evaluation import evaluate_lora
    from diffusionrl.models.fetch import base_model_reference

    info = log_lora_model(run, cfg, lora_dir, base_model_reference(cfg.model.name, model_path, model_digest),
                          example_prompt=test_rows[0]["prompt"], metadata=lineage)

    def rescore(model_dir: Path) -> float:
        # mlflow.diffusers keeps the adapter in adapter_weights/, the video pyfunc in artifacts/adapter/
        peft_dir = next(p for p in (model_dir / "adapter_weights" / PEFT_SUBDIR,
                                    model_dir / "artifacts" / "adapter" / PEFT_SUBDIR) if p.is_dir())
        return evaluate_lora(cfg, test_rows, peft_dir, model_path=model_path).summary["eval/reward_mean"]

    key = eval_key(cfg, test_digest, model_digest)
    return register(run, cfg, info, score, key, lineage, rescore=rescore)


def version_url(uri: str, name: str, version: str) -> str:
    if urlparse(uri).scheme in ("http", "https"):
        return f"{uri.rstrip('/')}/#/models/{name}/versions/{version}"
    return f"models:/{name}/{version} in {uri}"


# -- the registry view ----------------------------------------------------------------------------------


def show(uri: str, name: str | None = None) -> dict:
    """The registered model as one JSON-able dict (see the module docstring)."""
    c = client(uri)
    if name is None:
        names = [m.name for m in c.search_registered_models()]
        if len(names) != 1:
            from diffusionrl.config import get_preset

            default = get_preset("tiny-cpu").tracking.registered_model
            if default not in names:
                from diffusionrl.errors import UserError

                raise UserError(f"{len(names)} registered models in {uri} ({', '.join(names) or 'none'}): "
                                "pick one with --name")
            names = [default]
        name = names[0]
    model = c.get_registered_model(name)
    aliases: dict[str, list[str]] = {}
    for alias, version in (model.aliases or {}).items():
        aliases.setdefault(str(version), []).append(alias)
    versions, ignored = [], None
    for mv in sorted(c.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
        tags = mv.tags or {}
        score = tags.get("eval_score")
        status, failed = run_state(c, mv)
        held = sorted(aliases.get(str(mv.version), []))
        entry = {
            "version": str(mv.version),
            "aliases": [a for a in held if not (failed and a == CHAMPION)],
            "eval_score": float(score) if score else None,
            "run_id": mv.run_id,
            "run_status": status,
            **{k: tags.get(k) for k in LINEAGE_KEYS},
            "decision": tags.get("decision"),
            "source": mv.source,
        }
        if failed and CHAMPION in held:  # a failed run's version is never shown as champion
            entry["ignored_aliases"] = [CHAMPION]
            ignored = failed
        versions.append(entry)
    champion = next((v["version"] for v in versions if CHAMPION in v["aliases"]), None)
    out = {"name": name, "tracking_uri": uri, "champion": champion, "versions": versions}
    if ignored:
        out["champion_ignored"] = f"@{CHAMPION} is on {ignored}; the next registration moves it"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m diffusionrl.registry", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("show", help="print the registered model (versions, aliases, scores, lineage) as JSON")
    p.add_argument("--name", help="registered model name (default: the only one, or the tiny-cpu preset's)")
    p.add_argument("--tracking-uri", default="", help="default: $MLFLOW_TRACKING_URI or ./runs/mlflow")
    args = parser.parse_args(argv)
    from diffusionrl.errors import run_cli
    from diffusionrl.tracking.store import cli_store

    def body() -> None:  # an unreachable or mistyped store: one line, exit status 2 (run_cli)
        print(json.dumps(show(cli_store(resolve_uri(args.tracking_uri)), args.name), indent=1))

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
