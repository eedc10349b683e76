"""Advantages and the Flow-GRPO loss on hand-worked values."""

import math

import torch

from diffusionrl.algorithms import flow_grpo_terms, group_advantages, ratio_stats


def test_group_advantages_global_std_clamp_and_zero_std_groups():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 10.0])
    groups = torch.tensor([7, 7, 9, 9, 4, 4])
    out = group_advantages(rewards, groups, global_std=True, clip_max=5.0)
    std = rewards.std(unbiased=False)
    expected = torch.tensor([-1.0, 1.0, 0.0, 0.0, -5.0, 5.0]) / (std + 1e-4)
    torch.testing.assert_close(out.advantages, expected)
    assert out.zero_std_groups == 1
    assert out.active.tolist() == [True, True, False, False, True, True]


def test_group_std_normalisation_and_clamping():
    rewards = torch.tensor([0.0, 1.0, 0.0, 100.0])
    out = group_advantages(rewards, torch.tensor([0, 0, 1, 1]), global_std=False, clip_max=0.5)
    torch.testing.assert_close(out.advantages, torch.tensor([-0.5, 0.5, -0.5, 0.5]))


def test_groups_come_from_ids_not_prompt_order():
    rewards = torch.tensor([1.0, 5.0, 3.0, 7.0])
    out = group_advantages(rewards, torch.tensor([0, 1, 0, 1]), global_std=False)
    assert out.advantages[0] < 0 < out.advantages[2] and out.advantages[1] < 0 < out.advantages[3]


def test_single_sample_groups_fall_back_to_a_batch_z_score():
    rewards = torch.tensor([1.0, 2.0, 3.0])
    out = group_advantages(rewards, torch.tensor([0, 1, 2]))
    assert out.zero_std_groups == 0 and out.active.all()
    torch.testing.assert_close(out.advantages.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)


def test_ratio_one_gives_minus_advantage_and_no_clipping():
    lp = torch.tensor([-1.2, 0.3])
    adv = torch.tensor([2.0, -1.0])
    terms = flow_grpo_terms(lp, lp.clone(), adv, clip_range=1e-4)
    torch.testing.assert_close(terms.policy_loss, -adv)
    stats = ratio_stats(lp, lp, 1e-4)
    assert float(stats["clipfrac"]) == 0.0 and float(stats["approx_kl"]) == 0.0


def test_ratio_e_is_clipped_to_one_plus_eps_for_positive_advantages():
    eps = 0.2
    new, old = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])  # ratio = e
    adv = torch.tensor([1.0, -1.0])
    terms = flow_grpo_terms(new, old, adv, clip_range=eps)
    # A > 0: max(-e, -(1 + eps)) = -(1 + eps); A < 0: max(e, 1 + eps) = e.
    torch.testing.assert_close(terms.policy_loss, torch.tensor([-(1 + eps), math.e]))
    stats = ratio_stats(new, old, eps)
    assert float(stats["clipfrac"]) == 2.0
    torch.testing.assert_close(stats["approx_kl"], torch.tensor(1.0))


def test_kl_term_uses_std_without_sqrt_dt():
    mean_new = torch.full((1, 2, 2, 2), 0.3)
    mean_ref = torch.full((1, 2, 2, 2), 0.1)
    std = torch.tensor([0.5])
    lp = torch.zeros(1)
    terms = flow_grpo_terms(lp, lp, torch.zeros(1), clip_range=1e-4, kl_beta=0.04,
                            mean_new=mean_new, mean_ref=mean_ref, std=std)
    torch.testing.assert_close(terms.kl, torch.tensor([0.04 / (2 * 0.25)]))
    torch.testing.assert_close(terms.loss, 0.04 * terms.kl)
