"""One run loop for every training stage: run, resume, checkpoint cadence, metrics file, callbacks.

``RunLoop`` knows nothing of images, text, LoRAs or Ray: it drives a ``Backend`` that does one
step (``run_step``), says what a checkpoint must agree on (``metadata``), packs and unpacks its
state (``state`` / ``load_state``) and saves what the run produced (``save_outputs``). The
backends are ``training.backend.ImageBackend`` (single process, or trainer ranks in Ray actors)
and ``bdlm.backend.BDLMBackend``; ``diffusionrl.train.build_loop`` picks one.

Every random choice of step ``s`` is the backend's and seeded by ``(seed, s)``, and a checkpoint
carries the whole state, so a run resumed from a checkpoint repeats exactly what the
uninterrupted run would have done (docs/algorithms.md section 11).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from diffusionrl.callbacks import Callback
from diffusionrl.checkpoint import (
    CheckpointState,
    check_metadata,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


class Backend(Protocol):
    """What ``RunLoop`` drives. ``step`` arguments count completed steps."""

    progress_label: str  # the progress bar's name
    restore_rng: bool  # whether a checkpoint's RNG states are restored on resume

    def metadata(self) -> dict[str, Any]: ...  # what a checkpoint must agree on to be resumed

    def start(self) -> None: ...  # a fresh run (e.g. push the initial weights to the engine)

    def run_step(self, step: int) -> tuple[Any, dict[str, float]]: ...  # -> (batch, metrics)

    def state(self, step: int) -> CheckpointState: ...

    def load_state(self, state: CheckpointState) -> None: ...

    def save_outputs(self, step: int) -> tuple[Path, dict[str, Path]]: ...  # -> (model dir, extra dirs)

    def close(self) -> None: ...


@dataclass
class Schedule:
    steps: int  # the run ends after this many steps
    checkpoint_every: int  # 0: only at the end
    keep_checkpoints: int  # newest checkpoints kept (0: all)
    postfix_metric: str = "rollout/reward/raw_mean"  # shown beside the progress bar


@dataclass
class RunResult:
    out_dir: Path
    model_dir: Path  # the trained adapter (images: peft LoRA folder) or policy (text)
    metrics: list[dict[str, float]]  # one dict per completed step
    steps_done: int
    checkpoint: Path | None
    extra_dirs: dict[str, Path] = field(default_factory=dict)  # e.g. {"ema": <EMA LoRA folder>}


class RunLoop:
    """Runs ``backend`` for ``schedule.steps`` steps in ``out_dir``, resumable from its checkpoints."""

    def __init__(self, backend: Backend, out_dir: str | Path, schedule: Schedule, config: dict[str, Any],
                 callbacks: list[Callback] | None = None, progress: bool | None = None):
        self.backend = backend
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.schedule = schedule
        self.config = config
        self.callbacks = list(callbacks or [])
        self.progress = progress
        self.step = 0
        self.history: list[dict[str, float]] = []

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / METRICS_FILE

    # -- one step --------------------------------------------------------------------------------
    def run_step(self, step: int) -> dict[str, float]:
        batch, metrics = self.backend.run_step(step)
        self.step = step + 1
        self.history.append(metrics)
        with self.metrics_path.open("a") as fh:
            fh.write(json.dumps(metrics) + "\n")
        for cb in self.callbacks:
            cb.on_step(self, self.step, batch, metrics)
        return metrics

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        """Save this step's checkpoint, prune old ones, tell the callbacks."""
        path = save_checkpoint(self.ckpt_dir / f"step-{self.step:06d}", self.backend.state(self.step))
        prune_checkpoints(self.ckpt_dir, self.schedule.keep_checkpoints)
        for cb in self.callbacks:
            cb.on_checkpoint(self, path)
        return path

    def restore(self, path: str | Path) -> None:
        state = load_checkpoint(path, restore_rng=self.backend.restore_rng)
        check_metadata(state.metadata, self.backend.metadata(), str(path))
        self.backend.load_state(state)
        self.step = state.step
        self.history = read_metrics(self.metrics_path, upto=self.step)
        log.info("resumed from %s at step %d", path, self.step)

    # -- the run ---------------------------------------------------------------------------------
    def run(self, resume: str | Path | None = "auto", stop_after: int | None = None) -> RunResult:
        """Train until ``schedule.steps`` (or ``stop_after`` more steps).

        ``resume="auto"`` continues from the latest checkpoint of this output folder, a path
        resumes from that checkpoint, ``None`` starts fresh.
        """
        path = latest_checkpoint(self.ckpt_dir) if resume == "auto" else resume
        if path:
            self.restore(path)
        else:
            self.backend.start()
            self.metrics_path.unlink(missing_ok=True)
        (self.out_dir / "config.json").write_text(json.dumps(self.config, indent=1))
        total = self.schedule.steps
        last = total if stop_after is None else min(total, self.step + stop_after)
        every = self.schedule.checkpoint_every
        ckpt = latest_checkpoint(self.ckpt_dir)
        bar = tqdm(range(self.step, last), desc=self.backend.progress_label, initial=self.step, total=total,
                   disable=None if self.progress is None else not self.progress)
        for step in bar:
            metrics = self.run_step(step)
            if self.schedule.postfix_metric in metrics:
                bar.set_postfix(reward=f"{metrics[self.schedule.postfix_metric]:.4f}")
            if (every and self.step % every == 0) or self.step == last:
                ckpt = self.checkpoint()
        model_dir, extra = self.backend.save_outputs(self.step)
        for cb in self.callbacks:
            cb.on_end(self)
        return RunResult(self.out_dir, model_dir, list(self.history), self.step, ckpt, extra)

    def close(self) -> None:
        self.backend.close()


def read_metrics(path: Path, upto: int) -> list[dict[str, float]]:
    """Metrics of the steps a checkpoint covers; later lines belong to lost, re-run steps and are
    dropped from the file too."""
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("step", 0) <= upto]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
