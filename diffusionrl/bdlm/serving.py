"""A trained block-diffusion LM as an MLflow pyfunc model: digit prompts in, decoded answers out.

``mlflow.pyfunc.load_model("models:/tiny-bdlm-sort@champion").predict({"prompt": ["3142", "907"]})``
returns ``["1234", "079"]`` for a model that learnt the task (greedy decoding with the run's block size,
generation length and evaluation threshold). The model folder (``bdlm_model.json`` + weights) is an
artifact of the MLflow model, and the decoding settings are its ``decoding.json``, so nothing outside
the artifact is needed. ``predict`` refuses, in one line, a request outside ``request_limits``
(1 to 64 prompts of at most 1000 characters, ``threshold`` in (0, 1]; the model's ``request_limits``
metadata) before it decodes anything.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlflow.pyfunc
import pandas as pd

DECODING_FILE = "decoding.json"


class BDLMDecoder(mlflow.pyfunc.PythonModel):
    """pyfunc wrapper: ``predict`` takes a ``prompt`` column (or a list of strings)."""

    def load_context(self, context) -> None:
        from .loading import load_bdlm

        self.adapter = load_bdlm(context.artifacts["model"])
        self.settings = json.loads(Path(context.artifacts["decoding"]).read_text())

    def predict(self, context, model_input, params=None) -> list[str]:
        import torch

        from diffusionrl.serving.request_limits import check_params, prompts_of

        from .sampler import decode
        from .task import Example, encode_prompts, parse_answer

        prompts = prompts_of(model_input)
        s = {**self.settings, **check_params(params)}
        ids = encode_prompts([Example(p, "") for p in prompts], s["prompt_length"], self.adapter.vocab)
        kind = getattr(self.adapter, "kind", "")
        if kind in ("diffusiongemma", "llada2"):  # through the stock pipeline (DiffusionGemma / LLaDA2)
            generated = pipeline_greedy(self.adapter, ids, s)
            return [parse_answer(row, self.adapter.vocab) for row in generated.tolist()]
        with torch.no_grad():
            out = decode(self.adapter, ids, gen_length=s["gen_length"], block_size=s["block_size"],
                         temperature=s["temperature"], threshold=float(s["threshold"]), seeds=None)
        return [parse_answer(row, self.adapter.vocab) for row in out.tokens[:, s["prompt_length"]:].tolist()]


def pipeline_greedy(adapter, ids, s: dict):
    """Greedy decoding of prompt ids ``[B, P]`` through the model's stock diffusers pipeline."""
    from .config import BDLMModelConfig

    mc = BDLMModelConfig(gen_length=s["gen_length"], block_size=s["block_size"],
                         steps_per_block=s.get("steps_per_block", 4), threshold=float(s["threshold"]),
                         editing_threshold=s.get("editing_threshold", 0.0), max_post_steps=s.get("max_post_steps", 4))
    if adapter.kind == "llada2":
        from .llada2 import decode_greedy

        return decode_greedy(adapter, mc, ids, len(ids), mc.threshold)
    from .gemma_rollout import decode_greedy

    return decode_greedy(adapter, mc, [adapter.vocab.decode(r) for r in ids], len(ids), mc.threshold)


def decoding_settings(cfg) -> dict:
    return {"prompt_length": cfg.task.prompt_length, "gen_length": cfg.model.gen_length,
            "block_size": cfg.model.block_size, "temperature": cfg.model.temperature,
            "threshold": cfg.eval.threshold, "task": cfg.task.kind, "steps_per_block": cfg.model.steps_per_block,
            "editing_threshold": cfg.model.editing_threshold, "max_post_steps": cfg.model.max_post_steps}


def log_bdlm_model(run, cfg, model_dir: str | Path, example_prompt: str, metadata: dict[str, str]):
    """Log ``model_dir`` as a pyfunc model of the workflow ``run`` -> ModelInfo (MLflow validates the
    input example by loading the model and decoding it)."""
    import tempfile

    import mlflow
    from mlflow.models import Model, ModelSignature
    from mlflow.types import DataType, ParamSchema, ParamSpec, Schema
    from mlflow.types.schema import ColSpec

    from diffusionrl.serving.request_limits import describe

    mlflow.set_tracking_uri(run.uri)
    mlflow.set_registry_uri(run.uri)
    mlflow.set_experiment(experiment_id=run.experiment_id)
    signature = ModelSignature(
        inputs=Schema([ColSpec(type=DataType.string, name="prompt")]),
        outputs=Schema([ColSpec(type=DataType.string, name="answer")]),
        params=ParamSchema([ParamSpec(name="threshold", dtype=DataType.double, default=float(cfg.eval.threshold))]),
    )
    with tempfile.TemporaryDirectory() as tmp:
        decoding = Path(tmp) / DECODING_FILE
        decoding.write_text(json.dumps(decoding_settings(cfg), indent=1))
        # Model.log (what pyfunc.log_model wraps) takes the run explicitly: the workflow run stays open.
        return Model.log(
            artifact_path=None,
            name="bdlm",
            flavor=mlflow.pyfunc,
            run_id=run.run_id,
            metadata={**metadata, "request_limits": describe(["threshold"])},
            python_model=str(Path(__file__).with_name("pyfunc_model.py")),  # models from code
            artifacts={"model": str(model_dir), "decoding": str(decoding)},
            signature=signature,
            input_example=pd.DataFrame({"prompt": [example_prompt]}),
            pip_requirements=["torch", "safetensors", "numpy", "pandas", "mlflow"]
            + (["transformers", "diffusers"] if not cfg.model.name.startswith("builtin:tiny-bdlm") else []),
        )


def register_bdlm_model(run, cfg, model_dir: str | Path, test_digest: str, summary: dict[str, float],
                        lineage: dict[str, str]):
    """Log the policy in ``model_dir`` and register it on ``summary``'s ``eval.champion_metric`` (above
    the warm-start model's with ``eval.champion_over_base``); a champion evaluated otherwise is
    re-scored on this run's held-out split. -> ``serving.Registration``."""
    from diffusionrl.serving import champion_scores, register

    from .evaluation import eval_key, evaluate
    from .task import make_splits

    example = make_splits(cfg.task).test[0].prompt
    info = log_bdlm_model(run, cfg, model_dir, example, lineage)

    def rescore(downloaded: Path) -> float:
        return evaluate(cfg, downloaded / "artifacts" / "model")[cfg.eval.champion_metric]

    score, base_score = champion_scores(cfg, summary)
    return register(run, cfg, info, score, eval_key(cfg, test_digest), lineage, rescore=rescore,
                    base_score=base_score)
