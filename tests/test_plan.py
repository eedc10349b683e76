"""The planner (diffusionrl/plan) against exact CPU measurements: bytes saved for backward by the
training forward of the tiny models and of mid-size ones (whole models at token counts the fits
never saw), parameter, LoRA and AdamW bytes of the real policy, the shipped cache against a fresh
measurement, the GPU presets against their documented clusters, and the pre-launch check."""

from __future__ import annotations

import math

import pytest
import torch

from diffusionrl.config import get_preset
from diffusionrl.plan import measure as M
from diffusionrl.plan.facts import builtin_facts, lora_params
from diffusionrl.plan.model import GIB, plan

TINY = ["tiny-cpu", "tiny-cpu-flux", "tiny-cpu-qwen-image", "tiny-cpu-wan"]
GPU_PRESETS = ["sd35m-ocr", "sd35m-pickscore-nft", "sd35m-pickscore-nft-full", "flux1-dev-pickscore",
               "wan21-t2v-1.3b-ocr"]


def _policy(cfg):
    from diffusionrl.models import load_adapter
    from diffusionrl.training.policy import LoraPolicy

    adapter = load_adapter(cfg.model, cfg.train.mixed_precision)
    return adapter, LoraPolicy(adapter, cfg.model, seed=0)


@pytest.mark.parametrize("preset", TINY)
def test_saved_bytes_of_the_training_forward(preset):
    """The policy's real training forward (peft LoRA, the adapter's CFG passes, the preset's
    micro-batch and resolution) saves what the planner predicts from its one-block fits, within 5%."""
    cfg = get_preset(preset)
    adapter, policy = _policy(cfg)
    s, mb = cfg.sampling, cfg.train.micro_batch_size
    neg = adapter.needs_negative(s.guidance_scale)
    cond = adapter.encode_prompts(["a red cat on a table"] * mb, s.negative_prompt if neg else None,
                                  cfg.model.max_sequence_length)
    x = torch.randn(mb, *adapter.sample_shape(s.resolution, s.num_frames))
    spec = M.FAMILIES[adapter.family]
    got = M.saved_by_block(policy.model, M.blocks_of(adapter.transformer, spec),
                           lambda: adapter.velocity(policy.model, x, torch.tensor(500.0), cond, s.guidance_scale))
    facts = builtin_facts(cfg.model.name)
    entry = M.load_cache()["saved"][M.cache_key(cfg.model.name, cfg.model.dtype, cfg.train.mixed_precision)]
    n_img = math.prod(x.shape[2:]) // 4  # 2 x 2 patches (SD3, Wan) or packing (FLUX, Qwen-Image)
    texts = [cond.prompt_embeds.shape[1]] + ([cond.negative_prompt_embeds.shape[1]] if neg else [])
    from diffusionrl.plan.model import forward_batches

    batches = forward_batches(adapter.cfg_mode, mb, neg)
    texts = texts[:len(batches)]
    predicted = sum(M.predict_saved(entry, facts["config"], b, n_img, t, again=i > 0)["total"]
                    for i, (b, t) in enumerate(zip(batches, texts)))
    assert predicted == pytest.approx(got["total"], rel=0.05)
    if adapter.family != "qwen-image":  # padded prompts: the plan's token count is the real one
        assert plan(cfg).train["activations (training forward)"] == pytest.approx(got["total"], rel=0.05)


MID = {  # mid-size members of two families: wider and deeper than the tiny ones, a fraction of the real
    "sd3": dict(sample_size=32, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=64,
                num_attention_heads=6, joint_attention_dim=512, caption_projection_dim=384,
                pooled_projection_dim=256, out_channels=16, pos_embed_max_size=64, dual_attention_layers=(0, 1),
                qk_norm="rms_norm"),
    "flux": dict(patch_size=1, in_channels=64, num_layers=3, num_single_layers=4, attention_head_dim=64,
                 num_attention_heads=6, joint_attention_dim=512, pooled_projection_dim=256, guidance_embeds=True,
                 axes_dims_rope=(16, 24, 24)),
}


ATTN = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]  # a LoRA's targets; None: a full fine-tune


@pytest.mark.parametrize("family,targets", [(f, t) for f in sorted(MID) for t in (ATTN, None)],
                         ids=lambda v: "full" if v is None else ("lora" if isinstance(v, list) else v))
def test_mid_size_model_at_unseen_token_counts(family, targets):
    """A whole mid-size model at 4x the probe's largest image and text token counts and another batch:
    the fits (two blocks of each kind, small tokens) predict its saved bytes within 5%, with a LoRA and with
    every weight trained (a full fine-tune saves every linear layer's input as well)."""
    config = MID[family]
    entry = M.measure_saved(family, config, "float32", "no", 8, targets)
    torch.manual_seed(0)
    model = M.trained_model(M.FAMILIES[family].build(config), family, 8, targets)
    adapter = M.stub_adapter(family, model, "no")
    batch, side, text = 3, 32, 96
    x, t, cond = M.forward_inputs(family, config, batch, side, text)
    base = model if targets is None else model.get_base_model()
    got = M.saved_by_block(model, M.blocks_of(base, M.FAMILIES[family]),
                           lambda: adapter.velocity(model, x, t, cond, 1.0))
    n_img = (side // 2) ** 2
    assert M.predict_saved(entry, config, batch, n_img, text)["total"] == pytest.approx(got["total"], rel=0.05)


@pytest.mark.parametrize("family,targets", [(f, t) for f in sorted(MID) for t in (ATTN, None)],
                         ids=lambda v: "full" if v is None else ("lora" if isinstance(v, list) else v))
def test_live_memory_of_mid_size_models_with_and_without_checkpointing(family, targets):
    """What a whole mid-size model holds after its training forward (live storages, ``LivePeak``)
    is the plan's activations within 10%, with gradient checkpointing (each block's inputs) and
    without, with a LoRA and with every weight trained; the forward + backward peak is at most the plan's
    activations + backward working set + gradients, which overstate it by less than 1.8x (the working set
    is assumed, not fitted)."""
    config = MID[family]
    entry = M.measure_saved(family, config, "float32", "no", 8, targets)
    batch, side, text = 3, 32, 96
    for ckpt in (False, True):
        torch.manual_seed(0)
        model = M.trained_model(M.FAMILIES[family].build(config), family, 8, targets)
        if ckpt:
            (model if targets is None else model.get_base_model()).enable_gradient_checkpointing()
            model.train()  # diffusers checkpoints only in training mode
        adapter = M.stub_adapter(family, model, "no")
        x, t, cond = M.forward_inputs(family, config, batch, side, text)
        live = M.LivePeak()
        with live:
            v = adapter.velocity(model, x, t, cond, 1.0)
            after_forward = live.current
            v.pow(2).mean().backward()
        planned = M.predict_saved(entry, config, batch, (side // 2) ** 2, text, checkpointing=ckpt)
        assert planned["total"] == pytest.approx(after_forward, rel=0.10), ckpt
        grads = sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)
        peak = planned["total"] + planned["block_peak"] * (2 if ckpt else 1) + grads
        assert live.peak <= peak <= 1.8 * live.peak, (ckpt, live.peak, peak)


@pytest.mark.parametrize("preset", ["tiny-cpu", "tiny-cpu-flux", "tiny-cpu-nft"])
def test_parameter_lora_and_optimizer_bytes(preset):
    """Weights, text encoders + VAE, LoRA, gradient and AdamW bytes of the real policy after one
    optimizer step, against the plan's parts (exact up to AdamW's scalar step counters)."""
    cfg = get_preset(preset)
    adapter, policy = _policy(cfg)
    p = plan(cfg)
    nbytes = sum(t.numel() * t.element_size() for t in adapter.transformer.parameters() if not t.requires_grad)
    nbytes += sum(b.numel() * b.element_size() for b in adapter.transformer.buffers() if b.is_floating_point())
    assert p.train["base weights"] == pytest.approx(nbytes, rel=0.05)
    others = sum(t.numel() * t.element_size() for name in adapter.components if name != "transformer"
                 for t in getattr(adapter.pipe, name).parameters())
    assert p.train["text encoders + VAE"] == pytest.approx(others, rel=0.05)
    lora = sum(t.numel() * t.element_size() for t in policy.parameters())
    assert p.train["LoRA (fp32)"] == pytest.approx(lora, rel=1e-9)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    for q in policy.parameters():
        q.grad = torch.ones_like(q)
    assert p.train["gradients (fp32)"] == pytest.approx(sum(q.grad.numel() * 4 for q in policy.parameters()))
    opt.step()
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    assert p.train["optimizer (AdamW, 2 x fp32)"] == pytest.approx(state, rel=0.05)
    copies = int(cfg.train.ema) + (1 if cfg.algorithm.name == "nft" else 0)
    assert p.train["EMA / old-policy LoRA copies"] == copies * lora


@pytest.mark.parametrize("preset", ["tiny-cpu", "tiny-cpu-nft"])
def test_full_fine_tune_parameter_gradient_optimizer_and_copy_bytes(preset):
    """model.finetune=full: the real FullPolicy's trained weights, reference copy, gradients, AdamW state after
    one step and EMA / old-policy copies against the plan's parts; 2 ranks' share is half of each."""
    from diffusionrl.config import load_config
    from diffusionrl.models import load_adapter
    from diffusionrl.training.full import FullPolicy

    cfg = load_config(preset, overrides=["model.finetune=full", "train.ema=true"])
    adapter = load_adapter(cfg.model, cfg.train.mixed_precision)
    policy = FullPolicy(adapter, cfg.model, reference=True)
    p = plan(cfg)
    weights = sum(t.numel() * t.element_size() for t in policy.parameters())
    weights += sum(b.numel() * b.element_size() for b in adapter.transformer.buffers() if b.is_floating_point())
    assert p.train["transformer weights (fp32, trained)"] == pytest.approx(weights, rel=0.05)
    reference = sum(t.numel() * t.element_size() for t in policy.frozen.parameters())
    reference += sum(b.numel() * b.element_size() for b in policy.frozen.buffers() if b.is_floating_point())
    assert p.train["reference (frozen copy of the base transformer)"] == pytest.approx(reference, rel=0.05)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    for q in policy.parameters():
        q.grad = torch.ones_like(q)
    grads = sum(q.grad.numel() * q.grad.element_size() for q in policy.parameters())
    assert p.train["gradients (fp32)"] == pytest.approx(grads, rel=0.05)
    opt.step()
    state = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values())
    assert p.train["optimizer (AdamW, 2 x fp32)"] == pytest.approx(state, rel=0.05)
    copies = 1 + (cfg.algorithm.name == "nft")  # the EMA, and DiffusionNFT's old policy
    assert p.train["EMA / old-policy transformer copies"] == pytest.approx(copies * grads, rel=0.05)
    assert "LoRA (fp32)" not in p.train and any("model.finetune=full" in n for n in p.notes)
    two = plan(load_config(preset, overrides=["model.finetune=full", "train.ema=true", "train.world_size=2"]))
    for part in ("gradients (fp32)", "optimizer (AdamW, 2 x fp32)", "EMA / old-policy transformer copies"):
        assert two.train[part] == pytest.approx(p.train[part] / 2, rel=1e-9), part


def test_the_planner_refuses_a_full_fine_tune_that_does_not_fit_and_names_the_knobs():
    from diffusionrl.plan.check import PlanError, check_fits

    cfg = get_preset("sd35m-pickscore-nft-full")
    assert cfg.model.finetune == "full" and cfg.model.dtype == "float32"
    assert plan(cfg, "H100").fits  # its documented cluster
    one = load_config_with(cfg, ["train.world_size=1", "train.rollout_engines=1", "train.prompts_per_step=8",
                                 "train.group_size=8"])
    with pytest.raises(PlanError) as err:
        check_fits(one, "nvidia-h100")
    message = str(err.value)
    assert "does not fit" in message and "fix with" in message and "train.world_size" in message, message


def load_config_with(cfg, overrides):
    from diffusionrl.config import Config, apply_overrides

    return Config.from_dict(apply_overrides(cfg.to_dict(), overrides))


def test_cached_figures_match_a_fresh_measurement():
    """measured.json's builtin entries are what measuring now gives (the hub ones take minutes:
    python -m diffusionrl.plan.refresh); hub facts agree with a fresh meta-device count."""
    cache = M.load_cache()
    from diffusionrl.plan.facts import model_config
    from diffusionrl.plan.refresh import cached_entries

    for reference, wd, amp, rank, targets, _ in cached_entries():
        key = M.cache_key(reference, wd, amp)
        assert key in cache["saved"], f"{key} missing: run python -m diffusionrl.plan.refresh"
        if not reference.startswith("builtin:"):
            continue
        family, config = model_config(reference)
        fresh = M.measure_saved(family, config, wd, amp, rank, targets)
        for name, coef in fresh["coef"].items():
            assert cache["saved"][key]["coef"][name] == pytest.approx(coef, rel=1e-6, abs=1e-3), (key, name)
    from diffusionrl.plan.facts import hub_facts

    facts = hub_facts("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    assert cache["facts"]["Wan-AI/Wan2.1-T2V-1.3B-Diffusers"]["params"] == facts["params"]


def test_lora_count_is_peft_s():
    cfg = get_preset("tiny-cpu-qwen-image")
    _, policy = _policy(cfg)
    facts = builtin_facts(cfg.model.name)
    assert lora_params(facts, list(cfg.model.lora_targets), cfg.model.lora_rank) == sum(
        p.numel() for p in policy.parameters())


def test_a_family_name_picks_its_adapter_and_an_unknown_one_is_named():
    from diffusionrl.models.families import ADAPTERS, UnknownModelFamily, adapter_for_family

    assert all(adapter_for_family(a.family) is a for a in ADAPTERS)
    assert M.lora_suffixes("flux", []) == adapter_for_family("flux").lora_suffixes([])
    with pytest.raises(UnknownModelFamily, match=r"unknown model family 'sd15'; the families are \['flux', "):
        M.lora_suffixes("sd15", [])


@pytest.mark.parametrize("preset", GPU_PRESETS)
@pytest.mark.parametrize("gpu", ["H200", "H100"])
def test_gpu_presets_fit_their_documented_cluster(preset, gpu):
    """Each GPU preset fits its own train.world_size of 80 GB H100s and of H200s, by the plan."""
    cfg = get_preset(preset)
    p = plan(cfg, gpu)
    assert p.fits, f"{preset} on {cfg.train.world_size} x {gpu}: peak {p.peak / GIB:.1f} GiB ({p.phase}): {p.train}"
    assert p.step_s > 0 and p.rollout_s > 0


def test_check_fits_names_the_knob():
    from diffusionrl.config import Config, apply_overrides
    from diffusionrl.plan.check import PlanError, check_fits

    assert check_fits(get_preset("tiny-cpu"), "nvidia-h100").startswith("no GPU plan")
    assert "planned peak" in check_fits(get_preset("sd35m-ocr"), "nvidia-h100")
    # a family with an adapter but no planner figures yet is launched unchecked, saying so (not refused)
    assert "no measured sizes" in check_fits(get_preset("zimage-turbo-pickscore"), "nvidia-h100")
    big = Config.from_dict(apply_overrides(get_preset("flux1-dev-pickscore").to_dict(), [
        "train.world_size=1", "model.gradient_checkpointing=false", "train.micro_batch_size=24"]))
    with pytest.raises(PlanError) as err:
        check_fits(big, "nvidia-h200")
    message = str(err.value)
    assert "\n" not in message and "does not fit" in message
    assert "fix with model.gradient_checkpointing=true: peak" in message and "train.micro_batch_size=" in message
    with pytest.raises(PlanError, match="no knob fixes it alone or together"):
        check_fits(big, "nvidia-l40s")


def test_cli_and_docs_table(capsys):
    from pathlib import Path

    from diffusionrl.plan.__main__ import BEGIN, END, main, parse_memory, table

    assert parse_memory("141GiB") == 141 * 2**30 and parse_memory("80GB") == 80e9
    assert main(["--config", "sd35m-ocr", "--gpus", "2", "--gpu-memory", "141GiB"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "activations (training forward, checkpointed)" in out
    assert main(["--config", "flux1-dev-pickscore", "--gpus", "1", "--gpu", "L40S-48G"]) == 1
    assert "fix: " in capsys.readouterr().out
    doc = (Path(__file__).resolve().parents[1] / "docs" / "scaling.md").read_text()
    assert doc[doc.index(BEGIN) + len(BEGIN):doc.index(END)].strip() == table().strip(), (
        "docs/scaling.md's plan tables are stale: python -m diffusionrl.plan --table --write")


@pytest.mark.parametrize("argv, says", [
    (["--mfu", "-1"], "is not a utilisation"), (["--mfu", "nan"], "is not a utilisation"),
    (["--mfu", "5"], "is not a utilisation"), (["--mfu", "0"], "is not a utilisation"),
    (["--gpu-memory", "0"], "give a size above 0"), (["--gpu-memory", "."], "give a size above 0"),
    (["--config", "tiny-cpu-flux2"], "no figures for the flux2 family"),
    (["--config", "tiny-cpu-zimage"], "no figures for the zimage family")])
def test_bad_planner_input_is_one_line(argv, says, capsys):
    """An impossible utilisation or memory, or a family without figures, ends in one line (after argparse's
    usage) and a non-zero exit,
    never a negative or NaN step time or a traceback."""
    from diffusionrl.plan.__main__ import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    out, err = capsys.readouterr()
    assert code != 0 and says in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert "step" not in out
