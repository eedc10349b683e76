"""The local engine records the Trajectory contract, reproducibly."""

import dataclasses

import numpy as np
import pytest
import torch

from diffusionrl.rollout.base import SamplingSpec
from diffusionrl.rollout.local import LocalRolloutEngine
from diffusionrl.trajectory import Trajectory, TrajectoryError

SPEC = SamplingSpec(resolution=32, num_steps=4, guidance_scale=4.5, max_sequence_length=16)


@pytest.fixture(scope="module")
def engine(tiny_adapter):
    import copy

    return LocalRolloutEngine(tiny_adapter, copy.deepcopy(tiny_adapter.transformer), micro_batch_size=2)


def _gen(engine, seeds, spec=SPEC, mask=None):
    prompts = ["a red cat", "a red cat", "a blue dog", "a blue dog"]
    return engine.generate(prompts, [0, 0, 1, 1], seeds, spec, mask)


def test_trajectory_shapes_and_recorded_schedule(engine, tiny_adapter):
    traj = _gen(engine, [1, 2, 3, 4])
    sigmas, timesteps = tiny_adapter.schedule(4)
    assert traj.latents.shape == (4, 5, 16, 4, 4) and traj.log_probs.shape == (4, 4)
    assert traj.images.shape == (4, 32, 32, 3) and traj.images.dtype == np.uint8
    assert torch.equal(traj.sigmas, sigmas) and torch.equal(traj.timesteps, timesteps)
    assert traj.sde_mask[:, :3].all() and not traj.sde_mask[:, 3].any()
    assert (traj.log_probs[:, 3] == 0).all() and (traj.log_probs[:, :3] != 0).all()
    assert traj.micro_batch_size == 2 and traj.group_ids.tolist() == [0, 0, 1, 1]


def test_same_seed_same_trajectory_different_seed_different(engine):
    a, b, c = _gen(engine, [1, 2, 3, 4]), _gen(engine, [1, 2, 3, 4]), _gen(engine, [5, 6, 7, 8])
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert not torch.allclose(a.latents[:, -1], c.latents[:, -1])
    # two samples of one group differ only by their seed
    assert not torch.allclose(a.latents[0, -1], a.latents[1, -1])


def test_ode_sampling_has_no_log_probs_and_a_window_mask_is_honoured(engine):
    traj = _gen(engine, [1, 2, 3, 4], dataclasses.replace(SPEC, sde_type="ode"))
    assert not traj.sde_mask.any() and (traj.log_probs == 0).all()
    mask = np.zeros((4, 4), dtype=bool)
    mask[:, 1] = True
    traj = _gen(engine, [1, 2, 3, 4], mask=mask)
    assert (traj.log_probs[:, 1] != 0).all() and (traj.log_probs[:, [0, 2, 3]] == 0).all()


def test_trajectory_validation_rejects_bad_shapes(engine):
    traj = _gen(engine, [1, 2, 3, 4])
    with pytest.raises(TrajectoryError, match="log_probs has shape"):
        dataclasses.replace(traj, log_probs=traj.log_probs[:, :2])
    with pytest.raises(TrajectoryError, match="group_ids"):
        dataclasses.replace(traj, group_ids=traj.group_ids.int())
    with pytest.raises(TrajectoryError, match="micro_batch_size"):
        dataclasses.replace(traj, micro_batch_size=3)
    with pytest.raises(TrajectoryError, match="non-finite"):
        bad = traj.log_probs.clone()
        bad[0, 0] = float("nan")
        dataclasses.replace(traj, log_probs=bad)
    assert isinstance(traj, Trajectory)
