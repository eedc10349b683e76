"""The tasks of the block-diffusion LM workflow (``workflows/bdlm.py``).

data -> warm start -> GRPO on exact traces -> evaluation -> MLflow registration -> report. Like
``tasks/pipeline.py`` each body unpacks inputs, calls ``diffusionrl.bdlm`` and packs outputs; the
MLflow run tree, lineage tags, retries and the registry decision are shared with the image workflow.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import NamedTuple, Optional

import pandas as pd
from flytekit import Cache, Resources, current_context, task
from flytekit.types.directory import FlyteDirectory
from flytekit.types.error import FlyteError
from flytekit.types.file import FlyteFile

from diffusionrl.bdlm.config import BDLMConfig, TaskConfig
from diffusionrl.config import apply_overrides
from diffusionrl.tracking import TrackingRun
from images import CPU_IMAGE
from tasks.pipeline import (
    DatasetDigests,
    RegisteredVersion,
    _execution,
    _finish_quietly,
    _flyte_checkpoint,
    _open_train_run,
    close_failed_runs,
    publish_report,
)

log = logging.getLogger(__name__)

DIGITS_CACHE = Cache(version="digits-v1")


@task(container_image=CPU_IMAGE)
def resolve_bdlm_config(config: BDLMConfig, overrides: list[str]) -> BDLMConfig:
    return BDLMConfig.from_dict(apply_overrides(config.to_dict(), overrides))


@task(container_image=CPU_IMAGE)
def on_bdlm_failure(config: BDLMConfig, overrides: list[str], checkpoint_dir: str,
                    err: Optional[FlyteError] = None) -> None:
    """Failure handler of ``bdlm``: the MLflow runs it left open are marked FAILED."""
    try:
        cfg = BDLMConfig.from_dict(apply_overrides(config.to_dict(), overrides))
    except Exception:  # noqa: BLE001 - the overrides themselves may be what failed
        cfg = config
    close_failed_runs(cfg.tracking, err)


@task(container_image=CPU_IMAGE)
def start_bdlm_run(config: BDLMConfig) -> TrackingRun:
    """Preflight the MLflow store (fails fast, naming the URI) and open this execution's run."""
    from diffusionrl.bdlm import OBJECTIVE
    from diffusionrl.tracking import start_workflow_run

    return start_workflow_run(config, _execution(), {"algorithm": OBJECTIVE, "task": config.task.kind})


class DigitSplits(NamedTuple):
    train: pd.DataFrame
    test: pd.DataFrame
    digest: str


def _splits_frames(task_cfg: TaskConfig) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    from diffusionrl.bdlm.task import make_splits
    from diffusionrl.tracking import frame_digest

    splits = make_splits(task_cfg)
    frames = [pd.DataFrame({"prompt": [e.prompt for e in part], "answer": [e.answer for e in part]})
              for part in (splits.train, splits.test)]
    digest = hashlib.sha256((frame_digest(frames[0]) + frame_digest(frames[1])).encode()).hexdigest()[:16]
    return frames[0], frames[1], digest


@task(cache=DIGITS_CACHE, container_image=CPU_IMAGE)
def prepare_digits(task_cfg: TaskConfig) -> DigitSplits:
    """The generated train/test splits of the digit task, as tables with their digest."""
    return DigitSplits(*_splits_frames(task_cfg))


@task(container_image=CPU_IMAGE)
def track_digits(run: TrackingRun, config: BDLMConfig, train: pd.DataFrame, test: pd.DataFrame,
                 digest: str) -> DatasetDigests:
    """The ``prepare`` stage run: splits as MLflow datasets; data and initial-weight digests as tags."""
    from diffusionrl import tracking
    from diffusionrl.bdlm import load_bdlm, weights_digest

    stage = tracking.stage_run(run, "prepare")
    digests = tracking.log_prompt_datasets(run, stage, {"train": train, "test": test}, f"task:{config.task.kind}")
    base = weights_digest(load_bdlm(config.model.name, config.model))
    tracking.set_tags(run, {"dataset_digest": digest, "base_model_digest": base,
                            "dataset_source": f"task:{config.task.kind}"}, also=[stage])
    tracking.finish(run, stage)
    return DatasetDigests(digests["train"], digests["test"])


def _stage_dir(checkpoint_dir: str, name: str) -> Path:
    root = Path(checkpoint_dir) if checkpoint_dir else Path(current_context().working_directory)
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    return out


@task(container_image=CPU_IMAGE, requests=Resources(cpu="2", mem="4Gi"))
def warm_start_stage(config: BDLMConfig, run: TrackingRun, checkpoint_dir: str) -> FlyteDirectory:
    """Masked-diffusion supervised warm start (``warm_start`` stage run: its loss per step)."""
    from mlflow.entities import Metric

    from diffusionrl import tracking
    from diffusionrl.bdlm import warm_start

    out = _stage_dir(checkpoint_dir, "warm_start")
    stage = tracking.stage_run(run, "warm_start")
    model_dir = warm_start(config, out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    metrics = [Metric(k, float(v), 0, int(r.get("step", i + 1)))  # keys: warmstart/loss, warmstart/grad_norm
               for i, r in enumerate(rows) for k, v in r.items() if k != "step" and isinstance(v, (int, float))]
    client = tracking.client(run.uri)
    for i in range(0, len(metrics), 1000):
        tracking.with_retries(lambda chunk=metrics[i:i + 1000]: client.log_batch(stage, metrics=chunk),
                              config.tracking.log_retries, "MLflow log_batch")
    _finish_quietly(run, stage)
    return FlyteDirectory(str(model_dir))


class BDLMTrainOutputs(NamedTuple):
    model: FlyteDirectory
    traces: FlyteDirectory
    metrics: pd.DataFrame
    run_dir: str


@task(container_image=CPU_IMAGE, requests=Resources(cpu="2", mem="4Gi"), interruptible=True, retries=3)
def train_bdlm(config: BDLMConfig, run: TrackingRun, init_model: FlyteDirectory, checkpoint_dir: str,
               data_digest: str) -> BDLMTrainOutputs:
    """GRPO on exact traces. Resumes from this execution's Flyte checkpoint (a retried attempt),
    else from ``checkpoint_dir/grpo/checkpoints``, else starts from the warm start."""
    from diffusionrl import tracking
    from diffusionrl.bdlm import train_grpo
    from diffusionrl.training.checkpoint import latest_checkpoint

    if _splits_frames(config.task)[2] != data_digest:
        raise RuntimeError(f"the digit task generator no longer reproduces the prepared data (digest {data_digest}); "
                           "bump prepare_digits' cache version")
    out = _stage_dir(checkpoint_dir, "grpo")
    cp = _flyte_checkpoint()
    restored = cp.restore() if cp is not None else None
    resume = None
    if restored is not None and (Path(restored) / "state.json").is_file():
        resume = Path(restored)
        cp.save(resume)  # an attempt only sees the previous attempt's checkpoint: keep it alive
    elif latest_checkpoint(out / "checkpoints") is not None:
        resume = latest_checkpoint(out / "checkpoints")

    class SaveToFlyte:
        def on_checkpoint(self, loop, path) -> None:
            if cp is not None:
                cp.save(path)

    stage = _open_train_run(run, out, config.tracking.log_retries)
    logger = tracking.MetricLogger(run.uri, stage, attempts=config.tracking.log_retries)
    result = train_grpo(config, out, init_model.download(), resume=resume, callbacks=[SaveToFlyte(), logger])
    _finish_quietly(run, stage)
    return BDLMTrainOutputs(FlyteDirectory(str(result.model_dir)), FlyteDirectory(str(out / "traces")),
                            pd.DataFrame(result.metrics), str(out))


class BDLMEvalOutputs(NamedTuple):
    table: pd.DataFrame
    summary: dict[str, float]


def _decode_greedy(config: BDLMConfig, model_dir: str, examples):
    """Greedy (evaluation) decoding of ``examples`` -> generated ids ``[B, G]`` and their text."""
    from diffusionrl.bdlm import load_bdlm
    from diffusionrl.bdlm.loop import decode_examples
    from diffusionrl.bdlm.task import parse_answer

    adapter = load_bdlm(model_dir, config.model)
    _, tokens, _, _ = decode_examples(config, adapter, examples, None, config.eval.batch_size, config.eval.threshold)
    generated = tokens[:, config.task.prompt_length:]
    return generated, [parse_answer(row, adapter.vocab) for row in generated.tolist()]


@task(container_image=CPU_IMAGE, requests=Resources(cpu="2", mem="4Gi"))
def evaluate_bdlm(config: BDLMConfig, run: TrackingRun, warm_model: FlyteDirectory,
                  model: FlyteDirectory) -> BDLMEvalOutputs:
    """Greedy decoding of the held-out split by the warm start ("base") and the GRPO policy."""
    import numpy as np

    from diffusionrl import tracking
    from diffusionrl.bdlm.task import make_splits, score

    examples = make_splits(config.task).test
    if config.eval.num_samples:
        examples = examples[: config.eval.num_samples]
    table = pd.DataFrame({"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]})
    summary: dict[str, float] = {}
    for name, folder in (("base", warm_model.download()), ("tuned", model.download())):
        generated, answers = _decode_greedy(config, folder, examples)
        scored = score(generated, examples, config.task.partial_weight)
        table[f"{name}_output"] = answers
        table[f"{name}_reward"] = scored["reward"]
        prefix = "eval/" if name == "tuned" else "eval/base_"
        summary[f"{prefix}exact_match"] = float(np.mean(scored["exact"]))
        summary[f"{prefix}reward_mean"] = float(np.mean(scored["reward"]))
    table["win"] = np.where(table["tuned_reward"] > table["base_reward"], 1.0,
                            np.where(table["tuned_reward"] == table["base_reward"], 0.5, 0.0))
    summary.update({"eval/reward_gain": summary["eval/reward_mean"] - summary["eval/base_reward_mean"],
                    "eval/win_rate": float(table["win"].mean()), "eval/num_prompts": float(len(examples))})
    stage = tracking.stage_run(run, "evaluate")
    client = tracking.client(run.uri)
    for key, value in summary.items():
        client.log_metric(stage, key, value)
        client.log_metric(run.run_id, key, value)
    client.log_table(stage, table, "eval/table.json")
    tracking.finish(run, stage)
    return BDLMEvalOutputs(table, summary)


def bdlm_eval_key(config: BDLMConfig, test_digest: str) -> str:
    """What makes two BDLM evaluation scores comparable."""
    what = {"test_prompts": test_digest, "task": vars(config.task),
            "eval": {k: v for k, v in vars(config.eval).items() if k != "champion_margin"},
            "decoding": {"gen_length": config.model.gen_length, "block_size": config.model.block_size}}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


@task(container_image=CPU_IMAGE, requests=Resources(cpu="2", mem="4Gi"))
def register_bdlm(config: BDLMConfig, run: TrackingRun, model: FlyteDirectory, test_digest: str,
                  data_digest: str, eval_summary: dict[str, float]) -> RegisteredVersion:
    """Log the policy as a pyfunc model that decodes prompts, register a version (``candidate``)
    and move ``champion`` only if it beats the current one on the same evaluation."""
    from diffusionrl import registry, tracking
    from diffusionrl.bdlm import evaluate
    from diffusionrl.bdlm.serving import log_bdlm_model
    from diffusionrl.bdlm.task import make_splits

    parent = tracking.client(run.uri).get_run(run.run_id).data.tags
    lineage = {k: parent.get(k, "") for k in tracking.LINEAGE_KEYS}
    lineage.update({"dataset_digest": data_digest, "test_dataset_digest": test_digest, "task": config.task.kind,
                    "algorithm": parent.get("algorithm", ""), "preset": config.preset})
    example = make_splits(config.task).test[0].prompt
    info = log_bdlm_model(run, config, model.download(), example, lineage)

    def rescore(model_dir: Path) -> float:
        return evaluate(config, model_dir / "artifacts" / "model")["eval/reward_mean"]

    reg = registry.register(run, config, info, eval_summary["eval/reward_mean"], bdlm_eval_key(config, test_digest),
                            lineage, rescore=rescore)
    return RegisteredVersion.record(run, reg)


@task(container_image=CPU_IMAGE, enable_deck=True)
def report_bdlm(config: BDLMConfig, run: TrackingRun, metrics: pd.DataFrame, eval_table: pd.DataFrame,
                eval_summary: dict[str, float], model: FlyteDirectory, traces: FlyteDirectory, run_dir: str,
                registered: RegisteredVersion) -> FlyteFile:
    """HTML report (Deck, a copy in the run folder, an artifact of the MLflow run, which it closes)."""
    from diffusionrl import tracking
    from diffusionrl.report import build_report

    traces_path = traces.remote_source or traces.path
    where = tracking.log_folder_or_link(run, run.run_id, traces_path, traces.download, "traces",
                                        config.tracking.max_artifact_mb)
    artifacts = {
        **registered.links(),
        "policy (bdlm_model.json + weights)": model.remote_source or model.path,
        "traces (Parquet, one file per step)": traces_path,
        "traces in MLflow": where,
        "run folder (checkpoints, metrics.jsonl)": run_dir,
    }
    page = build_report(config=config.to_dict(), metrics=metrics, eval_table=eval_table, eval_summary=eval_summary,
                        grid=None, artifacts=artifacts, title="diffusionrl block-diffusion LM report")
    return publish_report(run, page, run_dir)
