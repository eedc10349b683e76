"""``sampling.same_latent``: a group's training rollouts start from one initial latent and spread only
through their SDE steps; recompute exactness and micro-batch invariance hold; evaluation never shares."""

import dataclasses

import pytest
import torch

from diffusionrl.config import ConfigError
from diffusionrl.evaluation import eval_spec
from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.batch import RolloutBatch

from .conftest import started_loop, tiny_config
from .family_checks import recompute_diff, split_rel_diff


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    cfg = tiny_config("sampling.same_latent=true", "algorithm.kl_beta=0.04")
    with started_loop(cfg, tmp_path_factory.mktemp("same")) as lp:
        yield lp


def test_a_group_shares_its_initial_latent_and_differs_after_its_sde_steps(loop, scored):
    traj, _ = scored
    groups = traj.group_ids.tolist()
    x0, final = traj.latents[:, 0], traj.latents[:, -1]
    for g in set(groups):
        idx = [i for i, h in enumerate(groups) if h == g]
        assert all(torch.equal(x0[idx[0]], x0[i]) for i in idx)  # one initial latent per group
        assert not torch.equal(final[idx[0]], final[idx[1]])  # the SDE steps spread the group
    firsts = [groups.index(g) for g in sorted(set(groups))]
    assert not torch.equal(x0[firsts[0]], x0[firsts[1]])  # groups start apart
    assert loop.backend.spec.same_latent and not eval_spec(loop.backend.cfg).same_latent


def test_the_latent_seed_is_the_groups_first_seed_whatever_the_micro_batches():
    spec = SamplingSpec(resolution=32, num_steps=4, guidance_scale=1.0, same_latent=True)
    batch = RolloutBatch.prepare(["a"] * 4, [7, 7, 3, 3], [10, 11, 12, 13], spec, None, 1)
    assert batch.latent_seeds.tolist() == [10, 10, 12, 12]
    off = RolloutBatch.prepare(["a"] * 4, [7, 7, 3, 3], [10, 11, 12, 13], dataclasses.replace(spec, same_latent=False),
                               None, 2)
    assert off.latent_seeds.tolist() == [10, 11, 12, 13]


def test_recomputed_log_probs_equal_the_rollouts_and_the_split_does_not_change_the_gradient(loop, scored):
    assert recompute_diff(loop, scored[0]) <= 1e-6
    assert split_rel_diff(loop, *scored) <= 1e-5


def test_same_latent_is_refused_where_it_cannot_mean_anything():
    with pytest.raises(ConfigError, match="ODE"):
        tiny_config("sampling.same_latent=true", preset="tiny-cpu-nft")
    with pytest.raises(ConfigError, match="same_latent is not available with sampling.engine=sglang"):
        tiny_config("sampling.same_latent=true", "sampling.engine=sglang")
