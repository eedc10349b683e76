"""Decoding and evaluation of block-diffusion LMs: greedy decoding of held-out prompts, exact
match and reward, base-vs-tuned comparison, and the key that makes two evaluations comparable."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from .config import BDLMConfig
from .loading import load_bdlm
from .model import BDLMAdapter
from .sampler import decode
from .task import Example, encode_prompts, make_splits, parse_answer, score


def decode_examples(cfg: BDLMConfig, adapter: BDLMAdapter, examples: list[Example], seeds: torch.Tensor | None,
                    batch_size: int, threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor, torch.Tensor]:
    """Decode ``examples`` in batches of ``batch_size`` rows (``seeds=None``: greedy).

    Returns prompts ``[B, P]``, tokens ``[B, L]``, action steps ``[B, L]``, log-probs ``[B, L]``.
    """
    mc = cfg.model
    prompts = encode_prompts(examples, cfg.task.prompt_length, adapter.vocab)  # [B, P]
    parts = []
    for i in range(0, len(examples), batch_size):
        rows = slice(i, i + batch_size)
        parts.append(decode(adapter, prompts[rows], gen_length=mc.gen_length, block_size=mc.block_size,
                            temperature=mc.temperature, threshold=mc.threshold if threshold is None else threshold,
                            seeds=None if seeds is None else seeds[rows]))
    cat = [torch.cat([getattr(d, k) for d in parts]) for k in ("tokens", "action_steps", "log_probs")]
    return prompts, cat[0], cat[1], cat[2]


def eval_examples(cfg: BDLMConfig, split: str = "test") -> list[Example]:
    """The split's examples, the first ``eval.num_samples`` of them when that is set."""
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r} is not one of ['train', 'test']")
    examples = getattr(make_splits(cfg.task), split)
    return examples[: cfg.eval.num_samples] if cfg.eval.num_samples else examples


def decode_greedy(cfg: BDLMConfig, adapter: BDLMAdapter, examples: list[Example]) -> torch.Tensor:
    """Greedy (evaluation) decoding of ``examples`` -> generated ids ``[B, G]`` (DiffusionGemma and
    LLaDA2: through their stock pipelines)."""
    if getattr(adapter, "kind", "") == "diffusiongemma":
        from .gemma_rollout import decode_greedy as gemma_greedy

        texts = [adapter.vocab.decode(r) for r in encode_prompts(examples, cfg.task.prompt_length, adapter.vocab)]
        return gemma_greedy(adapter, cfg.model, texts, cfg.eval.batch_size, cfg.eval.threshold)
    if getattr(adapter, "kind", "") == "llada2":
        from .llada2 import decode_greedy as llada2_greedy

        prompts = encode_prompts(examples, cfg.task.prompt_length, adapter.vocab)
        return llada2_greedy(adapter, cfg.model, prompts, cfg.eval.batch_size, cfg.eval.threshold)
    _, tokens, _, _ = decode_examples(cfg, adapter, examples, None, cfg.eval.batch_size, cfg.eval.threshold)
    return tokens[:, cfg.task.prompt_length :]


def decode_answers(cfg: BDLMConfig, adapter: BDLMAdapter, examples: list[Example]) -> list[str]:
    """Greedy decoding of ``examples`` as answer text (up to the first EOS)."""
    return [parse_answer(row, adapter.vocab) for row in decode_greedy(cfg, adapter, examples).tolist()]


def evaluate_adapter(cfg: BDLMConfig, adapter: BDLMAdapter, examples: list[Example]) -> dict[str, float]:
    """Greedy decoding (argmax proposals, eval threshold) scored on ``examples``."""
    if cfg.eval.num_samples:
        examples = examples[: cfg.eval.num_samples]
    s = score(decode_greedy(cfg, adapter, examples), examples, cfg.task.partial_weight, adapter.vocab)
    return {
        "eval/exact_match": float(s["exact"].mean()),
        "eval/reward_mean": float(s["reward"].mean()),
        "eval/partial_mean": float(s["partial"].mean()),
        "eval/num_samples": float(len(examples)),
    }


def evaluate(cfg: BDLMConfig, model_dir: str | Path, split: str = "test") -> dict[str, float]:
    """Exact-match accuracy and mean reward of the model in ``model_dir`` on a split of the task."""
    if split not in ("train", "test"):
        raise ValueError(f"split {split!r} is not one of ['train', 'test']")
    return evaluate_adapter(cfg, load_bdlm(model_dir, cfg.model), getattr(make_splits(cfg.task), split))


def compare(cfg: BDLMConfig, base_dir: str | Path, tuned_dir: str | Path) -> tuple[pd.DataFrame, dict[str, float]]:
    """Greedy decoding of the held-out split by ``base_dir``'s model and ``tuned_dir``'s: a table
    (one row per prompt: outputs, rewards, win) and a summary (``eval/*`` for the tuned model,
    ``eval/base_*`` for the base, gain, win rate)."""
    examples = eval_examples(cfg)
    table = pd.DataFrame({"prompt": [e.prompt for e in examples], "answer": [e.answer for e in examples]})
    summary: dict[str, float] = {}
    for name, folder in (("base", base_dir), ("tuned", tuned_dir)):
        adapter = load_bdlm(folder, cfg.model)
        generated = decode_greedy(cfg, adapter, examples)
        scored = score(generated, examples, cfg.task.partial_weight)
        table[f"{name}_output"] = [parse_answer(row, adapter.vocab) for row in generated.tolist()]
        table[f"{name}_reward"] = scored["reward"]
        prefix = "eval/" if name == "tuned" else "eval/base_"
        summary[f"{prefix}exact_match"] = float(np.mean(scored["exact"]))
        summary[f"{prefix}reward_mean"] = float(np.mean(scored["reward"]))
    table["win"] = np.where(table["tuned_reward"] > table["base_reward"], 1.0,
                            np.where(table["tuned_reward"] == table["base_reward"], 0.5, 0.0))
    summary.update({"eval/reward_gain": summary["eval/reward_mean"] - summary["eval/base_reward_mean"],
                    "eval/win_rate": float(table["win"].mean()), "eval/num_prompts": float(len(examples))})
    return table, summary


def eval_key(cfg: BDLMConfig, test_digest: str) -> str:
    """What makes two BDLM evaluation scores comparable (the registry compares only equal keys)."""
    from diffusionrl.serving.champion import DECISION_ONLY

    what = {"test_prompts": test_digest, "task": vars(cfg.task),
            "eval": {k: v for k, v in vars(cfg.eval).items() if k not in DECISION_ONLY},
            "decoding": {"gen_length": cfg.model.gen_length, "block_size": cfg.model.block_size}}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]
