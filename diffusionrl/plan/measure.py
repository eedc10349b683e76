"""Measure, on the CPU, what one training forward of a family's transformer keeps for backward.

A *probe* is the real transformer class at its real widths (dtype, LoRA) with two blocks of each
kind (SD3: dual-attention and plain blocks, then the last ``context_pre_only`` one; FLUX: double-
and single-stream blocks; Qwen-Image, Wan: one kind), run through the family adapter's own
``velocity`` (guidance 1: one forward) at batches 2 and 4 (batch 1 takes other paths in a few
ops) and three small token counts. Every tensor autograd saves
(``torch.autograd.graph.saved_tensors_hooks``) is counted once by its storage while autograd holds
it (a graph branch freed during the forward gives its bytes back), parameters and buffers
excluded, and attributed to the block running when it was saved: to that block, to ``shared``
when several blocks save it (rotary tables, the time embedding), or to ``rest`` (embeddings, final
norm and projection). Each part is fitted as ``batch * (c0 + ci * image_tokens + ct * text_tokens)
+ (d0 + di * image_tokens + dt * text_tokens)``; a block list's first block apart from the later
ones. Attention is SDPA: CPU flash keeps q, k, v, out and the log-sum-exp, as CUDA's flash kernel
does, so nothing grows with the square of the tokens. The full model is ``rest + shared +
sum(first + (count - 1) * later)`` over block kinds (``predict_saved``).

For gradient checkpointing a block keeps only its inputs: the bytes of each block's tensor inputs
(``inputs``; those several blocks receive once, ``shared_inputs``) are recorded the same way.

``python -m diffusionrl.plan.refresh`` rewrites ``measured.json`` (every preset's model and
Qwen-Image; about 10 minutes on 2 shared cores); ``tests/test_plan.py`` re-measures the tiny entries.
"""

from __future__ import annotations

import json
import weakref
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .archs import FAMILIES, FamilySpec

CACHE = Path(__file__).with_name("measured.json")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
AMP = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}
# (latent side, text tokens) of the probe forwards: two image sizes, two text lengths
POINTS = ((8, 8), (16, 8), (8, 24))
CACHED_ROPE = {"qwen-image"}  # families whose rotary tables are cached across forwards
BATCHES = (2, 4)  # batch 1 takes other paths in some ops (views instead of copies): fit on 2 and 4


# -- block kinds -------------------------------------------------------------------------------
def block_kinds(family: str, config: dict) -> list[list[str]]:
    """The kind of every block of every block list of a model with ``config``."""
    spec = FAMILIES[family]
    counts = spec.layers(config)
    if family == "sd3":
        n, dual = counts[0], set(config.get("dual_attention_layers", ()) or ())
        return [["last" if i == n - 1 else ("dual" if i in dual else "plain") for i in range(n)]]
    if family == "flux":
        return [["double"] * counts[0], ["single"] * counts[1]]
    return [["block"] * counts[0]]


def kind_counts(family: str, config: dict) -> dict[str, int]:
    return dict(Counter(k for kinds in block_kinds(family, config) for k in kinds))


def probe_config(family: str, config: dict) -> dict:
    """``config`` with two blocks of each kind it has (SD3: dual ones first, one last block last):
    two, so that what every block saves (rotary tables, the time embedding) shows as shared."""
    spec = FAMILIES[family]
    if family == "sd3":
        have = kind_counts(family, config)
        kinds = [k for k in ("dual", "plain") if k in have for _ in range(min(2, have[k]))] + ["last"]
        cfg = spec.with_layers((len(kinds),), base=config)
        cfg["dual_attention_layers"] = tuple(i for i, k in enumerate(kinds) if k == "dual")
        return cfg
    return spec.with_layers(tuple(min(2, n) for n in spec.layers(config)), base=config)


def lora_suffixes(family: str, configured) -> list[str]:
    """The LoRA target suffixes a config's ``model.lora_targets`` means for ``family`` (its adapter's
    ``default_lora_targets`` where it lists none)."""
    from diffusionrl.models.families import adapter_for_family

    return adapter_for_family(family).lora_suffixes(configured)


# -- the adapter's forward on a bare transformer --------------------------------------------------
def stub_adapter(family: str, transformer: torch.nn.Module, amp: str, device: str | torch.device = "cpu"):
    """The family's adapter around ``transformer`` alone: its ``velocity`` is the one training runs."""
    from diffusionrl.models.families import adapter_for_family

    cls = adapter_for_family(family)
    adapter = cls.__new__(cls)
    adapter.pipe = SimpleNamespace(transformer=transformer)
    adapter.device = torch.device(device)
    adapter.autocast_dtype = AMP[amp]
    return adapter


def forward_inputs(family: str, config: dict, batch: int, side: int, text: int, device="cpu", dtype=torch.float32,
                   masked: bool = False):
    """(latents, timestep, Conditioning) of ``batch`` samples with a ``side`` x ``side`` latent and
    ``text`` prompt tokens, as the family's adapter receives them."""
    from diffusionrl.trajectory import Conditioning

    g = torch.Generator().manual_seed(0) if str(device) == "cpu" else None

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=g, dtype=dt) if g is not None else torch.empty(*shape, dtype=dt,
                                                                                            device=device)

    channels = config["in_channels"] // (4 if family in ("flux", "qwen-image") else 1)
    shape = (batch, channels, 1, side, side) if family == "wan" else (batch, channels, side, side)
    width = config.get("joint_attention_dim") or config.get("text_dim")
    pooled = config.get("pooled_projection_dim", 0) if family in ("sd3", "flux") else 0
    mask = torch.ones(batch, text, dtype=torch.long, device=device) if family == "qwen-image" and masked else None
    cond = Conditioning(randn(batch, text, width, dt=dtype), randn(batch, pooled, dt=dtype), prompt_embeds_mask=mask)
    return randn(*shape, dt=torch.float32), torch.tensor(500.0, device=device), cond


# -- saved-tensor accounting ----------------------------------------------------------------------
def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _Held:
    """What the pack hook hands autograd: the saved tensor, and a finaliser when autograd drops it."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor):
        self.t = t


def _unpack(held):
    return held.t if isinstance(held, _Held) else held


def saved_by_block(model: torch.nn.Module, blocks: list[torch.nn.Module], run) -> dict:
    """Run ``run()`` and count the bytes autograd saves, each storage once, parameters and buffers
    excluded: per block index (the innermost block running when it was saved), ``shared`` (saved
    by two or more blocks) and ``rest`` (outside every block); and the tensor inputs of each block
    (``inputs``: those no other block receives; ``shared_inputs``: the others, once)."""
    skip = {_key(t) for t in list(model.parameters()) + list(model.buffers())}
    size: dict[int, int] = {}
    owners: dict[int, set] = {}
    holders: Counter = Counter()  # live packed references per storage: a graph branch freed in the
    stack: list[int] = []  # forward (an output nobody uses) releases what it saved, and its memory
    inputs: list[dict[int, int]] = [{} for _ in blocks]  # may then hold another tensor

    alive: dict[int, object] = {}  # key -> StorageWeakRef of the storage now at that address
    # Block inputs are keyed by address too: they are kept alive until the end of the run, so no freed
    # input's address is reused by a later block's input and counted as one tensor received twice.
    kept: list[torch.Tensor] = []

    def release(key: int, ref) -> None:
        if alive.get(key) is not ref:  # a late finaliser (garbage collection) of an earlier storage
            return
        holders[key] -= 1
        if holders[key] == 0:
            del holders[key], size[key], owners[key], alive[key]

    def pack(t):
        from torch.multiprocessing.reductions import StorageWeakRef

        key = _key(t)
        if not key or key in skip:
            return t
        if key in alive and alive[key].expired():  # the address was freed and reused: a new storage
            del holders[key], size[key], owners[key], alive[key]
        ref = alive.setdefault(key, StorageWeakRef(t.untyped_storage()))
        size[key] = t.untyped_storage().nbytes()
        owners.setdefault(key, set()).add(stack[-1] if stack else "rest")
        holders[key] += 1
        held = _Held(t)
        weakref.finalize(held, release, key, ref)
        return held

    def pre(i):
        def hook(_module, args, kwargs):
            stack.append(i)
            for v in list(args) + list(kwargs.values()):
                for t in (v if isinstance(v, tuple | list) else (v,)):
                    if isinstance(t, torch.Tensor):
                        inputs[i][_key(t)] = t.untyped_storage().nbytes()
                        kept.append(t)
        return hook

    def post(*_):
        stack.pop()

    handles = []
    for i, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(block.register_forward_hook(post))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            out = run()
    finally:
        for h in handles:
            h.remove()
    per: dict = Counter()
    for key, who in owners.items():
        per[next(iter(who)) if len(who) == 1 else "shared"] += size[key]
    received = Counter(k for d in inputs for k in d)
    all_inputs = {k: b for d in inputs for k, b in d.items()}
    return {"blocks": [per[i] for i in range(len(blocks))], "rest": per["rest"], "shared": per["shared"],
            "total": sum(per.values()),
            "inputs": [sum(b for k, b in d.items() if received[k] == 1) for d in inputs],
            "shared_inputs": sum(b for k, b in all_inputs.items() if received[k] > 1), "out": out}


class LivePeak(TorchDispatchMode):
    """Inside: the peak bytes of the CPU storages created inside that are still alive (each checked
    through a ``StorageWeakRef`` after every op): what a training unit's forward and backward hold at
    most beyond the weights, the CPU's counterpart of ``torch.cuda.max_memory_allocated``. Slow (it
    scans every live storage after each op): tiny and mid-size models only."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple] = {}
        self.peak = 0

    @property
    def current(self) -> int:
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}  # before: freed addresses recur
        given = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()  # a view of an input's storage is not new memory
                if storage.data_ptr() and storage.data_ptr() not in self.refs and storage.data_ptr() not in given:
                    self.refs[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.current)
        return out


def lora_wrap(transformer: torch.nn.Module, family: str, rank: int, targets: list[str], seed: int = 0):
    """peft LoRA as ``LoraPolicy`` puts it (fp32 adapters on the frozen base); returns the peft model."""
    from peft import LoraConfig, get_peft_model

    adapter = stub_adapter(family, transformer, "no")
    names = adapter.lora_targets(list(targets))
    torch.manual_seed(seed)
    model = get_peft_model(transformer, LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights="gaussian",
                                                   target_modules=names, lora_dropout=0.0))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model.eval()


def blocks_of(transformer: torch.nn.Module, spec: FamilySpec) -> list[torch.nn.Module]:
    return [b for name in spec.blocks for b in getattr(transformer, name)]


def trained_model(transformer: torch.nn.Module, family: str, rank: int, targets: list[str] | None, seed: int = 0):
    """What trains: ``lora_wrap``'s LoRA on ``targets``, or with ``targets=None`` every weight of the transformer
    (a full fine-tune, ``training.full.FullPolicy``)."""
    if targets is None:
        return transformer.requires_grad_(True).eval()
    return lora_wrap(transformer, family, rank, targets, seed)


def measure_saved(family: str, config: dict, weights_dtype: str, amp: str, lora_rank: int,
                  lora_targets: list[str] | None, points=POINTS, batches=BATCHES) -> dict:
    """Fit the bytes one forward saves, per block kind, shared between blocks, and outside them, as
    ``batch * (c0 + ci * image_tokens + ct * text_tokens) + (d0 + di * image_tokens + dt * text_tokens)``
    (coefficients ``[c0, ci, ct, d0, di, dt]``): the probe's forwards at ``batches`` x ``points``, with a LoRA on
    ``lora_targets`` or, with ``lora_targets=None``, every weight trained (a full fine-tune also saves the
    input of every other linear layer for its weight gradient)."""
    spec = FAMILIES[family]
    pcfg = probe_config(family, config)
    torch.manual_seed(0)
    transformer = spec.build(pcfg, "cpu", DTYPES[weights_dtype])
    model = trained_model(transformer, family, lora_rank, lora_targets)
    adapter = stub_adapter(family, model, amp)
    kinds = [k for ks in block_kinds(family, pcfg) for k in ks]
    blocks = blocks_of(transformer, spec)
    rows, ys = [], {}
    for batch in batches:
        for side, text in points:
            n_img, n_txt = _tokens_of_probe(family, pcfg, side, text)
            x, t, cond = forward_inputs(family, pcfg, batch, side, text, dtype=DTYPES[weights_dtype])
            got = saved_by_block(model, blocks, lambda x=x, t=t, cond=cond: adapter.velocity(model, x, t, cond, 1.0))
            del got["out"]
            rows.append([batch, batch * n_img, batch * n_txt, 1.0, n_img, n_txt])
            for name, value in _components(got, kinds).items():
                ys.setdefault(name, []).append(value)
    a = np.array(rows, dtype=float)
    coef = {name: [float(c) for c in np.linalg.lstsq(a, np.array(v, dtype=float), rcond=None)[0]]
            for name, v in ys.items()}
    full = lora_targets is None
    return {"family": family, "weights_dtype": weights_dtype, "amp": amp, "finetune": "full" if full else "lora",
            "lora_rank": 0 if full else lora_rank, "lora_targets": [] if full else list(lora_targets),
            "probe_layers": list(spec.layers(pcfg)), "coef": coef}


def _components(got: dict, kinds: list[str]) -> dict[str, float]:
    """Per block kind the first block's bytes (``<kind>.first``: the first block of a list saves
    what the embedder handed it) and the last one's (every later block)."""
    out = {"rest": got["rest"], "shared": got["shared"], "shared_inputs": got["shared_inputs"]}
    for kind, saved, inp in zip(kinds, got["blocks"], got["inputs"]):
        out.setdefault(f"{kind}.first", saved)
        out[kind] = saved
        out[f"{kind}.inputs"] = inp
    return out


def _tokens_of_probe(family: str, config: dict, side: int, text: int) -> tuple[int, int]:
    from .archs import tokens

    n_img, _ = tokens(family, config, side * 8, 1, text)
    return n_img, text  # the probe's embeddings are ``text`` tokens long (SD3's CLIP part included)


def predict_saved(entry: dict, config: dict, batch: int, n_img: int, n_txt: int, checkpointing: bool = False,
                  again: bool = False) -> dict:
    """Bytes one forward of ``batch`` samples at (``n_img``, ``n_txt``) tokens keeps for backward,
    from a measured ``entry`` and the full ``config``: ``total`` (held until backward) and
    ``block_peak`` (the largest block's own, recomputed in backward when checkpointing). ``again``:
    a second forward of the same unit (a CFG pass) in a family that caches its rotary tables
    (Qwen-Image's ``lru_cache``): its batch-independent part is the first forward's."""
    coef = entry["coef"]
    fixed = 0.0 if again and entry["family"] in CACHED_ROPE else 1.0

    def at(name: str) -> float:
        c0, ci, ct, d0, di, dt = coef[name]
        return max(0.0, batch * (c0 + ci * n_img + ct * n_txt) + fixed * (d0 + di * n_img + dt * n_txt))

    counts = kind_counts(entry["family"], config)
    full = {k: at(f"{k}.first") + (n - 1) * at(k) for k, n in counts.items()}
    peak = max(max(at(k), at(f"{k}.first")) for k in counts) if counts else 0.0
    if checkpointing:
        total = at("rest") + at("shared_inputs") + sum(n * at(f"{k}.inputs") for k, n in counts.items())
    else:
        total = at("rest") + at("shared") + sum(full.values())
    return {"total": total, "block_peak": peak, "blocks": full}


# -- the cache -----------------------------------------------------------------------------------
def cache_key(reference: str, weights_dtype: str, amp: str, finetune: str = "lora") -> str:
    return f"{reference}|{weights_dtype}|{amp}" + ("|full" if finetune == "full" else "")


def load_cache(path: Path = CACHE) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"saved": {}, "flops": {}}
