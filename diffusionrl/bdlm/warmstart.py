"""Masked-diffusion supervised warm start (the MDLM / LLaDA objective), its own stage before GRPO.

Per sequence a mask ratio ``t ~ U(t_min, 1)``; every generated position is hidden with
probability ``t`` (at least one per row); the prompt stays clean. The loss is the cross-entropy
of the hidden tokens weighted by ``1 / t`` (the ELBO weight of the linear schedule), summed per
sequence and divided by ``B * G``. It uses the sampler's own proposal distribution (MASK
excluded), so the warm-started model is trained on exactly what the sampler will ask of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .config import BDLMConfig
from .loading import load_bdlm
from .model import RUN_INFO, BDLMAdapter, weights_digest
from .sampler import proposal_log_probs
from .task import Example, encode_answers, encode_prompts, make_splits

T_MIN = 1e-3


def masked_diffusion_loss(adapter: BDLMAdapter, prompts: torch.Tensor, answers: torch.Tensor, t: torch.Tensor,
                          hidden: torch.Tensor) -> torch.Tensor:
    """``sum over hidden positions of CE / t``, divided by ``B * G``.

    prompts ``[B, P]``, answers ``[B, G]``, t ``[B]``, hidden ``[B, G]`` bool.
    """
    vocab = adapter.vocab
    p = prompts.shape[1]
    canvas = torch.cat([prompts, torch.where(hidden, torch.full_like(answers, vocab.mask), answers)], 1)  # [B, L]
    log_p = proposal_log_probs(adapter.logits(canvas)[:, p:], 1.0, vocab.mask)  # [B, G, V]
    nll = -log_p.gather(-1, answers[..., None]).squeeze(-1)  # [B, G]
    per_row = torch.where(hidden, nll, torch.zeros(())).sum(1) / t  # [B]
    return per_row.sum() / answers.numel()


def draw_masks(batch: int, gen_length: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` ``[B]`` and the hidden positions ``[B, G]`` (at least one per row)."""
    t = T_MIN + (1 - T_MIN) * torch.rand(batch, generator=gen)  # [B]
    hidden = torch.rand(batch, gen_length, generator=gen) < t[:, None]  # [B, G]
    forced = torch.randint(gen_length, (batch,), generator=gen)  # [B]
    hidden[torch.arange(batch), forced] |= ~hidden.any(1)
    return t, hidden


def train_warm_start(adapter: BDLMAdapter, examples: list[Example], ws_cfg, *, prompt_length: int, gen_length: int,
                     progress: bool | None = None) -> list[dict[str, float]]:
    """``ws_cfg.steps`` AdamW steps on random batches of ``examples``; returns per-step metrics."""
    prompts = encode_prompts(examples, prompt_length, adapter.vocab)  # [N, P]
    answers = encode_answers(examples, gen_length, adapter.vocab)  # [N, G]
    gen = torch.Generator().manual_seed(ws_cfg.seed)
    params = [p for p in adapter.module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=ws_cfg.lr, weight_decay=ws_cfg.weight_decay)
    history = []
    for step in tqdm(range(ws_cfg.steps), desc="warm start", disable=None if progress is None else not progress):
        idx = torch.randint(len(examples), (ws_cfg.batch_size,), generator=gen)
        t, hidden = draw_masks(ws_cfg.batch_size, gen_length, gen)
        if getattr(adapter, "kind", "") == "diffusiongemma":  # uniform corruption, no MASK token
            from .gemma import sft_loss

            loss = sft_loss(adapter, prompts[idx], answers[idx], gen)
        else:
            loss = masked_diffusion_loss(adapter, prompts[idx], answers[idx], t, hidden)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        optimizer.step()
        history.append(
            {"step": float(step + 1), "warmstart/loss": float(loss.detach()), "warmstart/grad_norm": grad_norm}
        )
    return history


def warm_start(cfg: BDLMConfig, out_dir: str | Path, progress: bool | None = None) -> Path:
    """Masked-diffusion supervised stage from ``cfg.model.name``; returns the saved model folder
    (``out_dir/model``). ``out_dir/metrics.jsonl`` holds the per-step loss."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter = load_bdlm(cfg.model.name, cfg.model)
    torch.manual_seed(cfg.warm_start.seed)
    splits = make_splits(cfg.task)
    history = train_warm_start(adapter, splits.train, cfg.warm_start, prompt_length=cfg.task.prompt_length,
                               gen_length=cfg.model.gen_length, progress=progress)
    (out_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    model_dir = adapter.save(out_dir / "model")
    info = {"stage": "warm_start", "objective": "masked_diffusion_sft", "base_model": cfg.model.name,
            "steps": cfg.warm_start.steps, "config_digest": cfg.digest(), "weights_digest": weights_digest(adapter)}
    (model_dir / RUN_INFO).write_text(json.dumps(info, indent=1))
    return model_dir
