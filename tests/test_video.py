"""Videos as frame arrays (diffusionrl/video.py) and rewards on videos (rewards/video.py): grids of
videos are videos, GIFs keep every frame, image rewards average over frames, temporal consistency."""

import numpy as np
import pytest

from diffusionrl.rewards import MixtureReward
from diffusionrl.rewards.base import RewardResult
from diffusionrl.rewards.video import TemporalConsistencyReward, frame_difference, score_samples
from diffusionrl.trajectory import TrajectoryError
from diffusionrl.video import gif_bytes, grid, png_bytes, read_frames, save_picture, side_by_side, stacked


def videos(b=3, f=5, h=8, w=6, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (b, f, h, w, 3), dtype=np.uint8)


def test_grids_of_videos_are_videos_and_of_images_images():
    v = videos()
    row = side_by_side(v)
    assert row.shape == (5, 8, 18, 3) and np.array_equal(row[2, :, 6:12], v[1, 2])
    assert stacked([row, row]).shape == (5, 16, 18, 3)
    g = grid(v, cols=2)  # 2 rows, the empty cell black
    assert g.shape == (5, 16, 12, 3) and not g[:, 8:, 6:].any() and np.array_equal(g[:, 8:, :6], v[2])
    assert grid(v[:, 0], cols=2).shape == (16, 12, 3)  # images: the same layout without frames


def test_png_bytes_is_the_one_lossless_rgb_encoder():
    from diffusionrl.data import shape_edits
    from diffusionrl.data.images import decode_image
    from diffusionrl.trajectory import store

    image = videos(b=1, f=1, h=9, w=7)[0, 0]
    for level in (0, 1, 9):
        data = png_bytes(image, compress_level=level)
        assert data[:4] == b"\x89PNG"
        assert np.array_equal(decode_image(data), image) and np.array_equal(read_frames(data), image)
    assert shape_edits.png_bytes is png_bytes and store.png_bytes is png_bytes
    with pytest.raises(ValueError, match=r"uint8 RGB image \[H, W, 3\]"):
        png_bytes(image[..., 0])


def test_gif_keeps_every_frame_and_save_picture_picks_the_format(tmp_path):
    still = np.zeros((4, 8, 8, 3), np.uint8)
    still[:] = np.array([0, 90, 255, 30], np.uint8)[:, None, None, None]  # four distinct gray frames
    back = read_frames(gif_bytes(still))  # (PIL merges equal consecutive frames into one longer frame)
    assert back.shape == (4, 8, 8, 3) and np.array_equal(back, still)
    assert save_picture(still, tmp_path / "a.png").suffix == ".gif"
    assert save_picture(still[0], tmp_path / "b.png").suffix == ".png"
    assert read_frames(tmp_path / "b.png").shape == (8, 8, 3)


class Brightness:
    name = "brightness"

    def __call__(self, images, prompts, metadata):
        assert images.ndim == 4 and len(prompts) == len(images) == len(metadata)
        return RewardResult(images.reshape(len(images), -1).mean(axis=1) / 255.0)


def test_an_image_reward_scores_each_frame_and_averages():
    v = videos()
    result = score_samples(Brightness(), v, ["a", "b", "c"], [{}, {}, {}])
    expected = v.reshape(3, 5, -1).mean(axis=2).mean(axis=1) / 255.0
    np.testing.assert_allclose(result.scores, expected, rtol=1e-6)
    assert result.info["frames_per_sample"] == 5.0
    rewards = {"brightness": Brightness(), "temporal_consistency": TemporalConsistencyReward()}
    mixture = MixtureReward({"brightness": 2.0, "temporal_consistency": 1.0}, None, rewards=rewards)
    total, parts = mixture(v, ["a", "b", "c"], [{}, {}, {}])
    np.testing.assert_allclose(total, 2 * expected + parts["temporal_consistency"].scores, rtol=1e-6)


def test_temporal_consistency_is_zero_for_a_still_video_and_lower_for_flicker():
    still = np.repeat(videos(1, 1)[:, :1], 5, axis=1)
    flicker = still.copy()
    flicker[:, 1::2] = 255 - flicker[:, 1::2]
    scores = TemporalConsistencyReward()(np.concatenate([still, flicker]), ["a", "b"], [{}, {}]).scores
    assert scores[0] == 0.0 and scores[1] < -0.1
    assert frame_difference(flicker[0]) == pytest.approx(-float(scores[1]))
    with pytest.raises(ValueError, match="videos"):
        TemporalConsistencyReward()(still[:, 0], ["a"], [{}])


def test_trajectories_take_video_frames_but_not_other_ranks():
    from .test_trajectory_store import video_trajectory

    traj = video_trajectory()
    assert traj.images.shape == (2, 5, 8, 8, 3)
    from dataclasses import replace

    with pytest.raises(TrajectoryError, match="latents"):
        replace(traj, latents=traj.latents[..., 0, 0])  # 4-D
    with pytest.raises(TrajectoryError, match="images"):
        replace(traj, images=traj.images[:, :, :, :, :, None])
