"""One run loop for every training stage: run, resume, checkpoint cadence, metrics file, callbacks.

``RunLoop`` knows nothing of images, text, LoRAs or Ray: it drives a ``Backend`` that does one
step (``run_step``), says what a checkpoint must agree on (``metadata``), packs and unpacks its
state (``state`` / ``load_state``) and saves what the run produced (``save_outputs``). The
backends are ``training.backend.ImageBackend`` (single process, or trainer ranks in Ray actors)
and ``bdlm.backend.BDLMBackend``; ``diffusionrl.train.build_loop`` picks one.

Every random choice of step ``s`` is the backend's and seeded by ``(seed, s)``, and a checkpoint
carries the whole state, so a run resumed from a checkpoint repeats exactly what the
uninterrupted run would have done (docs/algorithms.md section 11).

What a run trusts on resume: the checkpoint's files (SHA-256 manifest, a damaged newest one is
skipped for the previous intact one, ``diffusionrl.run.checkpoint``), its model and objective
(``metadata``, fail closed), its config and the digests of its input data (every key but the
``free_keys`` and every input digest must be unchanged, unless the caller allows the change, which
is then recorded in ``config_changes.jsonl``) and
``metrics.jsonl`` (a torn last line, left by a kill mid-write, is dropped with a warning; any other
bad line fails naming file and line). A fresh run in a folder holding another run's checkpoints
moves that run aside (``previous-run-<time>/``) instead of mixing with it. A run owns its folder
while it runs (``diffusionrl.run.lock``): a second run there refuses, naming the first.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from diffusionrl.errors import UserError, naming

from .callbacks import Callback
from .checkpoint import (
    CheckpointState,
    ConfigChanged,
    check_metadata,
    config_changes,
    input_changes,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    prune_checkpoints,
    save_checkpoint,
    with_hyperparameters,
)
from .lock import RunOwner, hold_run_folder

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
CHANGES_FILE = "config_changes.jsonl"  # one row per resume that was allowed to change the config
RUN_FILES = ("checkpoints", METRICS_FILE, CONFIG_FILE, CHANGES_FILE)  # what a fresh run moves aside
# Config keys (fnmatch patterns over ``Config.flat()`` names) that may change on resume in any run:
# labels, evaluation and tracking settings. Each run builder adds its own (steps, checkpoint
# cadence, logging, layout: ``train.FREE_KEYS``, ``bdlm.backend.FREE_KEYS``); every other key is
# objective-relevant and must match the checkpoint's config.
RUN_CONTROL_KEYS = ("preset", "eval.*", "tracking.*")
DATA_HINT = " (the data behind an unchanged path was rewritten)"


class MetricsFileError(UserError):
    """``metrics.jsonl`` has a malformed line that is not a torn last line."""


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
    postfix_label: str = "reward"  # what that metric is called there


@dataclass
class RunResult:
    out_dir: Path
    model_dir: Path  # the trained adapter (images: peft LoRA folder) or policy (text)
    metrics: list[dict[str, float]]  # one dict per completed step
    steps_done: int
    checkpoint: Path | None
    extra_dirs: dict[str, Path] = field(default_factory=dict)  # e.g. {"ema": <EMA LoRA folder>}


class RunLoop:
    """Runs ``backend`` for ``schedule.steps`` steps in ``out_dir``, resumable from its checkpoints.

    ``progress``: True a progress bar, False silent, None a bar on a terminal and otherwise one
    line per step (step, reward, seconds) on the ``diffusionrl.run.loop`` logger when it logs INFO,
    else on stderr.

    ``inputs``: digests of the data the config's paths name (``{"prompts": ..., "sft_pairs": ...,
    "init_lora": ...}``, ``train.input_digests``), recorded in each checkpoint and compared on
    resume like the config: a file rewritten at the same path changes what is optimised although
    no setting changed."""

    def __init__(self, backend: Backend, out_dir: str | Path, schedule: Schedule, config: dict[str, Any],
                 callbacks: list[Callback] | None = None, progress: bool | None = None,
                 free_keys: tuple[str, ...] = RUN_CONTROL_KEYS, inputs: dict[str, str] | None = None):
        self.backend = backend
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_dir = self.out_dir / "checkpoints"
        self.schedule = schedule
        self.config = config
        self.callbacks = list(callbacks or [])
        self.progress = progress
        self.free_keys = tuple(free_keys)
        self.inputs = dict(inputs or {})
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
        for cb in self.callbacks:
            cb.on_metrics(self, self.step, metrics)
        with naming(self.metrics_path), self.metrics_path.open("a") as fh:  # a full disk: one line naming it
            fh.write(json.dumps(metrics) + "\n")
        for cb in self.callbacks:
            cb.on_step(self, self.step, batch, metrics)
        return metrics

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self) -> Path:
        """Save this step's checkpoint (with the run's config), prune old ones, tell the callbacks."""
        state = self.backend.state(self.step)
        state.config = self.config
        state.inputs = self.inputs
        path = self.ckpt_dir / f"step-{self.step:06d}"
        with naming(path):  # a full or read-only disk: one line naming the checkpoint
            save_checkpoint(path, state)
        prune_checkpoints(self.ckpt_dir, self.schedule.keep_checkpoints)
        for cb in self.callbacks:
            cb.on_checkpoint(self, path)
        return path

    def restore(self, path: str | Path, allow_config_change: bool = False,
                state: CheckpointState | None = None) -> None:
        """Continue from the checkpoint at ``path`` (``state``: already loaded from it)."""
        if state is None:
            state = load_checkpoint(path, restore_rng=self.backend.restore_rng)
        check_metadata(state.metadata, self.backend.metadata(), str(path))
        changes = self.config_changes(state)
        if changes and not allow_config_change:
            listed = ", ".join(f"{k} {json.dumps(v['old'])} -> {json.dumps(v['new'])}" for k, v in changes.items())
            raise ConfigChanged(
                f"cannot resume from {path}: objective-relevant settings or input data differ from the checkpoint's: "
                f"{listed}{DATA_HINT if any(k.startswith('inputs.') for k in changes) else ''}; "
                "resume with the checkpoint's settings, allow the change (--allow-config-change, "
                f"allow_config_change=True; recorded in {CHANGES_FILE}) or start over (--fresh)")
        if changes:
            self.record_config_changes(path, state.step, changes)
            state.optimizer = with_hyperparameters(state.optimizer, self.backend.state(state.step).optimizer)
        self.backend.load_state(state)
        self.step = state.step
        self.history = read_metrics(self.metrics_path, upto=self.step)
        log.info("resumed from %s at step %d", path, self.step)

    def config_changes(self, state: CheckpointState) -> dict[str, dict]:
        """Objective-relevant keys whose value differs from the config the checkpoint was made with
        (``state.json``'s ``config``), then the inputs whose digest differs (``inputs.prompts``, ...:
        the data changed behind its path)."""
        changes = config_changes(state.config, self.config, self.free_keys)
        return {**changes, **input_changes(state.inputs, self.inputs)}

    def record_config_changes(self, path: str | Path, step: int, changes: dict[str, dict]) -> None:
        row = {"step": step, "checkpoint": Path(path).name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "changes": changes}
        with (self.out_dir / CHANGES_FILE).open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        log.warning("resuming from %s with changed settings (recorded in %s): %s", path,
                    self.out_dir / CHANGES_FILE, ", ".join(changes))

    def set_aside(self) -> Path | None:
        """Move another run's files (``RUN_FILES``) to ``previous-run-<time>/`` before a fresh run,
        so its checkpoints neither win a later resume nor get pruned, and nothing is deleted."""
        found = list_checkpoints(self.ckpt_dir)
        if not found:
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S")
        dest, n = self.out_dir / f"previous-run-{stamp}", 1
        while dest.exists():
            n += 1
            dest = self.out_dir / f"previous-run-{stamp}-{n}"
        dest.mkdir()
        for name in RUN_FILES:
            if (self.out_dir / name).exists():
                shutil.move(str(self.out_dir / name), str(dest / name))
        log.warning("fresh run: the previous run in %s (checkpoints up to %s) was moved to %s",
                    self.out_dir, found[-1].name, dest)
        return dest

    # -- the run ---------------------------------------------------------------------------------
    def run(self, resume: str | Path | None = "auto", stop_after: int | None = None,
            allow_config_change: bool = False) -> RunResult:
        """Train until ``schedule.steps`` (or ``stop_after`` more steps).

        ``resume="auto"`` continues from the latest intact checkpoint of this output folder, a path
        resumes from that checkpoint, ``None`` starts fresh (moving another run's checkpoints aside).
        ``allow_config_change`` lets a resume change objective-relevant settings (recorded).
        The run owns ``out_dir`` meanwhile (``run.lock.hold_run_folder``): a second run there raises
        ``RunFolderBusy`` naming this one, before it reads or moves anything.
        """
        with hold_run_folder(self.out_dir) as owner:
            return self._run(owner, resume, stop_after, allow_config_change)

    def _run(self, owner: RunOwner, resume: str | Path | None, stop_after: int | None,
             allow_config_change: bool) -> RunResult:
        ckpt: Path | None = None
        if resume == "auto":
            found = load_latest(self.ckpt_dir, restore_rng=self.backend.restore_rng)
            if found:
                ckpt, state = found
                self.restore(ckpt, allow_config_change, state=state)
        elif resume:
            ckpt = Path(resume)
            self.restore(ckpt, allow_config_change)
        if ckpt is None:
            self.set_aside()
            self.backend.start()
            self.metrics_path.unlink(missing_ok=True)
        with naming(self.out_dir / CONFIG_FILE):
            (self.out_dir / CONFIG_FILE).write_text(json.dumps(self.config, indent=1))
        total = self.schedule.steps
        last = total if stop_after is None else min(total, self.step + stop_after)
        every = self.schedule.checkpoint_every
        tty = sys.stderr.isatty()
        lines = self.progress is None and not tty
        bar = tqdm(range(self.step, last), desc=self.backend.progress_label, initial=self.step, total=total,
                   disable=not (tty if self.progress is None else self.progress))
        for step in bar:
            owner.check()  # a lost lease (object-store run folder) stops the run before it writes
            t0 = time.perf_counter()
            metrics = self.run_step(step)
            shown, label = metrics.get(self.schedule.postfix_metric), self.schedule.postfix_label
            if shown is not None:
                bar.set_postfix({label: f"{shown:.4f}"})
            if (every and self.step % every == 0) or self.step == last:
                owner.check()
                ckpt = self.checkpoint()
            if lines:
                progress_line(f"{self.backend.progress_label} step {self.step}/{total}"
                              + (f": {label} {shown:.4f}" if shown is not None else "")
                              + f", {time.perf_counter() - t0:.1f} s")
        model_dir, extra = self.backend.save_outputs(self.step)
        for cb in self.callbacks:
            cb.on_end(self)
        return RunResult(self.out_dir, model_dir, list(self.history), self.step, ckpt, extra)

    def close(self) -> None:
        self.backend.close()


def progress_line(text: str) -> None:
    """One progress line: logged when this module's logger logs INFO somewhere, else on stderr."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info(text)
    else:
        print(text, file=sys.stderr, flush=True)


def read_metrics(path: Path, upto: int) -> list[dict[str, float]]:
    """Metrics of the steps a checkpoint covers; later lines belong to lost, re-run steps and are
    dropped from the file too. A last line that is not JSON (torn by a kill mid-write) is dropped
    with a warning; any other malformed line raises ``MetricsFileError`` naming file and line."""
    if not path.is_file():
        return []
    lines = path.read_text(errors="replace").splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a JSON {type(row).__name__}, not an object")
        except ValueError as exc:
            if not any(rest.strip() for rest in lines[number:]):
                log.warning("%s: dropped the torn last line %d (%d characters, not JSON), left by an "
                            "interrupted write", path, number, len(line))
                continue
            raise MetricsFileError(f"{path} line {number}: not a metrics row ({exc}); fix or remove "
                                   "that line to resume") from exc
        rows.append(row)
    rows = [r for r in rows if r.get("step", 0) <= upto]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows
