"""The model card (``README.md``) of a LoRA folder, and the registered version's description.

``render_card(info, results)`` is pure: ``info`` is what the trainer records beside the adapter
(``diffusionrl.json``: ``base_model``, ``base_model_revision``, ``base_model_digest``, ``step``,
``algorithm``, ``config_digest``, ``family``, ``pipeline_class``, ``max_sequence_length`` (the run's
``model.max_sequence_length``), ``registered_model``, an RL run's ``reward`` or an SFT run's ``sft_source``,
where they apply ``ema_decay`` and ``world_size``, and for a LoRA of Wan2.2's two experts ``lora_experts``:
``high`` and/or ``low``), ``results`` the held-out evaluation's summary (``evaluation.evaluate_lora``:
``eval/reward_mean``, ``eval/base_reward_mean``, ...) or ``None`` when the folder is written before it is
evaluated. Nothing in a card depends on the time or on where the folder lies, so a resumed run writes the same
card as an uninterrupted one.

Two layouts: ``peft`` (a run's ``lora/``: ``adapter_model.safetensors`` + ``adapter_config.json``)
and ``diffusers`` (the registered model's adapter, ``lora_export.diffusers_adapter_dir``:
``pytorch_lora_weights.safetensors`` + ``peft/``; a two-expert LoRA: one file per expert,
``lora_export.EXPERT_FILES``); each card gives the loading call of its layout, then one sampling call with the
prompt encoded at the run's ``max_sequence_length`` where the pipeline's ``__call__`` takes one (its default,
512 tokens for FLUX.1, 256 for SD3, gives other images than the run trained and evaluated with).
``write_card`` also sets ``adapter_config.json``'s ``base_model_name_or_path`` to the model id (peft
records the folder the weights were loaded from, a temporary one in the workflow).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from diffusionrl.config import ALGORITHMS, objective

PEFT, DIFFUSERS = "peft", "diffusers"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_PLACEHOLDER = "path/to/this/folder"
_INPUT = "input.png"  # an editing model's input image in the served snippet


def _what(algorithm: str, unknown: str) -> str:
    """What objective ``algorithm`` is (``config.objectives``), or ``unknown`` for a name it does not know."""
    return objective(algorithm).title if algorithm in ALGORITHMS else unknown


def is_hub_id(reference: str) -> bool:
    return bool(_HUB_ID.match(reference)) and not reference.startswith((".", "/"))


def _card_base_model(reference: str) -> str | None:
    """The front matter's ``base_model``: a hub id or a builtin name (a local folder is no id)."""
    return reference if reference.startswith("builtin:") or is_hub_id(reference) else None


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def result_rows(results: dict) -> list[tuple[str, float, float]]:
    """(metric, tuned, base) for every ``eval/<m>`` with an ``eval/base_<m>`` beside it, sorted."""
    rows = []
    for key in sorted(results):
        if key.startswith("eval/") and not key.startswith("eval/base_") and f"eval/base_{key[5:]}" in results:
            rows.append((key[5:], results[key], results[f"eval/base_{key[5:]}"]))
    return rows


def _reward_text(info: dict) -> str:
    if "reward" in info:  # an RL run's weights; an SFT run records its pairs instead
        return ", ".join(f"`{name}` {_fmt(float(w))}" for name, w in sorted(info["reward"].items()))
    return f"none (supervised on `{info['sft_source']}`)"


def _snippet(info: dict, imports: list[str], body: list[str]) -> list[str]:
    """A Python block: the base pipeline (plain diffusers for a hub id or folder, diffusionrl's
    loader for a built-in model), then ``body``."""
    base, revision, pipeline = info["base_model"], info["base_model_revision"], info["pipeline_class"]
    if base.startswith("builtin:"):
        head = ["from diffusionrl.models.families import load_pipeline"]
        load = f"pipe = load_pipeline({json.dumps(base)})  # a diffusionrl built-in model"
    else:
        head = [f"from diffusers import {pipeline}"]
        rev = f", revision={json.dumps(revision)}" if revision else ""
        load = f"pipe = {pipeline}.from_pretrained({json.dumps(base)}{rev})"
    return ["```python", *sorted(head + imports), "", load, *body, "```"]


def editing_family(family: str) -> bool:
    """Whether ``family`` (a ``diffusionrl.json`` ``family``) edits an input image (FLUX.1 Kontext, Qwen-Image-Edit);
    a name that is no model family is ``UnknownModelFamily`` (one line naming the families)."""
    from diffusionrl.models.families import adapter_for_family

    return adapter_for_family(family).editing


@functools.lru_cache(maxsize=32)
def pipeline_seq_len(pipeline_class: str) -> int | None:
    """The default ``max_sequence_length`` of the diffusers pipeline ``pipeline_class``'s ``__call__``, or None
    where the call takes no such argument (or diffusers has no such class)."""
    import inspect

    import diffusers

    cls = getattr(diffusers, pipeline_class, None) if pipeline_class else None
    if cls is None or not any("__call__" in vars(k) for k in cls.__mro__):
        return None
    parameter = inspect.signature(cls.__call__).parameters.get("max_sequence_length")
    return None if parameter is None else parameter.default


def _sampling(info: dict) -> list[str]:
    """One sampling call with the loaded ``pipe``: the prompt encoded at the run's ``max_sequence_length`` where
    the pipeline's ``__call__`` takes one (the run encoded every prompt at it in training and evaluation)."""
    family = info["family"]
    editing = editing_family(family)
    seq, default = info["max_sequence_length"], pipeline_seq_len(info["pipeline_class"])
    args = [json.dumps("make the square blue" if editing else "a photo of a cat")]
    if editing:
        args.append(f"image=load_image({json.dumps(_INPUT)})")
    if default is not None:  # a pipeline class whose __call__ takes no max_sequence_length gets none
        args.append(f"max_sequence_length={int(seq)}")
        text = (f"Then sample with `pipe` (either way), `max_sequence_length` at the run's {int(seq)} "
                f"(`model.max_sequence_length`, which it trained and evaluated with, not the pipeline's default, "
                f"{default})")
    else:
        text = "Then sample with `pipe` (either way)"
    text += ("; the steps, guidance scale and size here are the pipeline's defaults (the run's evaluation used "
             "its config's `eval.num_steps`, `eval.guidance_scale` and `sampling.eval_resolution`):")
    output = "frames = pipe({}).frames[0]" if family == "wan" else "image = pipe({}).images[0]"
    return [text, "", "```python", *(["from diffusers.utils import load_image", ""] if editing else []),
            output.format(", ".join(args)), "```"]


# Editing pipelines that encode the input image at a fixed area whatever the output's: how each does it
_FIXED_INPUT_AREA = {
    "QwenImageEditPlusPipeline": "VAE-encodes the input image at 1024x1024 pixels of area (its module's "
                                 "`VAE_IMAGE_SIZE`)",
    "QwenImageEditPipeline": "resizes the input image to 1024x1024 pixels of area (`calculate_dimensions(1024 * "
                             "1024, ...)` in its call) for both its text encoder and its VAE,",
}


def _served(info: dict) -> list[str]:
    """The registered MLflow model's snippet: a prompt (and an editing model's input image) -> PNG or GIF bytes."""
    name = info["registered_model"]
    output = "GIF" if info["family"] == "wan" else "PNG"
    load = f'model = mlflow.pyfunc.load_model("models:/{name}@champion")  # or models:/{name}/<version>'
    if not editing_family(info["family"]):
        return [f"As the registered MLflow model (base weights and adapter together; it returns {output} bytes):", "",
                "```python", "import mlflow", "import pandas as pd", "", load,
                'images = model.predict(pd.DataFrame({"prompt": ["a photo of a cat"]}))', "```"]
    lines = ["As the registered MLflow model (base weights and adapter together): an instruction and the image it "
             "edits (encoded bytes; base64 in a JSON request), one image per prompt or one for all; it returns PNG "
             "bytes at the run's evaluation resolution, the input image encoded at that area as in training:", "",
             "```python", "from pathlib import Path", "", "import mlflow", "import pandas as pd", "", load,
             f"image = Path({json.dumps(_INPUT)}).read_bytes()  # the image to edit (PNG, JPEG, ...)",
             'edits = model.predict(pd.DataFrame({"prompt": ["make the square blue"], "image": [image]}))', "```"]
    fixed = _FIXED_INPUT_AREA.get(info["pipeline_class"])
    if fixed:
        lines += ["", f"The stock `{info['pipeline_class']}` {fixed} whatever the output size; this LoRA was trained "
                      "with it at the output's area, which the registered model serves (diffusionrl's "
                      "`serving/request_pipelines.area_bound_call`)."]
    return lines


def _expert_loads(folder: str, experts: list[str]) -> list[str]:
    """``load_lora_weights`` of each expert's file of a two-expert LoRA (``lora_export.EXPERT_FILES``)."""
    from .lora_export import EXPERT_FILES

    return [f"pipe.load_lora_weights({folder}, weight_name={json.dumps(EXPERT_FILES[e][1])}"
            + (", load_into_transformer_2=True)" if EXPERT_FILES[e][0] == "transformer_2" else ")") for e in experts]


def _peft_experts(folder: str) -> list[str]:
    """peft's load of a two-expert LoRA: on diffusionrl's ``WanExperts`` over the pipeline's two transformers
    (peft puts its layers into them, so the pipeline samples with the LoRA)."""
    return ["experts = WanExperts(pipe.transformer, pipe.transformer_2,",
            "                     pipe.config.boundary_ratio * pipe.scheduler.config.num_train_timesteps)",
            f"PeftModel.from_pretrained(experts, {folder})  # the LoRA layers go into both transformers"]


def _loading(info: dict, layout: str) -> list[str]:
    pipeline = json.dumps(info["pipeline_class"])
    here = json.dumps(_PLACEHOLDER)
    experts = info.get("lora_experts") or []
    lines = ["## How to load it", ""]
    if experts:  # Wan2.2's two experts: a file per expert, or peft on WanExperts
        peft_dir = here if layout == PEFT else json.dumps(_PLACEHOLDER + "/peft")
        where = "(this folder is peft's format)" if layout == PEFT else "from the copy under `peft/`"
        peft = [f"With peft {where}, on diffusionrl's `WanExperts` (the two experts as one module):",
                "", *_snippet(info, ["from diffusionrl.models.wan import WanExperts", "from peft import PeftModel"],
                              _peft_experts(peft_dir))]
        from .lora_export import EXPERT_FILES

        files = ", ".join(f"`{EXPERT_FILES[e][1]}` for `{EXPERT_FILES[e][0]}`" for e in experts)
        if layout == DIFFUSERS:
            lines += [f"With diffusers ({files}; each carries the rank and alpha):", "",
                      *_snippet(info, [], _expert_loads(here, experts)), "", *peft]
        else:
            lines += [*peft, "", f"With diffusers' `load_lora_weights`, after writing a file per expert ({files}):",
                      "", *_snippet(info, ["from diffusionrl.serving import diffusers_adapter_dir"],
                                    [f'folder = diffusers_adapter_dir({here}, "lora-diffusers", {pipeline})',
                                     *_expert_loads("str(folder)", experts)])]
    elif layout == DIFFUSERS:
        lines += ["With diffusers (`pytorch_lora_weights.safetensors` here carries the rank and alpha):", "",
                  *_snippet(info, [], [f"pipe.load_lora_weights({here})"]), "",
                  "With peft, from the copy under `peft/`:", "",
                  *_snippet(info, ["from peft import PeftModel"],
                            [f"pipe.transformer = PeftModel.from_pretrained(pipe.transformer, "
                             f"{json.dumps(_PLACEHOLDER + '/peft')})"])]
    else:
        lines += ["With peft (this folder is peft's format):", "",
                  *_snippet(info, ["from peft import PeftModel"],
                            [f"pipe.transformer = PeftModel.from_pretrained(pipe.transformer, {here})"]), "",
                  "With diffusers' `load_lora_weights`, after writing the adapter in its key layout (with rank and "
                  "alpha; `load_lora_weights` on this folder itself finds no keys it knows and loads nothing):", "",
                  *_snippet(info, ["from diffusionrl.serving import diffusers_adapter_dir"],
                            [f'folder = diffusers_adapter_dir({here}, "lora-diffusers", {pipeline})',
                             "pipe.load_lora_weights(str(folder))"])]
    return lines + [""] + _sampling(info) + [""] + _served(info)


def render_card(info: dict, results: dict | None = None, layout: str = PEFT) -> str:
    """The README.md of a LoRA folder: front matter, what it is, held-out results, how to load it."""
    if layout not in (PEFT, DIFFUSERS):
        raise ValueError(f"layout {layout!r}: {PEFT} or {DIFFUSERS}")
    base = info["base_model"]
    algorithm, family = info["algorithm"], info["family"]
    tags = ["lora", "diffusionrl", algorithm, family]
    front = ["---"]
    card_base = _card_base_model(base)
    if card_base:
        front.append(f"base_model: {json.dumps(card_base)}")
    tag = "text-to-video" if family == "wan" else "image-to-image" if editing_family(family) else "text-to-image"
    front += [f"library_name: {layout}", f"pipeline_tag: {tag}",
              "tags:", *(f"- {json.dumps(t)}" for t in tags), "---", ""]
    revision = info["base_model_revision"]
    what = [
        f"# LoRA for {base}, trained with {_what(algorithm, algorithm)}", "",
        f"A LoRA adapter for the transformer of `{base}`, written by diffusionrl "
        f"({'peft format' if layout == PEFT else 'diffusers format, with the peft copy under peft/'}).", "",
        "## What it is", "",
        f"- Base model: `{base}`" + (f" at revision `{revision}`" if revision else " (default revision)"),
        f"- Base weights digest (SHA-256 of the loaded weights' tensors, every component; not the file digest "
        f"a registered version's `base_model_digest` tag holds): `{info['base_model_digest']}`",
        f"- Family: {family} (`{info['pipeline_class']}`)",
        f"- Objective: `{algorithm}`, {_what(algorithm, 'see docs/algorithms.md')}",
        f"- Reward weights: {_reward_text(info)}",
        f"- Training steps: {info['step']}",
        f"- Config digest: `{info['config_digest']}` (the run folder's `config.json`)",
    ]
    if "ema_decay" in info:
        what.append(f"- Weights: the exponential moving average of the LoRA (decay {_fmt(info['ema_decay'])})")
    if info.get("world_size"):
        what.append(f"- Trainer ranks: {info['world_size']}")
    if info.get("lora_experts"):
        names = {"high": "`transformer` (high-noise steps)", "low": "`transformer_2` (low-noise steps)"}
        what.append("- Experts with the LoRA: " + ", ".join(names.get(e, e) for e in info["lora_experts"]))
    held = ["", "## Held-out results", ""]
    if results and result_rows(results):
        held += ["Held-out prompts, the same seeds for the tuned and the base model:", "",
                 "| metric | this LoRA | base model |", "| --- | --- | --- |",
                 *(f"| {m} | {_fmt(t)} | {_fmt(b)} |" for m, t, b in result_rows(results))]
        extra = [f"{label} {_fmt(results[k])}" for k, label in (("eval/reward_gain", "reward gain"),
                 ("eval/win_rate", "win rate"), ("eval/num_prompts", "prompts"),
                 ("eval/seeds_per_prompt", "seeds per prompt")) if k in results]
        if extra:
            held += ["", "; ".join(extra) + "."]
    else:
        held.append("Not measured when this folder was written. The workflow's `evaluate` task scores the LoRA "
                    "on the held-out prompts against the base model with the same seeds: the run's report "
                    "(`report.html`) and its MLflow run (`eval/reward_mean` vs `eval/base_reward_mean`) have the "
                    "figures, and the registered model version's description repeats them.")
    return "\n".join(front + what + held + [""] + _loading(info, layout)) + "\n"


def version_description(info: dict, results: dict | None, run_id: str) -> str:
    """A registered version's one-paragraph description: base model, objective, reward, steps,
    held-out score against the base model's, run id."""
    base, revision = info["base_model"], info["base_model_revision"]
    kind = "Full fine-tune" if info.get("finetune") == "full" else "LoRA"
    text = (f"{kind} of {base}{'@' + revision if revision else ''} "
            f"(weights {str(info['base_model_digest'])[:16]}), {info['algorithm']}, "
            f"reward {_reward_text(info).replace('`', '')}, {info['step']} steps. ")
    if results and "eval/reward_mean" in results and "eval/base_reward_mean" in results:
        tuned, base_score = results["eval/reward_mean"], results["eval/base_reward_mean"]
        text += f"Held-out reward {_fmt(tuned)} vs base {_fmt(base_score)} ({tuned - base_score:+.4g}"
        if "eval/num_prompts" in results:
            text += f", {int(results['eval/num_prompts'])} prompts"
        text += "). "
    elif results and "eval/reward_mean" in results:
        text += f"Held-out reward {_fmt(results['eval/reward_mean'])} (base not recorded). "
    else:
        text += "Held-out score: not evaluated. "
    return text + f"MLflow run {run_id}."


def adapter_facts(cfg, family: str, pipeline_class: str) -> dict:
    """What a saved adapter's ``diffusionrl.json`` adds for its card: the family, its pipeline class, the
    text length its prompts were encoded at (``model.max_sequence_length``), the reward weights (an RL run's)
    and the registry name."""
    facts = {"family": family, "pipeline_class": pipeline_class, "max_sequence_length": cfg.model.max_sequence_length,
             "registered_model": cfg.tracking.registered_model}
    if objective(cfg.algorithm.name).rewarded:
        facts["reward"] = dict(sorted(cfg.reward.weights.items()))
    return facts


def write_card(folder: str | Path, info: dict, results: dict | None = None, layout: str = PEFT) -> Path:
    """Write ``folder/README.md`` (over peft's empty template) and, in a peft folder, point
    ``adapter_config.json``'s ``base_model_name_or_path`` at the model id (target modules sorted, so
    the file does not depend on set order)."""
    folder = Path(folder)
    config = folder / "adapter_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        data["base_model_name_or_path"] = info["base_model"]
        if isinstance(data.get("target_modules"), list):
            data["target_modules"] = sorted(data["target_modules"])
        config.write_text(json.dumps(data, indent=2, sort_keys=True))
    card = folder / "README.md"
    card.write_text(render_card(info, results, layout))
    return card


def describe_folder(folder: str | Path, info: dict) -> Path:
    """What the trainer writes beside a saved peft adapter: ``diffusionrl.json`` (``info``, with the experts
    a two-expert LoRA's layers sit on, ``lora_experts``) and the card."""
    from .lora_export import lora_experts

    experts = lora_experts(folder) if (Path(folder) / "adapter_model.safetensors").is_file() else []
    info = {**info, "lora_experts": experts} if experts else info
    (Path(folder) / "diffusionrl.json").write_text(json.dumps(info, indent=1))
    return write_card(folder, info)


def render_full_card(info: dict, results: dict | None = None) -> str:
    """The README.md of a full fine-tune's model folder (``training.full.save_transformers``): what it is,
    held-out results where measured, how to load it into the base pipeline."""
    base, algorithm, family = info["base_model"], info["algorithm"], info["family"]
    front = ["---", *([f"base_model: {json.dumps(_card_base_model(base))}"] if _card_base_model(base) else []),
             "library_name: diffusers", "tags:", *(f"- {json.dumps(t)}" for t in
                                                  ("full-fine-tune", "diffusionrl", algorithm, family)), "---", ""]
    components = info.get("components") or ["transformer"]
    what = [f"# {base}, fully fine-tuned with {_what(algorithm, algorithm)}", "",
            f"Every weight of the transformer of `{base}`, trained by diffusionrl: one diffusers model folder per "
            f"transformer ({', '.join(f'`{c}/`' for c in components)}).", "",
            f"- Base weights digest (SHA-256 of the loaded tensors): `{info['base_model_digest']}`",
            f"- Family: {family} (`{info['pipeline_class']}`); objective `{algorithm}`; reward weights "
            f"{_reward_text(info)}; training steps {info['step']}; config digest `{info['config_digest']}`"]
    if "ema_decay" in info:
        decay = _fmt(info["ema_decay"])
        what.append(f"- Weights: the exponential moving average of the trained weights (decay {decay})")
    if info.get("world_size"):
        what.append(f"- Trainer ranks: {info['world_size']}")
    held = ["", "## Held-out results", ""]
    if results and result_rows(results):
        held += ["| metric | this model | base model |", "| --- | --- | --- |",
                 *(f"| {m} | {_fmt(t)} | {_fmt(b)} |" for m, t, b in result_rows(results))]
    else:
        held.append("Not measured when this folder was written: the run's report and MLflow run have the figures.")
    here = json.dumps(_PLACEHOLDER)
    body = [f"pipe.{c} = type(pipe.{c}).from_pretrained({here} + {json.dumps('/' + c)})" for c in components]
    load = ["", "## How to load it", "", *_snippet(info, [], body), "", *_sampling(info)]
    return "\n".join(front + what + held + load) + "\n"
