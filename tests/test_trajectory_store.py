"""Trajectory Parquet: a round trip, page checksums that catch a file damaged in storage, files without
checksums or of another schema version refused in one line."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from diffusionrl.trajectory import Conditioning, Trajectory
from diffusionrl.trajectory.store import (
    CorruptParquetFile,
    UnverifiableParquetFile,
    read_trajectories,
    read_trajectory,
    trajectory_table,
    write_parquet,
    write_step,
)


def scored_trajectory(b: int = 4, t: int = 3, seed: int = 0) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[:, 1] = True
    log_probs = torch.where(mask, torch.randn(b, t, generator=g), torch.zeros(b, t))
    return Trajectory(
        prompts=[f"prompt {i}" for i in range(b)],
        group_ids=torch.arange(b, dtype=torch.int64) // 2,
        seeds=torch.arange(b, dtype=torch.int64) + 100,
        sigmas=torch.linspace(1, 0, t + 1),
        timesteps=torch.linspace(1000, 250, t),
        sde_mask=mask,
        latents=torch.randn(b, t + 1, 4, 16, 16, generator=g),
        log_probs=log_probs,
        conditioning=Conditioning(torch.randn(b, 5, 8, generator=g), torch.randn(b, 6, generator=g)),
        guidance_scale=4.5,
        sde_type="sde",
        noise_level=0.7,
        micro_batch_size=2,
        policy_version=3,
        rewards=torch.rand(b, generator=g),
        reward_components={"jpeg": torch.rand(b, generator=g)},
        advantages=torch.randn(b, generator=g),
        metadata=[{"i": i} for i in range(b)],
    )


def flip_mid_column(path, column: str, n: int = 16) -> None:
    """Invert ``n`` bytes in the middle of ``column``'s data pages (after its dictionary page)."""
    meta = pq.ParquetFile(path).metadata.row_group(0)
    chunk = next(meta.column(i) for i in range(meta.num_columns)
                 if meta.column(i).path_in_schema.split(".")[0] == column)
    first = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
    mid = (chunk.data_page_offset + first + chunk.total_compressed_size) // 2
    data = bytearray(path.read_bytes())
    for i in range(mid, mid + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_round_trip_and_plain_pandas(tmp_path):
    traj = scored_trajectory()
    path = write_step(tmp_path, traj, run_id="run", step=2, images=False, latents=True)
    back = read_trajectory(path)
    for name in ("latents", "log_probs", "sigmas", "timesteps", "sde_mask", "seeds", "group_ids", "advantages"):
        assert torch.equal(getattr(back, name), getattr(traj, name)), name
    assert torch.equal(back.conditioning.prompt_embeds, traj.conditioning.prompt_embeds)
    df = pd.read_parquet(tmp_path, page_checksum_verification=True)
    assert len(df) == 4 and set(df["step"]) == {2}
    assert not list(tmp_path.glob("*.tmp"))


def test_images_round_trip_losslessly_as_rgb_png(tmp_path):
    """The PNG bytes (OpenCV's encoder) decode with plain Pillow to the very RGB pixels, channel order
    included: a pure red, green and blue image each stay what they are."""
    import io

    from PIL import Image

    traj = scored_trajectory()
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (traj.batch_size, 8, 12, 3), dtype=np.uint8)
    for k in range(3):
        images[k] = 0
        images[k, ..., k] = 255  # image k is pure red / green / blue
    traj = replace(traj, images=images)
    path = write_step(tmp_path, traj, run_id="run", step=1, latents=True)
    assert np.array_equal(read_trajectory(path).images, images)
    pngs = pd.read_parquet(path)["image_png"]
    assert all(bytes(png[:8]) == b"\x89PNG\r\n\x1a\n" for png in pngs)
    red = np.asarray(Image.open(io.BytesIO(pngs[0])))
    assert red.shape == (8, 12, 3) and (red[..., 0] == 255).all() and (red[..., 1:] == 0).all()


def test_a_corrupted_step_file_fails_naming_the_file_and_step(tmp_path):
    trajs = [scored_trajectory(seed=s) for s in range(3)]
    paths = [write_step(tmp_path, tr, run_id="run", step=s + 1, images=False, latents=True)
             for s, tr in enumerate(trajs)]
    flip_mid_column(paths[1], "latents")
    # What the checksums guard against: unverified, the damaged file reads "fine" with other latents.
    unverified = pq.read_table(paths[1]).column("latents").to_pylist()
    assert not np.array_equal(np.concatenate(unverified), trajs[1].latents.reshape(-1).numpy())
    with pytest.raises(CorruptParquetFile) as err:
        read_trajectories(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and str(paths[1]) in msg and "(step 2)" in msg and "checksum" in msg.lower()
    with pytest.raises(CorruptParquetFile, match="step-000002.parquet"):
        read_trajectory(paths[1])
    assert torch.equal(read_trajectory(paths[2]).latents, trajs[2].latents)  # the others are intact


def test_a_truncated_file_fails_in_one_line(tmp_path):
    path = write_step(tmp_path, scored_trajectory(), run_id="run", step=7, images=False, latents=True)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CorruptParquetFile) as err:
        read_trajectory(path)
    assert "\n" not in str(err.value) and "(step 7)" in str(err.value)


def test_a_file_without_page_checksums_is_refused_in_one_line(tmp_path):
    traj = scored_trajectory()
    path = tmp_path / "step-000001.parquet"
    pq.write_table(trajectory_table(traj, run_id="r", step=1, images=False, latents=True), path)  # no checksums
    with pytest.raises(UnverifiableParquetFile) as err:
        read_trajectory(path)
    assert isinstance(err.value, CorruptParquetFile) and "\n" not in str(err.value)
    assert str(err.value).startswith(f"{path} (step 1) has no page checksums, so its bytes cannot be verified")
    assert "write it again with diffusionrl.trajectory.write_parquet" in str(err.value)
    pq.write_table(pq.read_table(path), path, write_page_checksum=True, use_dictionary=True)  # dictionary pages first
    assert torch.equal(read_trajectory(path).latents, traj.latents)


def video_trajectory(b: int = 2, t: int = 3) -> Trajectory:
    """``scored_trajectory`` as videos: latents ``[B, T+1, C, F', H, W]``, frames ``[B, F, H, W, 3]``,
    and no pooled embedding (``[B, 0]``, as Wan's conditioning)."""
    base = scored_trajectory(b, t)
    g = torch.Generator().manual_seed(1)
    frames = torch.randint(0, 256, (b, 5, 8, 8, 3), generator=g).to(torch.uint8).numpy()
    return replace(base, latents=torch.randn(b, t + 1, 4, 2, 2, 2, generator=g), images=frames,
                   conditioning=Conditioning(torch.randn(b, 5, 8, generator=g), torch.zeros(b, 0)))


def test_video_samples_round_trip_in_schema_version_2(tmp_path):
    traj = video_trajectory()
    assert traj.is_video
    path = write_step(tmp_path, traj, run_id="r", step=1, latents=True)
    assert int(pq.read_schema(path).metadata[b"diffusionrl.schema_version"]) == 2
    df = pd.read_parquet(path)
    assert "frames_png" in df.columns and "image_png" not in df.columns and len(df["frames_png"][0]) == 5
    back = read_trajectory(path)
    assert torch.equal(back.latents, traj.latents) and back.latents.shape[2:] == (4, 2, 2, 2)
    assert np.array_equal(back.images, traj.images)  # PNG frames: lossless
    assert back.conditioning.pooled_embeds.shape == (2, 0)


def test_any_other_schema_version_fails_in_one_line(tmp_path):
    table = trajectory_table(scored_trajectory(), run_id="r", step=1, latents=True)
    for version in (b"1", b"3", None):
        meta = {k: v for k, v in table.schema.metadata.items() if k != b"diffusionrl.schema_version"}
        if version is not None:
            meta[b"diffusionrl.schema_version"] = version
        path = write_parquet(table.replace_schema_metadata(meta), tmp_path / "step-000001.parquet")
        shown = version.decode() if version else "none"
        with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}: trajectory schema version {shown} "
                                             r"\(diffusionrl.schema_version in its metadata\), this reader reads 2"):
            read_trajectory(path)


# -- the background writer of the train task ------------------------------------------------------------


def test_background_writer_flushes_and_verifies_at_checkpoints(tmp_path):
    from diffusionrl.trajectory import TrajectoryWriter

    writer = TrajectoryWriter(tmp_path, "run", latents=True, images=False, depth=1)
    trajs = [scored_trajectory(seed=s) for s in range(3)]
    for step, traj in enumerate(trajs[:2], start=1):
        writer.on_step(None, step, traj, {})
    writer.on_checkpoint(None, tmp_path / "ckpt")  # everything queued so far is on disk, verified
    assert [p.name for p in sorted(tmp_path.glob("step-*.parquet"))] == ["step-000001.parquet", "step-000002.parquet"]
    writer.on_step(None, 3, trajs[2], {})
    writer.on_end(None)
    for step, traj in enumerate(trajs, start=1):
        assert torch.equal(read_trajectory(tmp_path / f"step-{step:06d}.parquet").latents, traj.latents)
    assert not list(tmp_path.glob("*.tmp"))


def test_background_writer_surfaces_a_failed_write(tmp_path):
    from diffusionrl.trajectory import TrajectoryWriteError, TrajectoryWriter

    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the folder should be")
    writer = TrajectoryWriter(blocked, "run", latents=False, images=False)
    writer.on_step(None, 1, scored_trajectory(), {})
    with pytest.raises(TrajectoryWriteError, match="not-a-folder"):
        writer.on_checkpoint(None, tmp_path / "ckpt")


def test_a_step_file_that_does_not_read_back_as_written_fails_verification(tmp_path):
    from diffusionrl.trajectory import TrajectoryWriteError, verify_step_file

    path = write_step(tmp_path, scored_trajectory(), run_id="run", step=5, images=False)
    verify_step_file(path, 5, 4)
    with pytest.raises(TrajectoryWriteError, match="step 6"):
        verify_step_file(path, 6, 4)
    with pytest.raises(TrajectoryWriteError, match="rows"):
        verify_step_file(path, 5, 8)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(TrajectoryWriteError, match="does not read back"):
        verify_step_file(path, 5, 4)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_resumed_run_stops_on_an_earlier_attempts_damaged_step_file(tmp_path, damage):
    """Files an earlier attempt left are read whole (page checksums) at the resumed run's first step: a
    damaged one stops it in one line before anything is written, so it is never registered or uploaded."""
    from diffusionrl.trajectory import TrajectoryWriter

    paths = [write_step(tmp_path, scored_trajectory(seed=s), run_id="run", step=s + 1, images=False, latents=True)
             for s in range(2)]
    if damage == "truncate":
        paths[0].write_bytes(paths[0].read_bytes()[: paths[0].stat().st_size // 2])
    else:
        flip_mid_column(paths[0], "latents")
    writer = TrajectoryWriter(tmp_path, "run", latents=True, images=False)
    with pytest.raises(CorruptParquetFile) as err:
        writer.on_step(None, 3, scored_trajectory(seed=3), {})
    assert "\n" not in str(err.value) and "step-000001.parquet (step 1)" in str(err.value)
    writer.on_end(None)
    assert not (tmp_path / "step-000003.parquet").exists()
    paths[0].unlink()  # the fix the message names: the run goes on without that step's file
    writer = TrajectoryWriter(tmp_path, "run", latents=True, images=False)
    writer.on_step(None, 3, scored_trajectory(seed=3), {})
    writer.on_end(None)
    assert (tmp_path / "step-000003.parquet").exists()
