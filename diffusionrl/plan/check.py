"""The check before launch: does ``cfg`` fit the GPUs it will get? (The ``plan_resources`` task of
the ``grpo`` workflow runs it before ``train``.)"""

from __future__ import annotations

from diffusionrl.config import ConfigError

from .model import GIB, plan

# Flyte accelerator names (``DIFFUSIONRL_GPU``, tasks/resources.py) -> the planner's GPU kinds
ACCELERATORS = {"nvidia-h200": "H200", "nvidia-h100": "H100", "nvidia-h100-80gb": "H100",
                "nvidia-a100-80gb": "A100-80G", "nvidia-l40s": "L40S-48G"}


class PlanError(ConfigError):
    """The config does not fit its GPUs: the message names the knobs that fix it."""


def needs_plan(cfg) -> bool:
    """A GPU run: ``model.device`` is CUDA, or ``auto`` with a hub or folder model (a builtin tiny
    model on ``auto`` runs where it is put, and fits anything)."""
    device = cfg.model.device
    return device.startswith("cuda") or (device == "auto" and not cfg.model.name.startswith("builtin:"))


def check_fits(cfg, accelerator: str) -> str:
    """One line saying what the plan predicts; raises ``PlanError`` (one line, naming the knobs that
    fix it) when the busiest rank's predicted peak exceeds the GPU. No GPU run, or a GPU the planner
    has no figures for: a line saying why nothing was checked."""
    if not needs_plan(cfg):
        return f"no GPU plan: model.device={cfg.model.device} with {cfg.model.name}"
    gpu = ACCELERATORS.get(accelerator)
    if gpu is None:
        return f"no GPU plan: no figures for accelerator {accelerator!r} (known: {sorted(ACCELERATORS)})"
    from .facts import plannable
    from .knobs import advise

    if not plannable(cfg.model.name):
        return (f"no GPU plan: the planner has no measured sizes for {cfg.model.name} yet (its families: "
                "diffusionrl/plan/archs.py); nothing was checked")
    p = plan(cfg, gpu)
    line = (f"planned peak {p.peak / GIB:.1f} GiB of {p.gpu_memory / GIB:.1f} GiB per {gpu} ({p.phase} phase) on "
            f"{p.gpus} GPU(s); ~{p.step_s:.0f} s per training step, ~{p.rollout_s:.0f} s per rollout")
    if p.fits:
        return line
    lines = advise(cfg, gpu, base=p)
    fixes = [x for x in lines if "still over" not in x]
    fix = ("fix with " + " | ".join(fixes) if fixes else
           f"no knob fixes it alone or together ({'; '.join(lines) or 'none applies'}): use GPUs with more memory")
    raise PlanError(f"the plan does not fit: {line}; {fix} (python -m diffusionrl.plan for the parts)")
