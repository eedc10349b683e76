"""Block-diffusion LM: sampler, trace contract, exact replay and the GRPO objective."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from diffusionrl.bdlm import (
    OldPolicy,
    TraceBatch,
    TraceError,
    TraceGRPO,
    categorical_kl,
    decode,
    frozen_copy,
    grpo_token_terms,
    load_bdlm,
    load_bdlm_config,
    read_trace,
    replay_log_probs,
    write_step,
)
from diffusionrl.bdlm.grpo import accumulate
from diffusionrl.bdlm.sampler import commit_mask, current_block
from diffusionrl.bdlm.task import Example, encode_prompts, score, solve
from diffusionrl.bdlm.warmstart import masked_diffusion_loss
from diffusionrl.training.trainer import UpdateStats
from diffusionrl.trajectory import CorruptParquetFile

from .test_trajectory_store import flip_mid_column

# A small model and task so every test runs in well under a second.
SMALL = ["model.dim=32", "model.layers=2", "model.heads=2", "model.ff_dim=64", "task.num_train=64", "task.num_test=8"]


def small_cfg(*extra: str):
    return load_bdlm_config("tiny-bdlm", SMALL + list(extra))


def make_trace(
    cfg, adapter, rows: int = 8, temperature: float = 0.7, threshold: float = 0.5, mb: int = 8
) -> TraceBatch:
    """Sample ``rows`` rows (2 prompts x rows/2) and wrap them in a scored trace."""
    from diffusionrl.bdlm import make_splits

    examples = [ex for ex in make_splits(cfg.task).train[:2] for _ in range(rows // 2)]
    prompts = encode_prompts(examples, cfg.task.prompt_length)
    seeds = torch.arange(rows, dtype=torch.int64) + 100
    parts = [decode(adapter, prompts[i : i + mb], gen_length=cfg.model.gen_length, block_size=cfg.model.block_size,
                    temperature=temperature, threshold=threshold, seeds=seeds[i : i + mb]) for i in range(0, rows, mb)]
    tokens, steps, logps = (torch.cat([getattr(p, k) for p in parts]) for k in ("tokens", "action_steps", "log_probs"))
    trace = TraceBatch(tokens, steps, (steps >= 0).float(), logps, prompts.shape[1], temperature,
                       torch.arange(rows) // (rows // 2), seeds, mb)
    adv = torch.linspace(-1.5, 1.5, rows)
    return trace.with_rewards(adv.clone(), {}, adv)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def cfg():
    return small_cfg()


@pytest.fixture(scope="module")
def model(cfg):
    return load_bdlm("builtin:tiny-bdlm", cfg.model)


# -- sampler -------------------------------------------------------------------------------------


def test_commit_rule_hand_worked():
    conf = torch.tensor([[0.95, 0.50, 0.92, 0.99], [0.30, 0.60, 0.20, 0.99]])
    cand = torch.tensor([[True, True, True, False], [True, True, True, False]])
    got = commit_mask(conf, cand, threshold=0.9)
    # row 0: both candidates above 0.9 (0.99 is not a candidate); row 1: none above, the best one.
    assert got.tolist() == [[True, False, True, False], [False, True, False, False]]


def test_current_block_is_first_unfinished_block():
    masked = torch.tensor([[False, False, True, True, True, True], [False, False, False, False, True, False]])
    # prompt length 2, blocks of 2: row 0 -> block [2, 4), row 1 -> block [4, 6), only masked positions.
    assert current_block(masked, 2, 2).tolist() == [[False, False, True, True, False, False],
                                                    [False, False, False, False, True, False]]


def test_sampler_records_a_complete_reproducible_trace(cfg, model):
    trace = make_trace(cfg, model)
    p = trace.prompt_length
    assert (trace.action_steps[:, :p] == -1).all() and (trace.action_steps[:, p:] >= 0).all()
    assert (trace.targets != model.vocab.mask).all()
    per_step = [int((trace.action_steps == s).sum()) for s in range(trace.num_steps)]
    assert max(per_step) > 1, "a threshold of 0.5 should commit several tokens in some step"
    # blocks are decoded in order: every token of block k is committed before any of block k+1
    bs = cfg.model.block_size
    gen = trace.action_steps[:, p:].reshape(trace.batch_size, -1, bs)
    assert (gen[:, :-1].max(-1).values < gen[:, 1:].min(-1).values).all()
    again = make_trace(cfg, model)
    assert torch.equal(again.targets, trace.targets) and torch.equal(again.action_steps, trace.action_steps)
    # a row depends on its seed only, not on the rows it was batched with
    single = make_trace(cfg, model, mb=4)
    assert torch.equal(single.targets, trace.targets)


# -- replay ----------------------------------------------------------------------------------------


def test_replay_equals_sampler_log_probs(cfg, model, tmp_path):
    trace = make_trace(cfg, model)
    replayed = replay_log_probs(model, trace)
    assert (replayed - trace.log_probs).abs().max() <= 1e-6
    # and the same after a round trip through Parquet (temperature is stored exactly)
    back = read_trace(write_step(tmp_path, trace, run_id="t", step=1))
    assert (replay_log_probs(model, back) - trace.log_probs).abs().max() <= 1e-6
    # another micro-batch composition still agrees to fp32 rounding
    assert (replay_log_probs(model, trace, micro_batch_size=3) - trace.log_probs).abs().max() <= 1e-5


# -- trace contract and Parquet --------------------------------------------------------------------


def test_trace_contract_rejects_bad_batches(cfg, model):
    t = make_trace(cfg, model)
    base = {"targets": t.targets, "action_steps": t.action_steps, "loss_weights": t.loss_weights,
            "log_probs": t.log_probs, "prompt_length": t.prompt_length, "temperature": t.temperature,
            "group_ids": t.group_ids, "seeds": t.seeds, "micro_batch_size": t.micro_batch_size}

    def bad(match: str, **change):
        with pytest.raises(TraceError, match=match):
            TraceBatch(**{**base, **change})

    w = t.loss_weights.clone()
    w[0, -1] = float("nan")
    bad("finite", loss_weights=w)
    bad(">= 0", loss_weights=-t.loss_weights)
    w = t.loss_weights.clone()
    w[0, 0] = 1.0
    bad("0 at prompt", loss_weights=w)
    s = t.action_steps.clone()
    s[0, 0] = 0
    bad("prompt positions", action_steps=s)
    s = t.action_steps.clone()
    s[0, -1] = -1
    bad("every generated position", action_steps=s)
    x = t.targets.clone()
    x[1, -1] = model.vocab.mask
    bad("never MASK", targets=x)
    bad("shape", log_probs=t.log_probs[:, :-1])
    bad("prompt_length", prompt_length=0)
    bad(r"\[B\]", group_ids=t.group_ids[:-1])


def test_trace_parquet_round_trip(cfg, model, tmp_path):
    trace = make_trace(cfg, model)
    path = write_step(tmp_path, trace, run_id="run", step=3)
    back = read_trace(path)
    for name in ("targets", "action_steps", "loss_weights", "log_probs", "group_ids", "seeds", "advantages"):
        assert torch.equal(getattr(back, name), getattr(trace, name)), name
    assert back.prompt_length == trace.prompt_length and back.temperature == trace.temperature
    df = pd.read_parquet(tmp_path)  # plain pandas reads a run folder
    assert len(df) == trace.batch_size and set(df["schema_version"]) == {1} and set(df["step"]) == {3}
    import pyarrow.parquet as pq

    from diffusionrl.trajectory import write_parquet

    table = pq.read_table(path)
    meta = dict(table.schema.metadata)
    meta[b"diffusionrl.trace_schema_version"] = b"99"
    write_parquet(table.replace_schema_metadata(meta), tmp_path / "step-000004.parquet")
    with pytest.raises(ValueError, match="schema version 99"):
        read_trace(tmp_path / "step-000004.parquet")


def test_a_corrupted_trace_file_fails_naming_the_file_and_step(cfg, model, tmp_path):
    from diffusionrl.bdlm import read_traces

    trace = make_trace(cfg, model)
    path = write_step(tmp_path, trace, run_id="run", step=5)
    flip_mid_column(path, "log_probs", n=8)
    with pytest.raises(CorruptParquetFile) as err:
        read_traces(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "(step 5)" in msg and "checksum" in msg.lower()


# -- GRPO objective --------------------------------------------------------------------------------


def test_token_terms_hand_worked():
    e = math.e
    new, old = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 0.0])  # ratios e, e, 1
    adv = torch.tensor([1.0, -1.0, 2.0])
    terms = grpo_token_terms(new, old, adv, torch.tensor([0.0, 0.0, 0.5]), clip_range=0.2, kl_beta=0.1)
    # A > 0: max(-e, -1.2) = -1.2 (clipped); A < 0: max(e, 1.2) = e; ratio 1: -2 + 0.1 * 0.5
    assert torch.allclose(terms.loss, torch.tensor([-1.2, e, -1.95]), atol=1e-6)
    p = torch.log(torch.tensor([[[0.5, 0.5, 0.0]]]))  # last column = MASK (-inf in both)
    q = torch.log(torch.tensor([[[0.25, 0.75, 0.0]]]))
    expected = 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)
    assert categorical_kl(p, q, mask_id=2).item() == pytest.approx(expected, abs=1e-6)


def _units_grad(objective, trace, old, weights):
    objective.live.module.zero_grad(set_to_none=True)
    stats = UpdateStats()
    units = objective.units(trace, old, weights)
    assert accumulate(units, stats)
    grads = {n: p.grad.clone() for n, p in objective.live.module.named_parameters()}
    return stats, grads, sum(u.count for u in units)


def test_first_iteration_ratio_is_one_with_a_gradient(cfg, model):
    live = frozen_copy(model)
    live.module.requires_grad_(True)
    trace = make_trace(cfg, live)
    gcfg = small_cfg("grpo.micro_batch_size=8", "grpo.kl_beta=0.05").grpo
    objective = TraceGRPO(gcfg, live, frozen_copy(live))
    old = OldPolicy(live).scores(trace, gcfg.micro_batch_size)
    stats, grads, total = _units_grad(objective, trace, old, trace.loss_weights)
    means = stats.means()
    assert means["train/ratio_abs_minus_1"] == 0.0 and means["train/approx_kl"] == 0.0
    assert means["train/clipfrac"] == 0.0 and means["train/kl_loss"] == 0.0
    assert total == float(trace.loss_weights.sum())
    assert sum(float(g.norm()) for g in grads.values()) > 1e-4
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_old_policy_keeps_start_of_step_scores(cfg, model):
    live = frozen_copy(model)
    trace = make_trace(cfg, live)
    old = OldPolicy(live)
    before = old.scores(trace, 8).clone()
    with torch.no_grad():
        for p in live.module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert not torch.allclose(replay_log_probs(live, trace), before, atol=1e-3)  # the live model moved
    assert torch.equal(old.scores(trace, 8), before)
    # a snapshot taken after the change (the next step's) sees the new weights
    assert torch.equal(OldPolicy(live).scores(trace, 8), replay_log_probs(live, trace, 8))


def _perturbed(model, seed: int = 1):
    live = frozen_copy(model)
    live.module.requires_grad_(True)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in live.module.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return live


def test_one_and_many_micro_batches_give_the_same_gradient(cfg, model):
    trace = make_trace(cfg, model)
    live = _perturbed(model)  # ratio != 1 (some clipped) and KL != 0
    old = trace.log_probs
    weights = trace.loss_weights * torch.rand(trace.targets.shape, generator=torch.Generator().manual_seed(0))
    runs = []
    for mb in (8, 2, 3):
        gcfg = small_cfg(f"grpo.micro_batch_size={mb if mb != 3 else 8}", "grpo.kl_beta=0.1").grpo
        gcfg.micro_batch_size = mb  # 3 does not divide a real step's batch; the objective must not care
        runs.append(_units_grad(TraceGRPO(gcfg, live, frozen_copy(model)), trace, old, weights))
    (s1, g1, t1), *others = runs
    assert s1.means()["train/clipfrac"] > 0 and s1.means()["train/kl_loss"] > 0
    for s, g, t in others:
        assert t == pytest.approx(t1, rel=1e-6)
        for name in g1:
            torch.testing.assert_close(g[name], g1[name], rtol=1e-5, atol=1e-7)
        assert s.means()["train/loss"] == pytest.approx(s1.means()["train/loss"], rel=1e-5)


class PoisonedAdapter:
    """Writes NaN / +inf into the logits of every position the replay does not score at a step."""

    def __init__(self, inner, action_steps: torch.Tensor):
        self.inner, self.module, self.vocab = inner, inner.module, inner.vocab
        self.steps = action_steps

    def logits(self, canvas: torch.Tensor) -> torch.Tensor:
        out = self.inner.logits(canvas)
        hidden = canvas == self.vocab.mask
        big = torch.iinfo(torch.int64).max
        step = torch.where(hidden, self.steps, torch.full_like(self.steps, big)).min(1, keepdim=True).values  # [B, 1]
        inactive = self.steps != step  # [B, L]
        out = out.masked_fill((inactive & hidden)[..., None], float("nan"))
        return out.masked_fill((inactive & ~hidden)[..., None], float("inf"))


def test_nan_and_inf_logits_at_inactive_positions_do_not_leak(cfg, model):
    trace = make_trace(cfg, model)
    live = _perturbed(model)
    gcfg = small_cfg("grpo.micro_batch_size=8", "grpo.kl_beta=0.1").grpo
    clean = _units_grad(TraceGRPO(gcfg, live, frozen_copy(model)), trace, trace.log_probs, trace.loss_weights)
    ref = PoisonedAdapter(frozen_copy(model), trace.action_steps)
    poisoned = _units_grad(TraceGRPO(gcfg, PoisonedAdapter(live, trace.action_steps), ref), trace, trace.log_probs,
                           trace.loss_weights)
    assert math.isfinite(poisoned[0].means()["train/loss"])
    assert poisoned[0].means()["train/loss"] == pytest.approx(clean[0].means()["train/loss"], rel=1e-6)
    for name, g in poisoned[1].items():
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g, clean[1][name], rtol=1e-5, atol=1e-7)
    assert torch.isfinite(replay_log_probs(ref, trace)).all()


# -- task and warm start ---------------------------------------------------------------------------


def test_task_rewards_hand_worked():
    assert solve("sort", "312") == "123" and solve("reverse", "312") == "213" and solve("add", "95|7") == "102"
    examples = [Example("312", "123")] * 3
    gen = torch.tensor([[1, 2, 3, 11, 11], [1, 2, 4, 11, 11], [1, 2, 3, 4, 11]])  # EOS = 11
    s = score(gen, examples, partial_weight=0.5)
    assert s["exact"].tolist() == [1.0, 0.0, 0.0]
    np.testing.assert_allclose(s["partial"], [1.0, 2 / 3, 3 / 4], rtol=1e-6)  # too long: 3 hits / 4 positions
    np.testing.assert_allclose(s["reward"], [1.5, 1 / 3, 3 / 8], rtol=1e-6)


def test_splits_are_disjoint_and_seeded(cfg):
    from diffusionrl.bdlm import make_splits

    a, b = make_splits(cfg.task), make_splits(cfg.task)
    assert [e.prompt for e in a.train] == [e.prompt for e in b.train]
    assert not {e.prompt for e in a.train} & {e.prompt for e in a.test}
    assert all(e.answer == "".join(sorted(e.prompt)) for e in a.test)


class Uniform:
    """A model whose logits are all zero: every non-MASK token has probability 1/13."""

    def __init__(self, vocab):
        self.vocab = vocab
        self.w = torch.zeros((), requires_grad=True)

    def logits(self, canvas):
        return torch.zeros(*canvas.shape, self.vocab.size) * self.w


def test_masked_diffusion_loss_hand_worked(model):
    vocab = model.vocab
    prompts = torch.tensor([[1, 2, vocab.sep], [3, 4, vocab.sep]])
    answers = torch.tensor([[1, 2, vocab.eos, vocab.eos], [3, 4, vocab.eos, vocab.eos]])
    t = torch.tensor([0.5, 0.25])
    hidden = torch.tensor([[True, False, True, False], [True, False, False, False]])
    loss = masked_diffusion_loss(Uniform(vocab), prompts, answers, t, hidden)
    # (2 hidden * ln 13 / 0.5 + 1 hidden * ln 13 / 0.25) / (2 rows * 4 positions) = ln 13
    assert loss.item() == pytest.approx(math.log(13), rel=1e-6)


def test_hf_masked_lm_adapter_replays_exactly(cfg, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    bert_cfg = transformers.BertConfig(vocab_size=30, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, max_position_embeddings=32,
                                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    from diffusionrl.bdlm import HFMaskedLMAdapter

    adapter = HFMaskedLMAdapter(transformers.BertForMaskedLM(bert_cfg), list(range(5, 19)))
    loaded = load_bdlm(adapter.save(tmp_path / "hf"))
    assert isinstance(loaded, HFMaskedLMAdapter) and loaded.token_ids.tolist() == list(range(5, 19))
    trace = make_trace(cfg, loaded, rows=4, mb=4)
    assert (replay_log_probs(loaded, trace) - trace.log_probs).abs().max() <= 1e-6
