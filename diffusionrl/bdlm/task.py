"""A verifiable digit task: reverse, sort or add short digit strings.

Prompt layout (``P = task.prompt_length`` tokens, left-padded with PAD):
``reverse``/``sort``: ``d1 .. dn SEP``; ``add``: ``a1 .. an SEP b1 .. bm SEP``.
The answer is the transformed digits then EOS, and EOS again up to ``gen_length``.

Reward: ``exact + partial_weight * partial``, where ``exact`` is 1 when the generated text up to
its first EOS equals the answer, and ``partial`` is the share of answer positions predicted right,
divided by ``max(len(answer), len(prediction))`` so that over-long outputs lose credit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .model import VOCAB, Vocab


@dataclass
class Example:
    prompt: str  # digits, '|' between add operands
    answer: str  # digits


@dataclass
class Splits:
    train: list[Example]
    test: list[Example]


def solve(kind: str, prompt: str) -> str:
    if kind == "reverse":
        return prompt[::-1]
    if kind == "sort":
        return "".join(sorted(prompt))
    if kind == "add":
        a, b = prompt.split("|")
        return str(int(a) + int(b))
    raise ValueError(f"unknown task kind {kind!r}; use reverse, sort or add")


def _random_prompt(task_cfg, rng: np.random.Generator) -> str:
    def digits() -> str:
        n = int(rng.integers(task_cfg.min_len, task_cfg.max_len + 1))
        return "".join(str(d) for d in rng.integers(0, 10, size=n))

    return f"{digits()}|{digits()}" if task_cfg.kind == "add" else digits()


def make_splits(task_cfg) -> Splits:
    """``num_train`` + ``num_test`` distinct prompts from ``task.seed``; test is disjoint from train."""
    rng = np.random.default_rng(task_cfg.seed)
    want = task_cfg.num_train + task_cfg.num_test
    seen: dict[str, None] = {}
    for _ in range(50 * want):
        seen.setdefault(_random_prompt(task_cfg, rng), None)
        if len(seen) == want:
            break
    if len(seen) < want:
        raise ValueError(
            f"task {task_cfg.kind} with lengths {task_cfg.min_len}-{task_cfg.max_len} has too few distinct "
            f"prompts for num_train + num_test = {want}; widen the lengths or lower the counts"
        )
    examples = [Example(p, solve(task_cfg.kind, p)) for p in seen]
    return Splits(train=examples[: task_cfg.num_train], test=examples[task_cfg.num_train :])


def encode_prompts(examples: list[Example], prompt_length: int, vocab: Vocab = VOCAB) -> torch.Tensor:
    """``[B, P]`` int64: ``prompt SEP``, left-padded with PAD."""
    rows = []
    for ex in examples:
        ids = vocab.encode(ex.prompt) + [vocab.sep]
        if len(ids) > prompt_length:
            raise ValueError(f"prompt {ex.prompt!r} needs {len(ids)} tokens, the prompt region holds {prompt_length}")
        rows.append([vocab.pad] * (prompt_length - len(ids)) + ids)
    return torch.tensor(rows, dtype=torch.int64)


def encode_answers(examples: list[Example], gen_length: int, vocab: Vocab = VOCAB) -> torch.Tensor:
    """``[B, G]`` int64: answer digits, then EOS to the end."""
    rows = []
    for ex in examples:
        ids = vocab.encode(ex.answer)
        if len(ids) >= gen_length:
            raise ValueError(f"answer {ex.answer!r} plus EOS does not fit in gen_length={gen_length}")
        rows.append(ids + [vocab.eos] * (gen_length - len(ids)))
    return torch.tensor(rows, dtype=torch.int64)


def parse_answer(generated, vocab: Vocab = VOCAB) -> str:
    """Generated ids up to the first EOS as text (non-digits shown as decoded symbols)."""
    out = []
    for tok in generated:
        if int(tok) == vocab.eos:
            break
        out.append(int(tok))
    return vocab.decode(out)


def score(generated: torch.Tensor, examples: list[Example], partial_weight: float,
          vocab: Vocab = VOCAB) -> dict[str, np.ndarray]:
    """Per-row ``reward``, ``exact`` and ``partial`` of ``[B, G]`` generated ids."""
    exact, partial = [], []
    for row, ex in zip(generated.tolist(), examples):
        pred = parse_answer(row, vocab)
        hits = sum(a == b for a, b in zip(pred, ex.answer))
        exact.append(float(pred == ex.answer))
        partial.append(hits / max(len(ex.answer), len(pred)))
    exact_a, partial_a = np.asarray(exact, np.float32), np.asarray(partial, np.float32)
    return {"reward": exact_a + partial_weight * partial_a, "exact": exact_a, "partial": partial_a}


def split_frames(task_cfg):
    """The generated splits as tables (``prompt``, ``answer``) and their joint content digest."""
    import hashlib

    import pandas as pd

    from diffusionrl.tracking import frame_digest

    splits = make_splits(task_cfg)
    frames = [pd.DataFrame({"prompt": [e.prompt for e in part], "answer": [e.answer for e in part]})
              for part in (splits.train, splits.test)]
    digest = hashlib.sha256((frame_digest(frames[0]) + frame_digest(frames[1])).encode()).hexdigest()[:16]
    return frames[0], frames[1], digest
