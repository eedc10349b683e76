"""LLaDA2-style masked LM through the stock ``LLaDA2Pipeline``: the tiny model, pipeline parity of
the recorded rollout (commits, edits), exact replay, split invariance, unsupported options and a
resumed run."""

from __future__ import annotations

import pytest
import torch

from diffusionrl.bdlm import TraceGRPO, frozen_copy, load_bdlm, load_bdlm_config, replay_log_probs, train_grpo
from diffusionrl.bdlm.gemma_rollout import EDIT, ReplayUnsupported
from diffusionrl.bdlm.grpo import OldPolicy, accumulate
from diffusionrl.bdlm.llada2 import BUILTIN, LLaDA2Adapter, _call, make_pipeline, rollout
from diffusionrl.bdlm.model import weights_digest
from diffusionrl.bdlm.task import encode_prompts, make_splits
from diffusionrl.training.trainer import UpdateStats

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLADA = [
    f"model.name={BUILTIN}", "model.dim=32", "model.layers=2", "model.heads=2", "model.ff_dim=64",
    "model.block_size=4", "model.steps_per_block=3", "model.threshold=0.5", "model.editing_threshold=0.06",
    "model.temperature=0.9", "task.num_train=64", "task.num_test=8", "warm_start.steps=20",
    "warm_start.batch_size=16", "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4",
    "grpo.micro_batch_size=4", "grpo.checkpoint_every=1", "grpo.lr=1e-3", "grpo.kl_beta=0.05",
]


def llada_cfg(*extra: str):
    return load_bdlm_config("tiny-bdlm", LLADA + list(extra))


@pytest.fixture(scope="module")
def setup():
    cfg = llada_cfg()
    model = load_bdlm(cfg.model.name, cfg.model)
    examples = [ex for ex in make_splits(cfg.task).train[:2] for _ in range(4)]
    prompts = encode_prompts(examples, cfg.task.prompt_length)
    trace = rollout(model, cfg.model, prompts, torch.tensor([3] * 4 + [4] * 4), 4, torch.arange(8) // 4)
    adv = torch.linspace(-1.5, 1.5, 8)
    return cfg, model, prompts, trace.with_rewards(adv.clone(), {}, adv)


def test_tiny_llada2_is_built_in_code_reloads_offline_and_loads_hub_ids(setup, tmp_path, monkeypatch):
    cfg, model, _, _ = setup
    assert isinstance(model, LLaDA2Adapter) and model.module.config.vocab_size == 14
    back = load_bdlm(model.save(tmp_path / "m"))
    assert isinstance(back, LLaDA2Adapter) and weights_digest(back) == weights_digest(model)
    import transformers

    calls = []

    def from_pretrained(ref, **kwargs):
        calls.append((ref, kwargs.get("revision"), kwargs.get("token")))
        return load_bdlm(cfg.model.name, cfg.model).module

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(transformers.AutoModelForMaskedLM, "from_pretrained", from_pretrained)
    load_bdlm("inclusionAI/llada2-test", llada_cfg("model.revision=r1", "model.hub_family=llada2").model)
    assert calls == [("inclusionAI/llada2-test", "r1", "hf_test")]


def test_recorded_rollout_is_the_stock_pipeline(setup):
    cfg, model, prompts, trace = setup
    plain = make_pipeline(model, cfg.model, recording=False)
    for start, seed in ((0, 3), (4, 4)):
        seen = []

        def grab(pipe, step, timestep, kwargs, seen=seen):
            seen.append({k: v.clone() for k, v in kwargs.items()})
            return {}

        plain_kwargs = {"callback_on_step_end": grab,
                        "callback_on_step_end_tensor_inputs": ["transfer_index", "editing_transfer_index",
                                                               "sampled_tokens"]}
        out = _call(plain, model, cfg.model, prompts[start : start + 4], cfg.model.temperature, seed, **plain_kwargs)
        rows = slice(start, start + 4)
        assert torch.equal(out.sequences, trace.targets[rows, trace.prompt_length :])
        for s, step in enumerate(seen):  # the same commits, edits and sampled tokens at every step
            acts = step["transfer_index"].long() + 2 * step["editing_transfer_index"].long()
            assert torch.equal(acts, trace.actions[rows, s]) and torch.equal(step["sampled_tokens"],
                                                                             trace.tokens[rows, s])
    assert int((trace.actions == EDIT).sum()) > 0, "editing_threshold=0.06 must edit some committed tokens"


def test_replay_is_exact_and_the_gradient_split_invariant(setup):
    cfg, model, _, trace = setup
    assert (replay_log_probs(model, trace) - trace.log_probs).abs().max() <= 1e-6
    assert (replay_log_probs(model, trace, 3) - trace.log_probs).abs().max() <= 1e-5
    live = frozen_copy(model)
    live.module.requires_grad_(True)
    assert (OldPolicy(live).scores(trace, 4) - trace.log_probs).abs().max() <= 1e-6
    torch.manual_seed(3)
    with torch.no_grad():
        for p in live.module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    grads = []
    for mb in (8, 2):
        gcfg = llada_cfg("grpo.kl_beta=0.1").grpo
        gcfg.micro_batch_size = mb
        objective = TraceGRPO(gcfg, live, frozen_copy(model))
        live.module.zero_grad(set_to_none=True)
        stats = UpdateStats()
        assert accumulate(objective.units(trace, trace.log_probs, trace.loss_weights), stats)
        grads.append({n: p.grad.clone() for n, p in live.module.named_parameters() if p.grad is not None})
        assert stats.means()["train/kl_loss"] > 0
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6)


def test_unreplayable_options_fail_before_training(setup, tmp_path):
    _, model, _, _ = setup
    init = model.save(tmp_path / "init")
    for override, name in (("model.scheduler=discrete_ddim", "model.scheduler"),
                           ("model.confidence_threshold=0.01", "model.confidence_threshold")):
        with pytest.raises(ReplayUnsupported, match=name):
            train_grpo(llada_cfg(override), tmp_path / "run", init, resume=None, progress=False)


def test_resumed_llada2_run_matches_uninterrupted(setup, tmp_path):
    _, model, _, _ = setup
    cfg = llada_cfg("grpo.objective=dr_grpo")  # keeps equal-reward groups: an untrained model scores 0 everywhere
    init = model.save(tmp_path / "init")
    full = train_grpo(cfg, tmp_path / "full", init, resume=None, progress=False)
    train_grpo(cfg, tmp_path / "part", init, resume=None, stop_after=1, progress=False)
    resumed = train_grpo(cfg, tmp_path / "part", init, resume="auto", progress=False)
    a, b = load_bdlm(full.model_dir).module.state_dict(), load_bdlm(resumed.model_dir).module.state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    m = full.metrics[0]
    assert m["train/log_prob_mean_abs_diff"] <= 1e-6 and m["train/first_approx_kl"] == 0.0


def test_trace_parquet_round_trip_replays_exactly(setup, tmp_path):
    from diffusionrl.bdlm.tensor_trace import read_tensor_trace, write_tensor_trace

    _, model, _, trace = setup
    back = read_tensor_trace(write_tensor_trace(tmp_path, trace, run_id="r", step=1))
    for name in ("prompts", "final", "step_blocks", "inputs", "actions", "tokens", "log_probs", "advantages"):
        assert torch.equal(getattr(back, name), getattr(trace, name)), name
    assert (replay_log_probs(model, back) - trace.log_probs).abs().max() <= 1e-6
