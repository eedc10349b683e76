"""LLaDA2-style masked LMs through the stock ``diffusers.LLaDA2Pipeline``, recorded and replayed.

The model is any ``transformers`` masked LM with a MASK token that takes ``(input_ids,
attention_mask, position_ids)`` (``HFMaskedLMAdapter`` with the identity token map: the pipeline
samples in the model's own ids, so the model's vocabulary must be the digit vocabulary for the
digit tasks). ``builtin:tiny-llada2`` is a 2-layer 32-wide ``BertForMaskedLM`` built in code (eager
attention, no dropout).

The pipeline decodes globally aligned blocks of ``block_length`` (the first may hold the prompt's
tail); at each step the model sees the window ``x[:, :block_end]`` (earlier blocks final, the
current block as it stands, nothing after) and ``BlockRefinementScheduler`` commits masked
positions (threshold or quota) and, with ``editing_threshold``, replaces committed ones, for up to
``max_post_steps`` extra steps once the block has no MASK left. ``WindowTrace`` records per step
the block, its input tokens, the actions (commit / edit), the sampled tokens and their log-probs;
the replay rebuilds each window from the final canvas and the recorded block input.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from diffusers import LLaDA2Pipeline

from .gemma_rollout import COMMIT, EDIT, RecordingScheduler, ReplayUnsupported
from .model import MODEL_FILE, VOCAB, HFMaskedLMAdapter, Vocab
from .replay import StepScores

BUILTIN = "builtin:tiny-llada2"
KIND = "llada2"


class LLaDA2Adapter(HFMaskedLMAdapter):
    """``HFMaskedLMAdapter`` whose ids are the model's own (identity map), for ``LLaDA2Pipeline``."""

    kind = KIND

    def __init__(self, model, vocab: Vocab = VOCAB):
        model.config._attn_implementation = "eager"
        super().__init__(model, list(range(vocab.size)), vocab)

    def check_digit_vocab(self) -> None:
        if self.module.config.vocab_size != self.vocab.size:
            raise ValueError(f"vocabulary of {self.module.config.vocab_size} tokens is not the digit tasks' "
                             f"({self.vocab.size}); use {BUILTIN} or a folder saved from it")


def build_tiny_llada2(model_cfg, vocab: Vocab = VOCAB) -> LLaDA2Adapter:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(model_cfg.init_seed)
    cfg = BertConfig(vocab_size=vocab.size, hidden_size=model_cfg.dim, num_hidden_layers=model_cfg.layers,
                     num_attention_heads=model_cfg.heads, intermediate_size=model_cfg.ff_dim,
                     max_position_embeddings=model_cfg.max_length, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=vocab.pad, attn_implementation="eager")
    return LLaDA2Adapter(BertForMaskedLM(cfg), vocab)


def load_llada2(reference, revision: str = "") -> LLaDA2Adapter:
    """A saved folder (offline) or a hub id at ``revision`` with ``$HF_TOKEN``."""
    import json
    from pathlib import Path

    from transformers import AutoModelForMaskedLM

    from diffusionrl.hub import hf_token

    directory = Path(reference)
    if (directory / MODEL_FILE).is_file():
        vocab = Vocab(**json.loads((directory / MODEL_FILE).read_text())["vocab"])
        return LLaDA2Adapter(AutoModelForMaskedLM.from_pretrained(str(directory), attn_implementation="eager"), vocab)
    model = AutoModelForMaskedLM.from_pretrained(str(reference), revision=revision or None, token=hf_token(),
                                                 attn_implementation="eager")
    return LLaDA2Adapter(model)


def check_replayable(model_cfg) -> None:
    problems = []
    if model_cfg.scheduler != "block_refinement":
        problems.append(f"model.scheduler={model_cfg.scheduler!r}")
    if model_cfg.temperature <= 0:
        problems.append(f"model.temperature={model_cfg.temperature} (greedy decoding has no log-probs)")
    if model_cfg.confidence_threshold:
        problems.append(f"model.confidence_threshold={model_cfg.confidence_threshold} (a DiffusionGemma option)")
    if problems:
        raise ReplayUnsupported("LLaDA2 rollout cannot be replayed exactly: " + "; ".join(problems))


def pipeline_kwargs(model_cfg, temperature: float, seed: int) -> dict:
    return {"gen_length": model_cfg.gen_length, "block_length": model_cfg.block_size,
            "num_inference_steps": model_cfg.steps_per_block, "temperature": temperature,
            "sampling_method": "multinomial" if temperature > 0 else "greedy", "threshold": model_cfg.threshold,
            "editing_threshold": model_cfg.editing_threshold or None, "max_post_steps": model_cfg.max_post_steps,
            "eos_early_stop": False, "generator": torch.Generator().manual_seed(int(seed)), "output_type": "seq"}


def make_pipeline(adapter: LLaDA2Adapter, model_cfg, recording: bool = True) -> LLaDA2Pipeline:
    from diffusers import BlockRefinementScheduler

    cls = RecordingScheduler if recording else BlockRefinementScheduler
    pipe = LLaDA2Pipeline(model=adapter.module, scheduler=cls(block_length=model_cfg.block_size))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe, adapter, model_cfg, prompts: torch.Tensor, temperature: float, seed: int, **extra):
    return pipe(input_ids=prompts, eos_token_id=adapter.vocab.eos, mask_token_id=adapter.vocab.mask,
                **pipeline_kwargs(model_cfg, temperature, seed), **extra)


@dataclass
class WindowTrace:
    """LLaDA2 trace: ``S`` = the most steps any micro-batch took (shorter ones padded, block -1)."""

    prompts: torch.Tensor  # [B, P]
    final: torch.Tensor  # [B, T] the whole canvas after decoding (T = blocks * block_length >= P + G)
    step_blocks: torch.Tensor  # [B, S] block index of each step, -1 for padding
    inputs: torch.Tensor  # [B, S, bl] block tokens at the step's input
    actions: torch.Tensor  # [B, S, bl] 0 none, 1 commit, 2 edit
    tokens: torch.Tensor  # [B, S, bl] sampled tokens
    log_probs: torch.Tensor  # [B, S * bl]
    gen_length: int
    temperature: float
    micro_batch_size: int
    group_ids: torch.Tensor
    seeds: torch.Tensor
    policy_version: int = 0
    rewards: torch.Tensor | None = None
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    advantages: torch.Tensor | None = None
    metadata: list[dict] | None = None
    vocab: Vocab = VOCAB

    def __post_init__(self) -> None:
        on = self.actions > 0
        if bool((self.inputs[on & (self.actions == COMMIT)] != self.vocab.mask).any()):
            raise ValueError("invalid LLaDA2 trace: a commit must fill a MASK position")
        if bool((self.inputs[on & (self.actions == EDIT)] == self.vocab.mask).any()):
            raise ValueError("invalid LLaDA2 trace: an edit must replace a committed token")

    excluded_token = None  # the stock scheduler samples from the whole vocabulary, MASK included
    batch_size = property(lambda self: int(self.prompts.shape[0]))
    prompt_length = property(lambda self: int(self.prompts.shape[1]))
    block_length = property(lambda self: int(self.inputs.shape[2]))
    generation_length = property(lambda self: self.gen_length)

    @property
    def targets(self) -> torch.Tensor:
        return self.final[:, : self.prompt_length + self.gen_length]

    @property
    def action_steps(self) -> torch.Tensor:
        b, s, bl = self.actions.shape
        g = torch.arange(s).view(1, s, 1).expand(b, s, bl)
        return torch.where(self.actions > 0, g, torch.full_like(g, -1)).reshape(b, -1)

    @property
    def loss_weights(self) -> torch.Tensor:
        return (self.actions > 0).reshape(self.batch_size, -1).float()

    def micro_batches(self, size: int | None = None) -> list[slice]:
        size = size or self.micro_batch_size
        return [slice(i, min(i + size, self.batch_size)) for i in range(0, self.batch_size, size)]

    def with_rewards(self, rewards, components, advantages) -> WindowTrace:
        return replace(self, rewards=rewards.float(), reward_components=components, advantages=advantages.float())

    def unit_keys(self, rows: slice) -> list[int]:
        has = (self.actions[rows] > 0).any(-1).any(0)  # [S]
        return [int(s) for s in torch.nonzero(has).flatten()]

    def unit_mask(self, rows: slice, step: int) -> torch.Tensor:
        return self.action_steps[rows] == step

    def score_unit(self, adapter: LLaDA2Adapter, rows: slice, step: int) -> StepScores:
        """One forward per distinct block among ``rows`` at ``step`` (one, when the learner's
        micro-batch lies inside a rollout micro-batch), on the window the pipeline saw."""
        bl, m = self.block_length, self.prompts[rows].shape[0]
        blocks = self.step_blocks[rows, step]
        lp_out = torch.zeros(m, bl, self.vocab.size)
        tok_out = torch.zeros(m, bl)
        for k in sorted(set(blocks.tolist()) - {-1}):
            sel = torch.nonzero(blocks == k).flatten()
            idx = torch.arange(rows.start, rows.start + m)[sel]
            end = (k + 1) * bl
            window = self.final[idx, :end].clone()
            window[:, -bl:] = self.inputs[idx, step]
            attn = torch.zeros(len(idx), end, dtype=torch.long)
            attn[:, : self.prompt_length + self.gen_length] = 1
            pos = torch.arange(end).unsqueeze(0).expand(len(idx), -1)
            logits = adapter.module(window, attention_mask=attn, position_ids=pos).logits[:, -bl:]  # [n, bl, V]
            active = self.actions[idx, step] > 0
            safe = torch.where(active[..., None], logits.float(), torch.zeros((), dtype=torch.float32))
            log_p = torch.log_softmax(safe / self.temperature, -1)
            chosen = log_p.gather(-1, self.tokens[idx, step][..., None]).squeeze(-1)
            lp_out = lp_out.index_put((sel,), log_p)
            tok_out = tok_out.index_put((sel,), torch.where(active, chosen, torch.zeros_like(chosen)))
        return StepScores(tok_out, lp_out, slice(step * bl, (step + 1) * bl))


@torch.no_grad()
def rollout(adapter: LLaDA2Adapter, model_cfg, prompts: torch.Tensor, seeds: torch.Tensor, micro_batch_size: int,
            group_ids: torch.Tensor | None = None) -> WindowTrace:
    """Sample ``prompts`` ``[B, P]`` through the stock ``LLaDA2Pipeline``, one call per micro-batch."""
    check_replayable(model_cfg)
    adapter.check_digit_vocab()
    pipe = make_pipeline(adapter, model_cfg)
    temp, bl, p = model_cfg.temperature, model_cfg.block_size, prompts.shape[1]
    parts = []
    for start in range(0, len(prompts), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        pipe.scheduler.records = []
        out = _call(pipe, adapter, model_cfg, prompts[rows], temp, int(seeds[start]))
        recs = pipe.scheduler.records
        # a block's first step is its only one at timestep 0 (the pipeline counts steps with MASK left)
        blocks = (torch.tensor([r.timestep == 0 for r in recs]).long().cumsum(0) - 1 + p // bl).tolist()
        n = out.sequences.shape[0]
        total = -(-(p + model_cfg.gen_length) // bl) * bl  # the tail past P + G is only ever seen as block input
        final = torch.cat([prompts[rows], out.sequences, torch.full((n, total - p - model_cfg.gen_length),
                                                                    adapter.vocab.mask)], 1)
        acts = torch.stack([r.transfer.long() * COMMIT + r.edit.long() * EDIT for r in recs], 1)
        lp = torch.stack([torch.log_softmax(r.logits / temp, -1).gather(-1, r.sampled[..., None]).squeeze(-1)
                          for r in recs], 1)
        parts.append({"final": final, "step_blocks": torch.tensor(blocks).expand(n, -1),
                      "inputs": torch.stack([r.sample for r in recs], 1), "actions": acts,
                      "tokens": torch.stack([r.sampled for r in recs], 1),
                      "log_probs": torch.where(acts > 0, lp, torch.zeros(())).reshape(n, -1)})
    s = max(part["inputs"].shape[1] for part in parts)
    for part in parts:  # pad to the longest micro-batch: steps without actions, block -1
        pad = s - part["inputs"].shape[1]
        if pad:
            for k in ("inputs", "actions", "tokens"):
                part[k] = torch.cat([part[k], torch.zeros(part[k].shape[0], pad, bl, dtype=part[k].dtype)], 1)
            part["step_blocks"] = torch.cat([part["step_blocks"], torch.full((part["final"].shape[0], pad), -1)], 1)
            part["log_probs"] = torch.cat([part["log_probs"], torch.zeros(part["final"].shape[0], pad * bl)], 1)
    cat = {k: torch.cat([part[k] for part in parts]) for k in parts[0]}
    b = len(prompts)
    return WindowTrace(prompts=prompts.clone(), **cat, gen_length=model_cfg.gen_length, temperature=temp,
                       micro_batch_size=micro_batch_size,
                       group_ids=group_ids if group_ids is not None else torch.zeros(b, dtype=torch.int64),
                       seeds=seeds.clone(), vocab=adapter.vocab)


@torch.no_grad()
def decode_greedy(adapter: LLaDA2Adapter, model_cfg, prompts: torch.Tensor, batch_size: int,
                  threshold: float) -> torch.Tensor:
    """Greedy decoding through the stock pipeline -> generated ids ``[B, G]``."""
    pipe = make_pipeline(adapter, replace(model_cfg, threshold=threshold), recording=False)
    cfg = replace(model_cfg, threshold=threshold)
    return torch.cat([_call(pipe, adapter, cfg, prompts[i : i + batch_size], 0.0, 0).sequences
                      for i in range(0, len(prompts), batch_size)])
