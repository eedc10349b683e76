"""DiffusionGemma: the tiny model, stock-pipeline parity of the recorded rollout, the trace contract
(commits, edits, renoising, self-conditioning, cache boundaries), exact replay, split invariance,
unsupported sampler options, and a resumed run."""

from __future__ import annotations

import pytest
import torch
from diffusers import BlockRefinementScheduler

from diffusionrl.bdlm import TraceGRPO, frozen_copy, load_bdlm, load_bdlm_config, replay_log_probs, train_grpo
from diffusionrl.bdlm.gemma import BUILTIN, DiffusionGemmaAdapter
from diffusionrl.bdlm.gemma_rollout import (
    EDIT,
    CanvasTrace,
    ReplayUnsupported,
    check_replayable,
    make_pipeline,
    pipeline_kwargs,
    rollout,
)
from diffusionrl.bdlm.grpo import OldPolicy, accumulate
from diffusionrl.bdlm.model import weights_digest
from diffusionrl.training.trainer import UpdateStats

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A 2-layer 32-wide DiffusionGemma with 4 MoE experts, canvases of 4, 3 denoising steps per canvas,
# a low editing threshold so that a random model does edit committed tokens.
GEMMA = [
    f"model.name={BUILTIN}", "model.dim=32", "model.layers=2", "model.heads=2", "model.ff_dim=64",
    "model.num_experts=4", "model.block_size=4", "model.steps_per_block=3", "model.threshold=0.5",
    "model.editing_threshold=0.06", "model.temperature=0.9",
    "task.num_train=64", "task.num_test=8", "warm_start.steps=20", "warm_start.batch_size=16",
    "grpo.steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.micro_batch_size=4",
    "grpo.checkpoint_every=1", "grpo.lr=1e-3", "grpo.kl_beta=0.05",
]
PROMPTS = ["..3142|", "..3142|", "..3142|", "..3142|", ".55190|", ".55190|", ".55190|", ".55190|"]


def gemma_cfg(*extra: str):
    return load_bdlm_config("tiny-bdlm", GEMMA + list(extra))


@pytest.fixture(scope="module")
def cfg():
    return gemma_cfg()


@pytest.fixture(scope="module")
def model(cfg):
    return load_bdlm(cfg.model.name, cfg.model)


@pytest.fixture(scope="module")
def trace(cfg, model):
    t = rollout(model, cfg.model, PROMPTS, torch.tensor([11] * 4 + [12] * 4), 4, torch.arange(8) // 4)
    adv = torch.linspace(-1.5, 1.5, 8)
    return t.with_rewards(adv.clone(), {}, adv)


# -- the model -----------------------------------------------------------------------------------


def test_tiny_model_is_built_in_code_and_reloads_offline(cfg, model, tmp_path):
    m = model.module
    assert isinstance(model, DiffusionGemmaAdapter) and type(m).__name__ == "DiffusionGemmaForBlockDiffusion"
    assert sum(p.numel() for p in m.parameters()) < 100_000 and m.config.canvas_length == 4
    assert m.config.text_config.num_experts == 4 and m.config.text_config.vocab_size == model.vocab.size
    assert weights_digest(load_bdlm(cfg.model.name, cfg.model)) == weights_digest(model)  # seeded
    folder = model.save(tmp_path / "m")
    back = load_bdlm(folder)
    assert back.kind == "diffusiongemma" and weights_digest(back) == weights_digest(model)
    # the same rollout from the reloaded folder (log-probs to fp32 rounding: the loaded tensors sit
    # at other addresses, which the grouped expert matmul may vectorise differently)
    a = rollout(model, cfg.model, PROMPTS[:4], torch.tensor([3] * 4), 4)
    b = rollout(back, cfg.model, PROMPTS[:4], torch.tensor([3] * 4), 4)
    assert torch.equal(a.canvases, b.canvases) and (a.log_probs - b.log_probs).abs().max() <= 1e-6


def test_hub_ids_load_with_revision_and_token(cfg, monkeypatch):
    """A hub id goes to ``from_pretrained`` with ``model.revision`` and ``$HF_TOKEN``, for the model
    and its processor (recorded here instead of downloaded: the tests are offline)."""
    import transformers

    calls = []

    def fake(kind):
        def from_pretrained(ref, **kwargs):
            calls.append((kind, ref, kwargs.get("revision"), kwargs.get("token")))
            if kind == "model":
                return load_bdlm(cfg.model.name, cfg.model).module
            return object()
        return from_pretrained

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(transformers.DiffusionGemmaForBlockDiffusion, "from_pretrained", fake("model"))
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", fake("processor"))
    adapter = load_bdlm("google/diffusiongemma-test", gemma_cfg("model.revision=abc1").model)
    assert calls == [("model", "google/diffusiongemma-test", "abc1", "hf_test"),
                     ("processor", "google/diffusiongemma-test", "abc1", "hf_test")]
    assert adapter.source == "google/diffusiongemma-test@abc1"


def test_a_model_with_another_vocabulary_is_refused_for_digit_tasks(cfg):
    wide = load_bdlm_config("tiny-bdlm", GEMMA).model
    adapter = load_bdlm(cfg.model.name, wide)
    adapter.module.config.text_config.vocab_size = 99
    with pytest.raises(ValueError, match="vocabulary of 99 tokens"):
        adapter.check_digit_vocab()


# -- stock-pipeline parity and the trace contract ------------------------------------------------------


def test_recorded_rollout_is_the_stock_pipeline(cfg, model, trace):
    """The stock pipeline with the stock scheduler, same model and seed: same tokens, and the same
    canvas after every step (so the same commit, edit and renoise order)."""
    plain = make_pipeline(model, cfg.model, recording=False)
    assert type(plain.scheduler) is BlockRefinementScheduler
    for start, seed in ((0, 11), (4, 12)):
        seen: list[torch.Tensor] = []

        def grab(pipe, step, timestep, kwargs, seen=seen):
            seen.append(kwargs["canvas"].clone())
            return {}

        out = plain(prompt=PROMPTS[start : start + 4], callback_on_step_end=grab,
                    **pipeline_kwargs(cfg.model, seed, cfg.model.temperature))
        rows = slice(start, start + 4)
        assert torch.equal(out.sequences, trace.sequences[rows])
        nb, s = trace.num_blocks, trace.steps_per_block
        ours = [trace.canvases[rows, j, k + 1] if k + 1 < s else trace.sequences[rows, j * 4 : (j + 1) * 4]
                for j in range(nb) for k in range(s)]
        assert len(seen) == len(ours) == nb * s
        for k, (a, b) in enumerate(zip(seen, ours)):  # committed + edited + renoised; the block at its last step
            assert torch.equal(a, b), k


def test_trace_records_commits_edits_renoising_and_cache_boundaries(trace):
    assert trace.canvases.shape == (8, 2, 3, 4) and trace.self_cond.shape == (8, 2, 3, 4, 14)
    assert int((trace.actions == EDIT).sum()) > 0, "editing_threshold=0.06 must edit some committed tokens"
    assert trace.cache_boundaries == [7, 11]
    # renoised positions are exactly the uncommitted ones, and the next step's input differs there only
    nxt = trace.canvases[:, :, 1:]
    kept = ~trace.renoised[:, :, :-1]
    applied = torch.where(trace.actions[:, :, :-1] > 0, trace.tokens[:, :, :-1], trace.canvases[:, :, :-1])
    assert torch.equal(nxt[kept], applied[kept])
    assert not trace.renoised[:, :, -1].any()  # the last step commits every remaining position
    # self-conditioning input of step s is the logits of step s - 1 (zeros at s = 0: none)
    assert torch.equal(trace.self_cond[:, :, 0], torch.zeros_like(trace.self_cond[:, :, 0]))
    # one action slot per (global step, position); the action count = commits + edits
    assert int((trace.action_steps >= 0).sum()) == int((trace.actions > 0).sum())


def test_trace_contract_rejects_an_edit_before_a_commit_and_a_wrong_sequence(trace):
    fields = {k: getattr(trace, k) for k in ("prompts", "sequences", "canvases", "actions", "tokens", "renoised",
                                             "self_cond", "log_probs", "temperature", "micro_batch_size",
                                             "group_ids", "seeds")}
    acts = trace.actions.clone()
    first = (acts[0, 0, :, 0] == 1).nonzero()[0, 0]
    acts[0, 0, :, 0] = 0
    acts[0, 0, first, 0] = EDIT
    with pytest.raises(ValueError, match="committed exactly once"):
        CanvasTrace(**{**fields, "actions": acts})
    seqs = trace.sequences.clone()
    seqs[0, 0] = (seqs[0, 0] + 1) % 14
    with pytest.raises(ValueError, match="do not reproduce"):
        CanvasTrace(**{**fields, "sequences": seqs})


# -- exact replay ------------------------------------------------------------------------------------


def test_replay_equals_the_rollout_log_probs(model, trace):
    got = replay_log_probs(model, trace)
    assert (got - trace.log_probs).abs().max() <= 1e-6
    on = trace.loss_weights > 0
    assert bool((trace.log_probs[on] < 0).all()) and bool((trace.log_probs[~on] == 0).all())
    # another micro-batch composition agrees to fp32 rounding
    assert (replay_log_probs(model, trace, micro_batch_size=3) - trace.log_probs).abs().max() <= 1e-5
    # the scoring policy matters: a perturbed model gives other log-probs
    other = frozen_copy(model)
    with torch.no_grad():
        for p in other.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert (replay_log_probs(other, trace) - trace.log_probs).abs().max() > 1e-3


def _grads(objective, trace, old, weights):
    objective.live.module.zero_grad(set_to_none=True)
    stats = UpdateStats()
    assert accumulate(objective.units(trace, old, weights), stats)
    return stats, {n: p.grad.clone() for n, p in objective.live.module.named_parameters() if p.grad is not None}


def test_first_update_ratio_is_one_and_micro_batch_split_does_not_change_the_gradient(cfg, model, trace):
    live = frozen_copy(model)
    live.module.requires_grad_(True)
    old = OldPolicy(live).scores(trace, 4)
    assert (old - trace.log_probs).abs().max() <= 1e-6
    first, _ = _grads(TraceGRPO(cfg.grpo, live, frozen_copy(model)), trace, old, trace.loss_weights)
    assert first.means()["train/ratio_abs_minus_1"] == 0.0 and first.means()["train/kl_loss"] == 0.0
    torch.manual_seed(3)
    with torch.no_grad():
        for p in live.module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    runs = []
    for mb in (8, 4, 2):
        gcfg = gemma_cfg("grpo.kl_beta=0.1").grpo
        gcfg.micro_batch_size = mb
        runs.append(_grads(TraceGRPO(gcfg, live, frozen_copy(model)), trace, trace.log_probs, trace.loss_weights))
    (s1, g1), *others = runs
    assert s1.means()["train/kl_loss"] > 0 and len(g1) > 20
    assert any(n.startswith("model.encoder") for n in g1), "the encoder (KV cache) is part of the policy"
    for s, g in others:
        assert set(g) == set(g1)
        for name in g1:
            torch.testing.assert_close(g[name], g1[name], rtol=1e-4, atol=1e-6)
        assert s.means()["train/loss"] == pytest.approx(s1.means()["train/loss"], rel=1e-5)


@pytest.mark.parametrize("override, name", [
    ("model.confidence_threshold=0.005", "model.confidence_threshold"),
    ("model.scheduler=discrete_ddim", "model.scheduler"),
    ("model.block_size=2", "model.block_size"),
])
def test_a_sampler_option_the_replay_does_not_cover_fails_before_training(override, name, model, tmp_path):
    cfg = gemma_cfg(override)
    with pytest.raises(ReplayUnsupported, match=name):
        check_replayable(cfg.model, model)
    init = model.save(tmp_path / "init")
    with pytest.raises(ReplayUnsupported, match=name):
        train_grpo(cfg, tmp_path / "run", init, resume=None, progress=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resumed_gemma_run_matches_uninterrupted(model, tmp_path):
    cfg = gemma_cfg("grpo.steps=2")
    init = model.save(tmp_path / "init")
    full = train_grpo(cfg, tmp_path / "full", init, resume=None, progress=False)
    train_grpo(cfg, tmp_path / "part", init, resume=None, stop_after=1, progress=False)
    resumed = train_grpo(cfg, tmp_path / "part", init, resume="auto", progress=False)
    a, b = load_bdlm(full.model_dir).module.state_dict(), load_bdlm(resumed.model_dir).module.state_dict()
    assert all(torch.equal(a[n], b[n]) for n in a)
    m = full.metrics[0]
    assert m["train/log_prob_mean_abs_diff"] <= 1e-6 and m["train/first_approx_kl"] == 0.0
    assert 0 < m["train/entropy"] < torch.log(torch.tensor(14.0)).item() + 1e-5
    from diffusionrl.bdlm.tensor_trace import read_tensor_trace

    saved = read_tensor_trace(tmp_path / "full" / "traces" / "step-000001.parquet")
    assert saved.batch_size == 8 and saved.policy_version == 0 and len(saved.metadata) == 8
    # the first step's rollout came from the initial weights: the saved trace replays exactly under them
    assert (replay_log_probs(load_bdlm(init), saved) - saved.log_probs).abs().max() <= 1e-6


def test_the_pyfunc_model_serves_through_the_stock_pipeline(cfg, model, tmp_path):
    """The registered pyfunc's ``predict`` decodes a DiffusionGemma folder through the stock
    pipeline: the same answers as the evaluation's greedy decoding."""
    import json
    from types import SimpleNamespace

    from diffusionrl.bdlm.evaluation import decode_answers
    from diffusionrl.bdlm.serving import BDLMDecoder, decoding_settings
    from diffusionrl.bdlm.task import Example

    folder = model.save(tmp_path / "m")
    (tmp_path / "decoding.json").write_text(json.dumps(decoding_settings(cfg)))
    served = BDLMDecoder()
    served.load_context(SimpleNamespace(artifacts={"model": str(folder), "decoding": str(tmp_path / "decoding.json")}))
    prompts = ["3142", "55190", "123"]
    expected = decode_answers(cfg, load_bdlm(folder), [Example(p, "") for p in prompts])
    assert served.predict(None, {"prompt": prompts}) == expected


def test_trace_parquet_round_trip_replays_exactly(model, trace, tmp_path):
    from diffusionrl.bdlm.tensor_trace import read_tensor_trace, write_tensor_trace

    path = write_tensor_trace(tmp_path, trace, run_id="r", step=3)
    assert path.name == "step-000003.parquet"
    back = read_tensor_trace(path)
    for name in ("prompts", "sequences", "canvases", "actions", "tokens", "renoised", "self_cond", "log_probs",
                 "group_ids", "seeds", "rewards", "advantages"):
        assert torch.equal(getattr(back, name), getattr(trace, name)), name
    assert back.temperature == trace.temperature and back.micro_batch_size == trace.micro_batch_size
    assert (replay_log_probs(model, back) - trace.log_probs).abs().max() <= 1e-6
