"""The objective family on exact traces (grpo, dapo, dr_grpo, opd): hand-worked terms, the loss
normalisation, exactness and split invariance per objective, the frozen teacher, metric
reduction, and the objective recorded in checkpoints."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffusionrl.bdlm import TraceGRPO, frozen_copy, load_bdlm, train_grpo, warm_start
from diffusionrl.bdlm.dynamic_sampling import REFILL_GROUP_OFFSET, concat_rows, keep_groups
from diffusionrl.bdlm.gemma_rollout import rollout
from diffusionrl.bdlm.grpo import OldPolicy, accumulate
from diffusionrl.bdlm.model import weights_digest
from diffusionrl.bdlm.objectives import (
    OBJECTIVES,
    advantages_for,
    clipped_surrogate,
    distillation_terms,
    entropy,
    reduce_metrics,
)
from diffusionrl.run import Callback, CheckpointMismatch
from diffusionrl.training.trainer import UpdateStats

from .test_bdlm import make_trace, small_cfg
from .test_bdlm_gemma import PROMPTS, gemma_cfg

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- hand-worked terms ---------------------------------------------------------------------------------


def test_advantages_per_objective_hand_worked():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: mean 0.25, std sqrt(0.1875) = 0.4330; group 1 has no variance
    for name in ("grpo", "dapo"):
        a = advantages_for(name, rewards, groups, global_std=False, clip_max=5.0)
        assert a.advantages[:4].tolist() == pytest.approx([0.75 / 0.4331127, -0.25 / 0.4331127, -0.25 / 0.4331127,
                                                           -0.25 / 0.4331127], rel=1e-4)
        assert a.active.tolist() == [True] * 4 + [False] * 4 and a.zero_std_groups == 1
    dr = advantages_for("dr_grpo", rewards, groups, global_std=False, clip_max=5.0)
    assert dr.advantages.tolist() == [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0] and bool(dr.active.all())
    opd = advantages_for("opd", rewards, groups, global_std=False, clip_max=5.0)
    assert opd.advantages.tolist() == [0.0] * 8 and bool(opd.active.all())


def test_clip_higher_hand_worked():
    new = torch.log(torch.tensor([1.5, 1.5, 0.5]))  # ratios 1.5, 1.5, 0.5 (old log-prob 0)
    adv = torch.tensor([1.0, 1.0, -1.0])
    sym, _ = clipped_surrogate(new, torch.zeros(3), adv, clip_low=0.2, clip_high=0.2)
    high, ratio = clipped_surrogate(new, torch.zeros(3), adv, clip_low=0.2, clip_high=0.28)
    # A > 0, ratio 1.5: max(-1.5, -1.2) = -1.2 symmetric, max(-1.5, -1.28) = -1.28 with clip-higher;
    # A < 0, ratio 0.5: max(0.5, 0.8) = 0.8 either way (the lower clip is unchanged)
    assert sym.tolist() == pytest.approx([-1.2, -1.2, 0.8]) and high.tolist() == pytest.approx([-1.28, -1.28, 0.8])
    assert ratio.tolist() == pytest.approx([1.5, 1.5, 0.5])


def test_entropy_and_distillation_terms_hand_worked():
    lp = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))  # a -inf column (MASK)
    assert entropy(lp).item() == pytest.approx(math.log(2)) and math.isfinite(entropy(lp).item())
    # T = 1, tau = 2: teacher^tau = softmax(log [0.8, 0.2] / 2) = [2/3, 1/3]; student [0.5, 0.5] stays
    teacher = torch.log(torch.tensor([[0.8, 0.2]]))
    student = torch.log(torch.tensor([[0.5, 0.5]]))
    loss, kl = distillation_terms(student, teacher, rollout_temperature=1.0, tau=2.0, hard_ce=0.0, excluded=None)
    expected_kl = 2 / 3 * math.log((2 / 3) / 0.5) + 1 / 3 * math.log((1 / 3) / 0.5)
    assert kl.item() == pytest.approx(expected_kl, abs=1e-6) and loss.item() == pytest.approx(4 * expected_kl, abs=1e-6)
    # hard CE on the teacher's argmax (token 0) at the rollout temperature: + 0.5 * -log 0.5
    loss_ce, _ = distillation_terms(student, teacher, rollout_temperature=1.0, tau=2.0, hard_ce=0.5, excluded=None)
    assert loss_ce.item() == pytest.approx(4 * expected_kl + 0.5 * math.log(2), abs=1e-6)
    # the rollout temperature is undone before tau is applied: log-probs at T = 0.5 of the same logits
    logits = torch.log(torch.tensor([[0.8, 0.2]]))
    _, kl_t = distillation_terms(torch.log_softmax(torch.zeros(1, 2) / 0.5, -1), torch.log_softmax(logits / 0.5, -1),
                                 rollout_temperature=0.5, tau=2.0, hard_ce=0.0, excluded=None)
    assert kl_t.item() == pytest.approx(expected_kl, abs=1e-6)


def test_weighted_metrics_combine_globally_plain_ones_average():
    out = reduce_metrics({"train/loss": [(2.0, 1.0), (9.0, 3.0)]}, {"train/grad_norm": [1.0, 2.0, 6.0]})
    assert out == {"train/loss": pytest.approx(11 / 4), "train/grad_norm": pytest.approx(3.0)}  # not (2 + 3) / 2


# -- the loss on a real trace: hand-worked normalisation ---------------------------------------------


def _unit_loss(objective, trace, old, weights):
    objective.live.module.zero_grad(set_to_none=True)
    stats = UpdateStats()
    units = objective.units(trace, old, weights)
    assert accumulate(units, stats, objective.denominator(trace))
    grads = {n: p.grad.clone() for n, p in objective.live.module.named_parameters() if p.grad is not None}
    return stats, grads


def test_loss_normalisation_per_objective_hand_worked():
    """At the rollout weights every ratio is 1, so (kl_beta = 0) the loss is ``-sum_i w_i A_b`` over
    the denominator: the step's action weight (grpo, dapo) or the constant ``B * G`` (dr_grpo)."""
    cfg = small_cfg("grpo.kl_beta=0", "grpo.micro_batch_size=8")
    model = load_bdlm("builtin:tiny-bdlm", cfg.model)
    model.module.requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.2, 0.7, 0.1, -2.0])
    trace = make_trace(cfg, model).with_rewards(adv.clone(), {}, adv)
    w = trace.loss_weights * torch.linspace(0.5, 1.5, trace.targets.shape[1])  # fractional token weights
    weighted = float((w * -adv[:, None]).sum())
    got = {}
    for name in ("grpo", "dapo", "dr_grpo"):
        gcfg = small_cfg("grpo.kl_beta=0", "grpo.micro_batch_size=8", f"grpo.objective={name}").grpo
        objective = TraceGRPO(gcfg, model, None)
        stats, grads = _unit_loss(objective, trace, trace.log_probs, w)
        got[name] = grads
        assert stats.sums["loss"] == pytest.approx(weighted, rel=1e-5)  # the summed surrogate
    g = trace.batch_size * (trace.targets.shape[1] - trace.prompt_length)
    assert TraceGRPO(small_cfg("grpo.objective=dr_grpo").grpo, model, frozen_copy(model)).denominator(trace) == g
    scale = float(w.sum()) / g  # dr_grpo's gradient = grpo's * (total weight / (B * G))
    for name in got["grpo"]:
        torch.testing.assert_close(got["dr_grpo"][name], got["grpo"][name] * scale, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["dapo"][name], got["grpo"][name])  # ratio 1: clip-higher changes nothing


# -- exactness and split invariance for every objective on DiffusionGemma ------------------------------


@pytest.fixture(scope="module")
def gemma():
    cfg = gemma_cfg()
    model = load_bdlm(cfg.model.name, cfg.model)
    trace = rollout(model, cfg.model, PROMPTS, torch.tensor([11] * 4 + [12] * 4), 4, torch.arange(8) // 4)
    adv = torch.linspace(-1.5, 1.5, 8)
    teacher = frozen_copy(model)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in teacher.module.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return cfg, model, trace.with_rewards(adv.clone(), {}, adv), teacher


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "opd"])
def test_each_objective_is_exact_at_the_rollout_weights_and_split_invariant(name, gemma):
    cfg, model, trace, teacher = gemma
    extra = ["grpo.teacher=unused"] if name == "opd" else []
    live = frozen_copy(model)
    live.module.requires_grad_(True)
    old = OldPolicy(live).scores(trace, 4)
    assert (old - trace.log_probs).abs().max() <= 1e-6  # replay == rollout before the first update
    gcfg = gemma_cfg(f"grpo.objective={name}", "grpo.clip_range_high=0.28", "grpo.opd_hard_ce=0.1", *extra).grpo
    first, _ = _unit_loss(TraceGRPO(gcfg, live, frozen_copy(model), teacher), trace, old, trace.loss_weights)
    assert first.sums["ratio_abs_minus_1"] == 0.0 and first.sums["approx_kl"] == 0.0
    assert math.isfinite(first.means()["train/entropy"]) and first.means()["train/entropy"] > 0
    torch.manual_seed(3)
    with torch.no_grad():
        for p in live.module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    runs = []
    for mb in (8, 2):
        gcfg.micro_batch_size = mb
        runs.append(_unit_loss(TraceGRPO(gcfg, live, frozen_copy(model), teacher), trace, old, trace.loss_weights))
    (s1, g1), (s2, g2) = runs
    assert s1.means()["train/loss"] != 0.0 and set(g1) == set(g2)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], rtol=1e-4, atol=1e-6)
    if name == "opd":
        assert s1.means()["train/distill_kl"] > 0
        assert all(p.grad is None and not p.requires_grad for p in teacher.module.parameters())


# -- runs: the teacher is never updated; the objective is recorded and checked on resume ---------------


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("obj")
    base = ["task.num_train=64", "task.num_test=8", "warm_start.batch_size=16", "grpo.steps=1",
            "grpo.prompts_per_step=2", "grpo.group_size=4", "grpo.micro_batch_size=4", "grpo.checkpoint_every=1"]
    student = warm_start(small_cfg(*base, "warm_start.steps=10"), root / "student", progress=False)
    teacher = warm_start(small_cfg(*base, "warm_start.steps=40"), root / "teacher", progress=False)
    return root, base, student, teacher


def test_opd_run_leaves_the_teacher_untouched(tiny_runs):
    root, base, student, teacher = tiny_runs
    before = weights_digest(load_bdlm(teacher))
    cfg = small_cfg(*base, "grpo.objective=opd", f"grpo.teacher={teacher}", "grpo.opd_temperature=2.0")
    result = train_grpo(cfg, root / "opd", student, resume=None, progress=False)
    m = result.metrics[0]
    assert m["train/first_approx_kl"] == 0.0 and m["train/log_prob_mean_abs_diff"] < 1e-6
    assert m["train/distill_kl"] > 0 and math.isfinite(m["train/entropy"])
    assert weights_digest(load_bdlm(teacher)) == before
    assert weights_digest(load_bdlm(result.model_dir)) != weights_digest(load_bdlm(student))
    info = json.loads((result.model_dir / "bdlm_run.json").read_text())
    assert info["objective"] == OBJECTIVES["opd"]
    state = json.loads((root / "opd" / "checkpoints" / "step-000001" / "state.json").read_text())
    assert state["metadata"]["teacher_weights_digest"] == before


def test_resume_with_another_objective_fails(tiny_runs):
    root, base, student, _ = tiny_runs
    run = root / "dapo"
    train_grpo(small_cfg(*base, "grpo.objective=dapo", "grpo.steps=2"), run, student, resume=None, stop_after=1,
               progress=False)
    state = json.loads((run / "checkpoints" / "step-000001" / "state.json").read_text())
    assert state["metadata"]["objective"] == OBJECTIVES["dapo"]
    from diffusionrl.bdlm.backend import build_grpo_loop

    loop = build_grpo_loop(small_cfg(*base, "grpo.objective=dr_grpo", "grpo.steps=2"), run, student, progress=False)
    with pytest.raises(CheckpointMismatch, match="objective"):
        loop.run(resume="auto", allow_config_change=True)


# -- dapo dynamic sampling: zero-variance groups are refilled from further batches ------------------------


def test_keep_groups_and_concat_rows_hand_worked():
    active = torch.tensor([False, False, True, True, True, True, True, True])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert keep_groups(active, groups, 2).tolist() == [False, False, True, True, True, True, False, False]
    assert keep_groups(active, groups, 9).tolist() == active.tolist()
    cfg = small_cfg()
    model = load_bdlm(cfg.model.name, cfg.model)
    a, b = make_trace(cfg, model, rows=4, mb=2), make_trace(cfg, model, rows=4, mb=2, threshold=0.3)
    assert not torch.equal(a.action_steps, b.action_steps)
    rows = torch.tensor([2, 3, 4, 5])
    got = concat_rows([a, b], rows)
    torch.testing.assert_close(got.targets, torch.cat([a.targets[2:], b.targets[:2]]))
    torch.testing.assert_close(got.action_steps, torch.cat([a.action_steps[2:], b.action_steps[:2]]))
    torch.testing.assert_close(got.seeds, torch.cat([a.seeds[2:], b.seeds[:2]]))
    with pytest.raises(ValueError, match="temperature"):
        concat_rows([a, make_trace(cfg, model, rows=4, mb=2, temperature=0.5)], rows)


class _Batches(Callback):
    def __init__(self):
        self.batches = []

    def on_step(self, loop, step, batch, metrics):
        self.batches.append(batch)


def test_dapo_refills_zero_variance_groups(tiny_runs):
    """Seed 1: both groups of the step's first batch have one reward; two refill batches bring two
    groups with variance. The learner's trace is whole rollout micro-batches of those batches, and
    replaying it gives the recorded log-probs (first approx KL 0)."""
    root, base, student, _ = tiny_runs
    seen = _Batches()
    cfg = small_cfg(*base, "grpo.objective=dapo", "grpo.seed=1", "grpo.group_size=2", "grpo.micro_batch_size=2")
    m = train_grpo(cfg, root / "dapo-refill", student, resume=None, progress=False, callbacks=[seen]).metrics[0]
    assert m["rollout/zero_std/count"] == 2 and m["rollout/dapo/refill_batches"] == 2
    assert m["rollout/active_groups"] == 2 and m["rollout/dapo/missing_groups"] == 0
    assert m["train/first_approx_kl"] == 0.0 and m["train/log_prob_mean_abs_diff"] == 0.0
    assert m["train/optimizer_steps"] == 2
    trace = seen.batches[0]
    assert trace.batch_size % 2 == 0 and bool((trace.group_ids >= REFILL_GROUP_OFFSET).all())
    # the same step without refill has nothing to learn from
    plain = small_cfg(*base, "grpo.objective=dapo", "grpo.seed=1", "grpo.group_size=2", "grpo.micro_batch_size=2",
                      "grpo.dapo_max_refills=0", "grpo.max_idle_steps=0")
    m0 = train_grpo(plain, root / "dapo-filter", student, resume=None, progress=False).metrics[0]
    assert m0["rollout/active_groups"] == 0 and m0["train/optimizer_steps"] == 0


def test_dapo_refill_stops_at_the_cap(tiny_runs):
    """Exact-match reward only (partial_weight 0): the 10-step student never gets an answer right,
    so no batch has a group with variance: the refill stops after ``dapo_max_refills`` batches,
    reports the missing groups and leaves the weights as they were."""
    root, base, student, _ = tiny_runs
    cfg = small_cfg(*base, "grpo.objective=dapo", "task.partial_weight=0", "grpo.dapo_max_refills=2",
                    "grpo.max_idle_steps=0")  # a step with nothing to learn is what this test makes
    result = train_grpo(cfg, root / "dapo-cap", student, resume=None, progress=False)
    m = result.metrics[0]
    assert m["rollout/dapo/refill_batches"] == 2 and m["rollout/dapo/missing_groups"] == 2
    assert m["rollout/active_groups"] == 0 and m["train/optimizer_steps"] == 0
    assert weights_digest(load_bdlm(result.model_dir)) == weights_digest(load_bdlm(student))


def test_concat_rows_of_diffusiongemma_traces_replays_exactly(gemma):
    """Whole micro-batches of two DiffusionGemma rollouts make one valid trace whose replay gives
    the recorded log-probs (what dapo's refill hands the learner)."""
    cfg, model, trace, _ = gemma
    other = rollout(model, cfg.model, PROMPTS, torch.tensor([21] * 4 + [22] * 4), 4, torch.arange(8) // 4 + 2)
    other = other.with_rewards(torch.zeros(8), {}, torch.zeros(8))
    rows = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11])  # the second micro-batch of each
    got = concat_rows([trace, other], rows)
    torch.testing.assert_close(got.canvases, torch.cat([trace.canvases[4:], other.canvases[:4]]))
    assert got.group_ids.tolist() == [1] * 4 + [2] * 4
    replayed = OldPolicy(model).scores(got, 4)
    committed = got.action_steps >= 0
    torch.testing.assert_close(replayed[committed], got.log_probs[committed], rtol=0, atol=1e-6)


def test_opd_without_a_teacher_is_refused_by_the_config_check():
    """It passed the config and failed after the warm start, in a traceback from the backend."""
    from diffusionrl.bdlm import load_bdlm_config
    from diffusionrl.bdlm.config import BDLMConfig
    from diffusionrl.config import ConfigError

    line = (r"grpo.objective=opd distils from a teacher, but grpo.teacher is empty; set grpo.teacher=FOLDER \(a model "
            r"folder of the same kind, e.g. a longer warm start's\), or choose another grpo.objective")
    for build in (lambda: load_bdlm_config("tiny-diffusiongemma-opd"),
                  lambda: load_bdlm_config("tiny-bdlm", ["grpo.objective=opd"], data={"grpo": {"teacher": " "}}),
                  lambda: BDLMConfig.from_dict({"grpo": {"objective": "opd"}})):  # a workflow input's road
        with pytest.raises(ConfigError, match=line) as err:
            build()
        assert "\n" not in str(err.value)
    assert load_bdlm_config("tiny-diffusiongemma-opd", ["grpo.teacher=runs/teacher"]).grpo.teacher == "runs/teacher"
