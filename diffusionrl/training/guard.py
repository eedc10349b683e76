"""``UpdateGuard``: a run that stops updating its weights stops, in one line, instead of ending "well".

Each step's metrics say how many optimizer steps it made (``train/optimizer_steps``) and how many it
skipped because a loss or the gradient norm was not finite (``train/skipped_updates``,
``training.trainer.Trainer.apply``). A step with no optimizer step at all is *idle*: its updates
were all skipped, or it had none to make (no sample carried a learning signal: every prompt group's
rewards were equal, ``rollout/zero_std/count``, or DPO formed no preference pair). One idle step is
chance; a row of them means the objective or the reward is broken (a temperature that overflows, a
constant reward, NaN in the model), and without a guard such a run would finish with exit status 0
and register the LoRA it started with. So, over the run's metric rows (``RunLoop.history``, reread from
``metrics.jsonl`` on resume, so the count spans resumes):

- ``train.max_idle_steps`` idle steps in a row stop the run, and so does a run that reaches its
  last step without having made one optimizer step (0: never);
- from step ``FRACTION_FROM`` on, more than ``train.max_skipped_fraction`` of the updates the run
  tried skipped as non-finite stop it (1: never).

It raises ``TrainingStalled`` (a ``UserError``: the CLI prints one line and exits 2, a Flyte task
fails with that line) from ``on_step``, after the step's metrics are written and synced and before
its checkpoint, so the metrics show the steps that tripped it and no checkpoint or LoRA is made of
them. Both bounds are run-control keys (``train.FREE_KEYS``): a resume may loosen them.
"""

from __future__ import annotations

from typing import Any

from diffusionrl.errors import UserError
from diffusionrl.run import Callback

STEPS_KEY = "train/optimizer_steps"
SKIPPED_KEY = "train/skipped_updates"
FRACTION_FROM = 5  # steps before the skipped share is judged (one NaN step in 2 is not a trend)


class TrainingStalled(UserError):
    """A run whose updates were skipped or empty beyond ``train.max_idle_steps`` / ``max_skipped_fraction``."""

    kind = "training stalled"


def _counts(row: dict[str, Any]) -> tuple[float, float] | None:
    """(optimizer steps, skipped updates) of one metrics row; None for a row without them."""
    if STEPS_KEY not in row:
        return None
    return float(row[STEPS_KEY]), float(row.get(SKIPPED_KEY, 0.0))


def stall_reason(history: list[dict[str, Any]], total_steps: int, max_idle_steps: int,
                 max_skipped_fraction: float, section: str = "train") -> str:
    """Why the run of metric rows ``history`` (one per step, oldest first) must stop, or "".
    ``section`` names the config section holding the two keys (``train`` for images, ``grpo`` for
    block-diffusion language models), so the line names the key the user can set."""
    counts = [c for c in map(_counts, history) if c is not None]
    if not counts:
        return ""
    step = len(history)
    if max_idle_steps > 0:
        streak = []
        for done, skipped in reversed(counts):
            if done > 0:
                break
            streak.append(skipped)
        nonfinite = sum(1 for s in streak if s > 0)
        why = "; ".join(part for part in (
            f"{nonfinite} skipped every update for a non-finite loss or gradient norm" if nonfinite else "",
            f"{len(streak) - nonfinite} had no update to make: no sample with a learning signal (every prompt "
            "group's rewards equal, or no preference pair)" if len(streak) > nonfinite else "") if part)
        if len(streak) >= max_idle_steps:
            return (f"{len(streak)} steps in a row (to step {step}) made no optimizer step ({why}), "
                    f"{section}.max_idle_steps={max_idle_steps}; fix the objective or reward settings (a smaller "
                    f"learning rate or temperature, a reward that varies), or raise {section}.max_idle_steps "
                    "(0: never stop)")
        if step >= total_steps and len(streak) == len(counts):
            return (f"the run reached its last step ({step}) without one optimizer step ({why}): its LoRA "
                    "is the one it started with; fix the objective or reward settings, or set "
                    f"{section}.max_idle_steps=0 to let such a run end")
    if max_skipped_fraction < 1 and step >= FRACTION_FROM:
        done = sum(d for d, _ in counts)
        skipped = sum(s for _, s in counts)
        if skipped and skipped > max_skipped_fraction * (done + skipped):
            return (f"{skipped:.0f} of the {done + skipped:.0f} updates of steps 1-{step} were skipped for a "
                    "non-finite loss or gradient norm, more than "
                    f"{section}.max_skipped_fraction={max_skipped_fraction:g}; "
                    f"lower the learning rate or the objective's temperature, or raise {section}.max_skipped_fraction "
                    "(1: never stop)")
    return ""


class UpdateGuard(Callback):
    """Raises ``TrainingStalled`` at the step where ``stall_reason`` says the run trains nothing."""

    def __init__(self, train_cfg, section: str = "train"):
        self.section = section
        self.max_idle_steps = int(train_cfg.max_idle_steps)
        self.max_skipped_fraction = float(train_cfg.max_skipped_fraction)

    def on_step(self, loop, step: int, batch, metrics: dict[str, float]) -> None:
        why = stall_reason(loop.history, loop.schedule.steps, self.max_idle_steps, self.max_skipped_fraction,
                           self.section)
        if why:
            raise TrainingStalled(f"{loop.out_dir}: {why}")
