"""DiffusionGemma rollouts through the stock ``DiffusionGemmaPipeline`` and their exact replay.

Rollout: the stock pipeline with ``RecordingScheduler``, a ``BlockRefinementScheduler`` whose
``step`` is the parent's, unchanged, plus a record of what it saw and did. Per block ``j`` and
denoising step ``s`` the scheduler receives the decoder's input canvas and logits and returns which
positions it committed (``transfer_index``), which committed tokens it replaced (edits), the
sampled tokens, and the next canvas, whose uncommitted positions it has renoised with uniform
random tokens. ``CanvasTrace`` keeps all of it (docs/bdlm.md, "DiffusionGemma trace").

Actions: every commit and every edit is an action, scored with ``log_softmax(logits / T)`` of its
token at its (block, step, position) slot; slot ``g * C + c`` of the flattened ``[B, A]`` layout
(``A = blocks * steps * C``) holds position ``c`` of global step ``g = j * S + s``.

Replay of block ``j`` is the pipeline's own computation: the encoder writes the prompt and blocks
``< j`` into a fresh ``DynamicCache`` one call per block (the KV-cache boundary is
``P + j * C``), then one decoder forward per step on the *recorded* canvas with the *recorded*
self-conditioning logits (the behaviour policy's logits of step ``s - 1``: part of the state, not
differentiated). With the rollout's weights and rows it equals the rollout bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from diffusers import BlockRefinementScheduler, DiffusionGemmaPipeline

from .gemma import DiffusionGemmaAdapter
from .model import VOCAB, Vocab
from .replay import StepScores

COMMIT, EDIT = 1, 2


class ReplayUnsupported(ValueError):
    """A sampler option whose effect the trace replay does not reproduce (raised before training)."""


def check_replayable(model_cfg, adapter: DiffusionGemmaAdapter | None = None) -> None:
    """Fail, naming the option, when a rollout with these settings could not be replayed exactly."""
    problems = []
    if model_cfg.scheduler != "block_refinement":
        problems.append(f"model.scheduler={model_cfg.scheduler!r} (only block_refinement records commits and edits)")
    if model_cfg.confidence_threshold:
        problems.append(f"model.confidence_threshold={model_cfg.confidence_threshold} (the adaptive stop writes the "
                        "argmax canvas, not sampled actions); set it to 0")
    if model_cfg.temperature <= 0:
        problems.append(f"model.temperature={model_cfg.temperature} (greedy decoding has no log-probs)")
    if adapter is not None and adapter.canvas_length != model_cfg.block_size:
        problems.append(f"model.block_size={model_cfg.block_size} differs from the model's canvas_length "
                        f"{adapter.canvas_length}")
    if model_cfg.gen_length % model_cfg.block_size:
        problems.append(f"model.gen_length={model_cfg.gen_length} is not a multiple of the canvas length")
    if problems:
        raise ReplayUnsupported("DiffusionGemma rollout cannot be replayed exactly: " + "; ".join(problems))


@dataclass
class StepRecord:
    timestep: int
    sample: torch.Tensor  # [b, C] decoder input canvas
    logits: torch.Tensor  # [b, C, V] float32
    transfer: torch.Tensor  # [b, C] bool: commits
    edit: torch.Tensor  # [b, C] bool: edits of committed tokens
    sampled: torch.Tensor  # [b, C]
    prev_sample: torch.Tensor  # [b, C] next canvas (committed + edited + renoised)


class RecordingScheduler(BlockRefinementScheduler):
    """``BlockRefinementScheduler`` that records each ``step`` (the parent computes everything)."""

    records: list[StepRecord]

    def step(self, model_output, timestep, sample, *, mask_token_id=None, temperature=0.0, generator=None,
             return_dict=True, **kwargs):
        out = super().step(model_output, timestep, sample, mask_token_id=mask_token_id, temperature=temperature,
                           generator=generator, return_dict=True, **kwargs)
        self.records.append(StepRecord(int(timestep), sample.clone(), model_output.detach().float().clone(),
                                       out.transfer_index.clone(), out.editing_transfer_index.clone(),
                                       out.sampled_tokens.clone(), out.prev_sample.clone()))
        return out if return_dict else out.to_tuple()


def make_pipeline(adapter: DiffusionGemmaAdapter, model_cfg, recording: bool = True) -> DiffusionGemmaPipeline:
    cls = RecordingScheduler if recording else BlockRefinementScheduler
    editing = model_cfg.editing_threshold or None
    scheduler = cls(block_length=adapter.canvas_length, num_inference_steps=model_cfg.steps_per_block,
                    threshold=model_cfg.threshold, editing_threshold=editing)
    pipe = DiffusionGemmaPipeline(model=adapter.module, scheduler=scheduler, processor=adapter.processor)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_kwargs(model_cfg, seed: int, temperature: float) -> dict:
    """The stock pipeline's arguments of a rollout (one generator per call, seeded)."""
    return {"gen_length": model_cfg.gen_length, "num_inference_steps": model_cfg.steps_per_block,
            "temperature": temperature, "confidence_threshold": model_cfg.confidence_threshold or None,
            "eos_early_stop": False, "generator": torch.Generator().manual_seed(int(seed)), "output_type": "seq"}


@dataclass
class CanvasTrace:
    """The DiffusionGemma trace contract (validated when built; docs/bdlm.md)."""

    prompts: torch.Tensor  # [B, P] int64
    sequences: torch.Tensor  # [B, G] int64: final blocks (pipeline output)
    canvases: torch.Tensor  # [B, nb, S, C] int64: decoder input of each step (renoised positions included)
    actions: torch.Tensor  # [B, nb, S, C] int64: 0 none, 1 commit, 2 edit
    tokens: torch.Tensor  # [B, nb, S, C] int64: sampled token at each position
    renoised: torch.Tensor  # [B, nb, S, C] bool: position refilled with a random token after the step
    self_cond: torch.Tensor  # [B, nb, S, C, V] float32: logits of step s-1 (unused at s = 0)
    log_probs: torch.Tensor  # [B, A] float32: action log-probs, 0 where no action
    temperature: float
    micro_batch_size: int
    group_ids: torch.Tensor  # [B]
    seeds: torch.Tensor  # [B]: the generator seed of the row's micro-batch call
    policy_version: int = 0
    rewards: torch.Tensor | None = None
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    advantages: torch.Tensor | None = None
    metadata: list[dict] | None = None
    vocab: Vocab = VOCAB
    excluded_token: int | None = None  # no MASK token: the KL runs over the whole vocabulary

    def __post_init__(self) -> None:
        validate(self)

    @property
    def batch_size(self) -> int:
        return int(self.prompts.shape[0])

    @property
    def prompt_length(self) -> int:
        return int(self.prompts.shape[1])

    @property
    def num_blocks(self) -> int:
        return int(self.canvases.shape[1])

    @property
    def steps_per_block(self) -> int:
        return int(self.canvases.shape[2])

    @property
    def canvas_length(self) -> int:
        return int(self.canvases.shape[3])

    @property
    def generation_length(self) -> int:
        return int(self.sequences.shape[1])

    @property
    def targets(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.sequences], 1)  # [B, P + G]

    @property
    def action_steps(self) -> torch.Tensor:
        """``[B, A]``: the global step of the action in each slot, -1 where there is none."""
        b, nb, s, c = self.actions.shape
        g = torch.arange(nb * s).view(1, nb, s, 1).expand(b, nb, s, c)
        return torch.where(self.actions > 0, g, torch.full_like(g, -1)).reshape(b, -1)

    @property
    def loss_weights(self) -> torch.Tensor:
        return (self.actions > 0).reshape(self.batch_size, -1).float()

    @property
    def cache_boundaries(self) -> list[int]:
        """KV-cache length when block ``j`` is denoised: the prompt and blocks ``< j``."""
        return [self.prompt_length + j * self.canvas_length for j in range(self.num_blocks)]

    def micro_batches(self, size: int | None = None) -> list[slice]:
        size = size or self.micro_batch_size
        return [slice(i, min(i + size, self.batch_size)) for i in range(0, self.batch_size, size)]

    def with_rewards(self, rewards, components, advantages) -> CanvasTrace:
        return replace(self, rewards=rewards.float(), reward_components=components, advantages=advantages.float())

    # -- what the learner calls (same interface as TraceBatch) ----------------------------------------
    def unit_keys(self, rows: slice) -> list[int]:
        """Blocks with at least one action among ``rows``: one replay unit each."""
        has = (self.actions[rows] > 0).flatten(2).any(-1).any(0)  # [nb]
        return [j for j in range(self.num_blocks) if bool(has[j])]

    def block_cols(self, block: int) -> slice:
        width = self.steps_per_block * self.canvas_length
        return slice(block * width, (block + 1) * width)

    def unit_mask(self, rows: slice, block: int) -> torch.Tensor:
        mask = torch.zeros(self.log_probs[rows].shape, dtype=torch.bool)
        mask[:, self.block_cols(block)] = (self.actions[rows, block] > 0).reshape(mask.shape[0], -1)
        return mask

    def score_unit(self, adapter: DiffusionGemmaAdapter, rows: slice, block: int) -> StepScores:
        return replay_block(adapter, self, rows, block)


def validate(t: CanvasTrace) -> None:
    def fail(msg: str):
        raise ValueError(f"invalid DiffusionGemma trace: {msg}")

    b, nb, s, c = t.canvases.shape
    for name in ("actions", "tokens", "renoised"):
        if tuple(getattr(t, name).shape) != (b, nb, s, c):
            fail(f"{name} has shape {tuple(getattr(t, name).shape)}, canvases {(b, nb, s, c)}")
    if tuple(t.sequences.shape) != (b, nb * c) or tuple(t.log_probs.shape) != (b, nb * s * c):
        fail("sequences must be [B, blocks * C] and log_probs [B, blocks * steps * C]")
    commits = (t.actions == COMMIT).sum(2)  # [B, nb, C]
    if bool((commits != 1).any()):
        fail("every canvas position must be committed exactly once per block")
    committed_before = ((t.actions == COMMIT).long().cumsum(2) - (t.actions == COMMIT).long()) > 0
    if bool(((t.actions == EDIT) & ~committed_before).any()):
        fail("an edit must replace a token committed at an earlier step")
    final = t.canvases[:, :, -1].clone()  # the last step's input, then its actions applied
    act = t.actions[:, :, -1] > 0
    final[act] = t.tokens[:, :, -1][act]
    if not torch.equal(final.reshape(b, -1), t.sequences):
        fail("the recorded actions do not reproduce the final sequences")
    on = t.log_probs[t.loss_weights > 0]
    if not bool(torch.isfinite(on).all()) or bool((on > 0).any()):
        fail("action log-probs must be finite and <= 0")
    if t.temperature <= 0:
        fail(f"temperature {t.temperature} must be > 0")


def _block_records(records: list[StepRecord], num_blocks: int, steps: int) -> list[list[StepRecord]]:
    if len(records) != num_blocks * steps or [r.timestep for r in records] != list(range(steps)) * num_blocks:
        raise ReplayUnsupported(f"the pipeline ran {len(records)} scheduler steps, expected {num_blocks} blocks x "
                                f"{steps} steps (an early stop or a corrector the replay does not cover)")
    return [records[j * steps : (j + 1) * steps] for j in range(num_blocks)]


@torch.no_grad()
def rollout(adapter: DiffusionGemmaAdapter, model_cfg, prompt_texts: list[str], seeds: torch.Tensor,
            micro_batch_size: int, group_ids: torch.Tensor | None = None) -> CanvasTrace:
    """Sample ``prompt_texts`` through the stock pipeline, one call per micro-batch (seeded by the
    micro-batch's first seed), and return the recorded trace."""
    check_replayable(model_cfg, adapter)
    adapter.check_digit_vocab()
    pipe = make_pipeline(adapter, model_cfg)
    temp = model_cfg.temperature
    nb, steps = model_cfg.gen_length // adapter.canvas_length, model_cfg.steps_per_block
    parts = []
    for start in range(0, len(prompt_texts), micro_batch_size):
        rows = slice(start, start + micro_batch_size)
        pipe.scheduler.records = []
        out = pipe(prompt=prompt_texts[rows], **pipeline_kwargs(model_cfg, int(seeds[start]), temp))
        blocks = _block_records(pipe.scheduler.records, nb, steps)
        stack = {k: torch.stack([torch.stack([getattr(r, k) for r in blk], 1) for blk in blocks], 1)
                 for k in ("sample", "logits", "transfer", "edit", "sampled", "prev_sample")}  # [b, nb, S, ...]
        actions = stack["transfer"].long() * COMMIT + stack["edit"].long() * EDIT
        committed = (stack["transfer"].long().cumsum(2) > 0)
        log_p = torch.log_softmax(stack["logits"] / temp, -1).gather(-1, stack["sampled"][..., None]).squeeze(-1)
        sc = torch.zeros_like(stack["logits"])
        sc[:, :, 1:] = stack["logits"][:, :, :-1]
        prompts = torch.stack([torch.tensor(adapter.processor.encode(p)) for p in prompt_texts[rows]])
        parts.append({"prompts": prompts, "sequences": out.sequences, "canvases": stack["sample"], "actions": actions,
                      "tokens": stack["sampled"], "renoised": ~committed, "self_cond": sc,
                      "log_probs": torch.where(actions > 0, log_p, torch.zeros(())).reshape(len(prompts), -1)})
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    b = len(prompt_texts)
    return CanvasTrace(**cat, temperature=temp, micro_batch_size=micro_batch_size,
                       group_ids=group_ids if group_ids is not None else torch.zeros(b, dtype=torch.int64),
                       seeds=seeds.clone(), vocab=adapter.vocab)


def replay_block(adapter: DiffusionGemmaAdapter, trace: CanvasTrace, rows: slice, block: int) -> StepScores:
    """Log-probs of block ``block``'s actions of ``rows`` under ``adapter`` (grad if enabled):
    the encoder writes the context one block per call, as the pipeline does; then one decoder
    forward per step on the recorded canvas and self-conditioning logits."""
    from transformers import DynamicCache

    model = adapter.module
    prompts, seqs = trace.prompts[rows], trace.sequences[rows]
    m, p, c = prompts.shape[0], trace.prompt_length, trace.canvas_length
    cache = DynamicCache(config=adapter.text_config)
    context = torch.cat([prompts, seqs[:, : block * c]], 1)
    bounds = [0, p] + [p + (i + 1) * c for i in range(block)]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        model.model.encoder(input_ids=context[:, lo:hi], attention_mask=torch.ones(m, hi, dtype=torch.long),
                            past_key_values=cache, position_ids=torch.arange(lo, hi).unsqueeze(0))
    cur = bounds[-1]
    mask = model.model.decoder.create_diffusion_decoder_attention_mask(
        config=model.config, inputs_embeds=torch.empty((m, c, 0)), cache=cache,
        decoder_attention_mask=torch.ones(m, cur + c, dtype=torch.bool))
    positions = torch.arange(cur, cur + c).unsqueeze(0)
    acts = trace.actions[rows, block] > 0  # [m, S, C]
    out_lp, out_tok = [], []
    for s in range(trace.steps_per_block):
        sc = trace.self_cond[rows, block, s] if s > 0 else None
        logits = model(decoder_input_ids=trace.canvases[rows, block, s], past_key_values=cache,
                       self_conditioning_logits=sc, decoder_attention_mask=mask,
                       decoder_position_ids=positions).logits  # [m, C, V]
        active = acts[:, s]
        safe = torch.where(active[..., None], logits.float(), torch.zeros((), dtype=torch.float32))
        log_p = torch.log_softmax(safe / trace.temperature, -1)  # [m, C, V]
        chosen = log_p.gather(-1, trace.tokens[rows, block, s][..., None]).squeeze(-1)
        out_lp.append(log_p)
        out_tok.append(torch.where(active, chosen, torch.zeros_like(chosen)))
    return StepScores(torch.stack(out_tok, 1).reshape(m, -1), torch.stack(out_lp, 1).reshape(m, -1, log_p.shape[-1]),
                      trace.block_cols(block))


@torch.no_grad()
def decode_greedy(adapter: DiffusionGemmaAdapter, model_cfg, prompt_texts: list[str], batch_size: int,
                  threshold: float, seed: int = 0) -> torch.Tensor:
    """Greedy (temperature 0) decoding through the stock pipeline -> generated ids ``[B, G]``.
    The initial canvas and the renoising stay random, so the generator is seeded (``seed``) per
    call: an evaluation is deterministic."""
    pipe = make_pipeline(adapter, replace(model_cfg, threshold=threshold), recording=False)
    return torch.cat([pipe(prompt=prompt_texts[i : i + batch_size], **pipeline_kwargs(model_cfg, seed, 0.0)).sequences
                      for i in range(0, len(prompt_texts), batch_size)])
