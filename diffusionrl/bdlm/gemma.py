"""DiffusionGemma (``transformers.DiffusionGemmaForBlockDiffusion``) as a block-diffusion policy.

The model is an encoder-decoder over one token space: a causal encoder writes the prompt and every
finished canvas into a KV cache; a bidirectional decoder denoises a ``canvas_length`` canvas that
starts as uniform random tokens (no MASK token), conditioned on the cache and on its own previous
logits (self-conditioning). Rollouts run through the stock ``diffusers.DiffusionGemmaPipeline``
with ``BlockRefinementScheduler`` (``gemma_rollout``).

- ``builtin:tiny-diffusiongemma``: a ~60 k-parameter config built in code (2 layers, one sliding
  and one full-attention, each with its dense MLP and an MoE block of ``model.num_experts``
  experts, 2 active; a 16-wide vision tower the text path never calls) whose
  vocabulary *is* the digit vocabulary (``VOCAB``), so ids need no map. Eager attention: the same
  kernels run with and without autograd, which the exact replay relies on.
- a folder written by ``DiffusionGemmaAdapter.save`` (``bdlm_model.json`` + the Hugging Face
  files), read offline with ``from_pretrained``;
- a hub id (``google/diffusiongemma-...``) at ``model.revision`` with ``$HF_TOKEN``, as the image
  loaders do (``hub.hf_token``). Its vocabulary is not the digit vocabulary, so the digit
  tasks refuse it (``check_digit_vocab``); the pipeline and the processor load all the same.

Compatibility: diffusers 0.42.1's pipeline calls the decoder's
``create_diffusion_decoder_attention_mask(past_key_values=...)``, which transformers 5.24 renamed to
``cache``; ``_accept_past_key_values`` installs a per-instance wrapper that maps the old name onto
the new one (nothing global is patched).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from .model import MODEL_FILE, VOCAB, Vocab

BUILTIN = "builtin:tiny-diffusiongemma"
KIND = "diffusiongemma"


class DigitProcessor:
    """What the stock pipeline needs of a processor, for the digit vocabulary: ``apply_chat_template``
    (a user turn's text, e.g. ``"..3142|"``, straight to ids; no chat markup), ``batch_decode`` and
    ``eos_token_id``. Rows of one call must have equal length (prompts are left-padded with PAD);
    the attention mask is all ones, as in the built-in sampler (PAD is a token like any other)."""

    def __init__(self, vocab: Vocab = VOCAB):
        self.vocab = vocab
        self.eos_token_id = vocab.eos

    def encode(self, text: str) -> list[int]:
        pad = {".": self.vocab.pad, "$": self.vocab.eos}
        return [pad[ch] if ch in pad else self.vocab.encode(ch)[0] for ch in text]

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_tensors="pt",
                            return_dict=True, **_):
        convs = messages if messages and isinstance(messages[0], list) else [messages]
        rows = [self.encode(conv[-1]["content"]) for conv in convs]
        if len({len(r) for r in rows}) != 1:
            raise ValueError("DigitProcessor: prompts of one call must have equal length (left-pad them with '.')")
        ids = torch.tensor(rows, dtype=torch.int64)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def batch_decode(self, sequences, skip_special_tokens=True) -> list[str]:
        return [self.vocab.decode(s) for s in sequences]


def tiny_config(model_cfg, vocab: Vocab = VOCAB):
    """``DiffusionGemmaConfig`` of ``builtin:tiny-diffusiongemma`` from a ``BDLMModelConfig``."""
    from transformers import DiffusionGemmaConfig

    head_dim = model_cfg.dim // model_cfg.heads
    moe = {"num_experts": model_cfg.num_experts, "top_k_experts": min(2, model_cfg.num_experts),
           "moe_intermediate_size": model_cfg.ff_dim // 2}
    text = dict(vocab_size=vocab.size, hidden_size=model_cfg.dim, intermediate_size=model_cfg.ff_dim,
                num_hidden_layers=model_cfg.layers, num_attention_heads=model_cfg.heads, num_key_value_heads=1,
                head_dim=head_dim, global_head_dim=head_dim, max_position_embeddings=model_cfg.max_length,
                sliding_window=model_cfg.max_length,
                layer_types=["sliding_attention"] * (model_cfg.layers - 1) + ["full_attention"],
                pad_token_id=vocab.pad, eos_token_id=vocab.eos, bos_token_id=None, **moe)
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=model_cfg.block_size,
                                  boi_token_id=None, eoi_token_id=None, image_token_id=None)
    config._attn_implementation = "eager"
    return config


def _accept_past_key_values(model) -> None:
    """Let the decoder's mask builder take the pipeline's ``past_key_values=`` (see module doc)."""
    decoder = model.model.decoder
    build = type(decoder).create_diffusion_decoder_attention_mask

    def create_diffusion_decoder_attention_mask(config, inputs_embeds, cache=None, decoder_attention_mask=None,
                                                past_key_values=None):
        return build(config=config, inputs_embeds=inputs_embeds,
                     cache=cache if cache is not None else past_key_values,
                     decoder_attention_mask=decoder_attention_mask)

    decoder.create_diffusion_decoder_attention_mask = create_diffusion_decoder_attention_mask


class DiffusionGemmaAdapter:
    """A ``DiffusionGemmaForBlockDiffusion`` with its processor; ``module`` is the trainable model.

    It has no ``logits(canvas)``: the model needs a KV cache and self-conditioning, so the sampler
    (the stock pipeline) and the replay (``gemma_rollout.replay_block``) call it themselves.
    """

    kind = KIND

    def __init__(self, model, processor=None, vocab: Vocab = VOCAB, source: str = BUILTIN):
        model.config._attn_implementation = "eager"
        _accept_past_key_values(model)
        self.module = model.eval()  # no dropout in the text path; eval is the only mode
        self.processor = processor if processor is not None else DigitProcessor(vocab)
        self.vocab = vocab
        self.source = source

    @property
    def canvas_length(self) -> int:
        return int(self.module.config.canvas_length)

    @property
    def text_config(self):
        return self.module.config.get_text_config(decoder=True)

    def check_digit_vocab(self) -> None:
        if self.text_config.vocab_size != self.vocab.size:
            raise ValueError(
                f"{self.source}: vocabulary of {self.text_config.vocab_size} tokens is not the digit tasks' "
                f"({self.vocab.size}); train on the digit tasks from {BUILTIN} or a folder saved from it"
            )

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        self.module.save_pretrained(str(directory))
        info = {"kind": self.kind, "vocab": asdict(self.vocab), "source": self.source}
        (directory / MODEL_FILE).write_text(json.dumps(info, indent=1))
        return directory

    def __deepcopy__(self, memo):
        """``frozen_copy`` support: a fresh model with the same config and weights (the per-instance
        mask-builder wrapper is a closure over the old decoder, so it is rebuilt, not copied)."""
        from transformers import DiffusionGemmaForBlockDiffusion

        with torch.random.fork_rng(devices=[]):  # the throwaway init must not move the global RNG
            twin = DiffusionGemmaForBlockDiffusion(self.module.config)
        twin.load_state_dict(self.module.state_dict())
        return DiffusionGemmaAdapter(twin, self.processor, self.vocab, self.source)


def build_tiny_diffusiongemma(model_cfg) -> DiffusionGemmaAdapter:
    """Fresh random ``builtin:tiny-diffusiongemma`` (seeded by ``model_cfg.init_seed``)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(model_cfg.init_seed)
    return DiffusionGemmaAdapter(DiffusionGemmaForBlockDiffusion(tiny_config(model_cfg)))


def load_diffusiongemma(reference: str | Path, revision: str = "") -> DiffusionGemmaAdapter:
    """A saved folder (offline, ``from_pretrained``) or a hub id at ``revision`` with ``$HF_TOKEN``."""
    from transformers import DiffusionGemmaForBlockDiffusion

    from diffusionrl.hub import hf_token

    directory = Path(reference)
    if (directory / MODEL_FILE).is_file():
        info = json.loads((directory / MODEL_FILE).read_text())
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(directory), attn_implementation="eager")
        return DiffusionGemmaAdapter(model, vocab=Vocab(**info["vocab"]), source=str(directory))
    from transformers import AutoProcessor

    kwargs = {"revision": revision or None, "token": hf_token()}
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(str(reference), attn_implementation="eager", **kwargs)
    processor = AutoProcessor.from_pretrained(str(reference), **kwargs)
    return DiffusionGemmaAdapter(model, processor, source=f"{reference}@{revision}" if revision else str(reference))


# -- supervised warm start (uniform-corruption block diffusion) ---------------------------------


def sft_loss(adapter: DiffusionGemmaAdapter, prompts: torch.Tensor, answers: torch.Tensor,
             gen: torch.Generator) -> torch.Tensor:
    """One uniform-corruption denoising loss on a batch, the way the pipeline samples.

    One block ``j`` for the whole batch; the encoder reads the prompt and the clean blocks ``< j``;
    each position of block ``j`` is replaced by a uniform random token with probability ``t ~ U(0,
    1)`` (per row); the decoder predicts the clean block (CE at every position, as the pipeline
    reads every position's logits). Half the rows are self-conditioned on a no-grad first pass's
    logits (``self_conditioning_mask``), so the self-conditioning path the sampler uses from its
    second step on is trained too.
    """
    from transformers import DynamicCache

    model, c = adapter.module, adapter.canvas_length
    b, p = prompts.shape
    j = int(torch.randint(answers.shape[1] // c, (1,), generator=gen))
    context = torch.cat([prompts, answers[:, : j * c]], 1)
    clean = answers[:, j * c : (j + 1) * c]
    t = torch.rand(b, 1, generator=gen)
    noise = torch.randint(adapter.text_config.vocab_size, clean.shape, generator=gen)
    canvas = torch.where(torch.rand(clean.shape, generator=gen) < t, noise, clean)
    sc_rows = torch.rand(b, generator=gen) < 0.5
    cache = DynamicCache(config=adapter.text_config)
    n = context.shape[1]
    model.model.encoder(input_ids=context, attention_mask=torch.ones(b, n, dtype=torch.long), past_key_values=cache,
                        position_ids=torch.arange(n).unsqueeze(0))
    kwargs = {"decoder_input_ids": canvas, "past_key_values": cache,
              "decoder_position_ids": torch.arange(n, n + c).unsqueeze(0),
              "decoder_attention_mask": torch.ones(b, n + c, dtype=torch.bool)}
    with torch.no_grad():
        first = model(**kwargs).logits
    logits = model(**kwargs, self_conditioning_logits=first, self_conditioning_mask=sc_rows).logits  # [b, C, V]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), clean.reshape(-1))
