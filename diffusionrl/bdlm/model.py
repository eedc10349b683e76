"""Discrete diffusion policies behind one adapter call: ``logits(canvas) -> [B, L, V]``.

The sampler, the replay scorer, the warm start and the GRPO objective only ever call
``adapter.logits(canvas)`` on a canvas of token ids (MASK where a position is still hidden), so a
new model family is one new adapter class:

- ``TinyBDLMAdapter``: ``builtin:tiny-bdlm``, a small bidirectional transformer built in code
  (pre-norm blocks, plain-op attention, no dropout, so training and sampling see the same
  function and the replay is bit-exact).
- ``HFMaskedLMAdapter``: any ``transformers`` masked LM (BERT / ModernBERT style) loaded from a
  local folder; a token map sends our ids to the model's ids and its logits back to ours.

Models are saved as a folder: ``bdlm_model.json`` (kind, dimensions, vocabulary) plus
``model.safetensors`` (tiny) or the Hugging Face files; ``load_bdlm(name_or_dir)`` reads either.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import save_file
from torch import nn

MODEL_FILE = "bdlm_model.json"
RUN_INFO = "bdlm_run.json"  # which stage wrote a model folder, from what, with which digests


@dataclass(frozen=True)
class Vocab:
    """Digits 0-9 are ids 0-9, then the four special tokens."""

    sep: int = 10
    eos: int = 11
    pad: int = 12
    mask: int = 13
    size: int = 14

    def encode(self, text: str) -> list[int]:
        """``"12|3"`` -> [1, 2, SEP, 3] (``|`` is the separator)."""
        return [self.sep if ch == "|" else int(ch) for ch in text]

    def decode(self, ids) -> str:
        names = {self.sep: "|", self.eos: "$", self.pad: ".", self.mask: "_"}
        return "".join(names.get(int(i), str(int(i))) for i in ids)


VOCAB = Vocab()


class BDLMAdapter(Protocol):
    """What a model family provides to the sampler, the replay scorer and the trainers."""

    vocab: Vocab
    module: nn.Module  # the trainable network (parameters, train/eval, state_dict)

    def logits(self, canvas: torch.Tensor) -> torch.Tensor: ...  # [B, L] int64 -> [B, L, V] float

    def save(self, directory: str | Path) -> Path: ...


# -- builtin:tiny-bdlm ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = VOCAB.size
    dim: int = 96
    layers: int = 3
    heads: int = 4
    ff_dim: int = 256
    max_length: int = 32


class Block(nn.Module):
    """Pre-norm bidirectional self-attention + GELU MLP; attention written in plain ops so the
    same kernels run with and without autograd (SDPA may pick another kernel per mode)."""

    def __init__(self, spec: TinySpec):
        super().__init__()
        self.heads = spec.heads
        self.ln1 = nn.LayerNorm(spec.dim)
        self.qkv = nn.Linear(spec.dim, 3 * spec.dim)
        self.proj = nn.Linear(spec.dim, spec.dim)
        self.ln2 = nn.LayerNorm(spec.dim)
        self.fc1 = nn.Linear(spec.dim, spec.ff_dim)
        self.fc2 = nn.Linear(spec.ff_dim, spec.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        # q, k, v: [B, H, L, Dh] each
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), dim=-1)  # [B, H, L, L]
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, d))  # [B, L, D]
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class TinyBDLM(nn.Module):
    def __init__(self, spec: TinySpec):
        super().__init__()
        self.spec = spec
        self.tok = nn.Embedding(spec.vocab_size, spec.dim)
        self.pos = nn.Embedding(spec.max_length, spec.dim)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(spec.dim)
        self.head = nn.Linear(spec.dim, spec.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.spec.max_length:
            raise ValueError(f"canvas of {ids.shape[1]} tokens exceeds the model's max_length {self.spec.max_length}")
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))  # [B, L, D]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # [B, L, V]


class TinyBDLMAdapter:
    kind = "tiny-bdlm"

    def __init__(self, module: TinyBDLM, vocab: Vocab = VOCAB):
        self.module = module.eval()  # no dropout anywhere: eval mode is the only mode
        self.vocab = vocab

    def logits(self, canvas: torch.Tensor) -> torch.Tensor:
        return self.module(canvas)  # [B, L, V]

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.module.state_dict().items()},
                  str(directory / "model.safetensors"))
        info = {"kind": self.kind, "spec": asdict(self.module.spec), "vocab": asdict(self.vocab)}
        (directory / MODEL_FILE).write_text(json.dumps(info, indent=1))
        return directory


def build_tiny_bdlm(model_cfg) -> TinyBDLMAdapter:
    """Fresh random ``builtin:tiny-bdlm`` from a ``BDLMModelConfig`` (seeded by ``init_seed``)."""
    spec = TinySpec(VOCAB.size, model_cfg.dim, model_cfg.layers, model_cfg.heads, model_cfg.ff_dim,
                    model_cfg.max_length)
    torch.manual_seed(model_cfg.init_seed)
    return TinyBDLMAdapter(TinyBDLM(spec))


# -- Hugging Face masked LMs ---------------------------------------------------------------------


class HFMaskedLMAdapter:
    """A ``transformers`` masked LM; ``token_ids[i]`` is the model's id for our token ``i``.

    ``logits`` maps the canvas to the model's ids, runs it with a full attention mask (every row
    is one sequence; padding is a token like any other, as in the sampler) and keeps the logits
    of our ``V`` tokens, so the policy is a distribution over our vocabulary.
    """

    kind = "hf-masked-lm"

    def __init__(self, model, token_ids: list[int], vocab: Vocab = VOCAB):
        if len(token_ids) != vocab.size:
            raise ValueError(
                f"token map has {len(token_ids)} ids; it needs one per token of our vocabulary ({vocab.size})"
            )
        self.module = model.eval()
        self.vocab = vocab
        self.token_ids = torch.tensor(token_ids, dtype=torch.int64)

    def logits(self, canvas: torch.Tensor) -> torch.Tensor:
        ids = self.token_ids.to(canvas.device)[canvas]  # [B, L] model ids
        out = self.module(input_ids=ids, attention_mask=torch.ones_like(ids)).logits  # [B, L, V_hf]
        return out[..., self.token_ids.to(out.device)]  # [B, L, V]

    def save(self, directory: str | Path) -> Path:
        directory = Path(directory)
        self.module.save_pretrained(str(directory))
        info = {"kind": self.kind, "token_ids": self.token_ids.tolist(), "vocab": asdict(self.vocab)}
        (directory / MODEL_FILE).write_text(json.dumps(info, indent=1))
        return directory


# -- loading, copies, digests --------------------------------------------------------------------


def frozen_copy(adapter: BDLMAdapter) -> BDLMAdapter:
    """An independent, gradient-free copy (the reference model, or the old-policy snapshot)."""
    twin = copy.deepcopy(adapter)
    twin.module.eval().requires_grad_(False)
    return twin


def weights_digest(adapter: BDLMAdapter) -> str:
    """sha256 of the weights (names, shapes and bytes), 16 hex chars: the run's identity."""
    h = hashlib.sha256()
    for name, value in sorted(adapter.module.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(value.shape)).encode())
        h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
