"""Trajectory Parquet: one file per RL step, one row per sample (schema in docs/trajectories.md).

Written with pyarrow, readable with plain pandas (``pd.read_parquet(dir)``). The schema version
is stored in the file's key-value metadata (``diffusionrl.schema_version``) and in a column;
``read_trajectory`` reads only ``SCHEMA_VERSION``, the one ``write_step`` writes, and refuses any
other (or none) in one line naming the file. ``read_trajectories`` loads files back into
``Trajectory`` objects for offline re-scoring or analysis when the latents (and conditioning) were stored.

Every page carries a CRC32 checksum (``write_parquet``) and the readers verify it
(``read_parquet``): a file damaged in storage fails with one line naming it (``CorruptParquetFile``)
instead of giving altered latents, and so does a file whose pages have no checksum
(``UnverifiableParquetFile``: not written by ``write_parquet``, its bytes cannot be verified).
Plain pandas verifies too when asked: ``pd.read_parquet(dir, page_checksum_verification=True)``.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from diffusionrl.errors import UserError
from diffusionrl.video import png_bytes

from .batch import Conditioning, Trajectory

# The step files' schema (docs/trajectories.md): image or video samples (column ``frames_png``;
# latents [T+1, C, F', H, W]), the version write_step writes and read_trajectory reads.
SCHEMA_VERSION = 2


class CorruptParquetFile(UserError):
    """A step file cannot be read back intact (failed page checksum, truncated or damaged file)."""

    kind = "damaged file"


class UnverifiableParquetFile(CorruptParquetFile):
    """A Parquet file whose pages carry no checksum: its bytes cannot be verified."""

    kind = "unverifiable file"


def write_parquet(table: pa.Table, path: str | Path) -> Path:
    """Write ``table`` to ``path`` atomically (a temporary file, then a rename), every page checksummed.

    Only string columns are dictionary-encoded (run id, prompt, SDE type, metadata repeat within a
    step); pyarrow's default tries a dictionary on every column and gives up on the float tensors
    and PNG bytes only after building one: slower, and a larger file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    strings = [f.name for f in table.schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
    pq.write_table(table, tmp, write_page_checksum=True, use_dictionary=strings)
    tmp.replace(path)
    return path


def step_of(path: str | Path) -> int | None:
    """The step number of a ``step-XXXXXX.parquet`` file name (None for other names)."""
    stem = Path(path).name.removesuffix(".parquet")
    return int(stem[5:]) if stem.startswith("step-") and stem[5:].isdigit() else None


def _page_checksummed(path: str | Path, meta: pq.FileMetaData) -> bool:
    """Whether the file's first page header carries a CRC32 (every page of a file is written with one setting).
    The header is Thrift compact: fields 1-3 are i32 (a byte ``0x15`` then a varint each), the CRC is field 4."""
    if meta.num_row_groups == 0 or meta.num_columns == 0:
        return True  # no page to verify
    chunk = meta.row_group(0).column(0)
    with open(path, "rb") as fh:
        fh.seek(chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset)
        header = fh.read(64)
    field, i = 0, 0
    while i < len(header) and header[i]:
        delta, kind = header[i] >> 4, header[i] & 0x0F
        field += delta
        if field == 4:
            return True
        if delta == 0 or kind != 5 or field > 4:  # a long-form field id, or a field past the CRC's
            return False
        i += 1
        while i < len(header) and header[i] & 0x80:  # the i32's varint
            i += 1
        i += 1
    return False


def read_parquet(path: str | Path) -> pa.Table:
    """Read a whole file, verifying its page checksums; damage raises ``CorruptParquetFile``
    (one line: the file, its step, what pyarrow found), pages without checksums ``UnverifiableParquetFile``."""
    step = step_of(path)
    where = f" (step {step})" if step is not None else ""
    try:
        table = pq.read_table(path, page_checksum_verification=True)
        checksummed = _page_checksummed(path, pq.read_metadata(path))
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except (OSError, pa.ArrowException) as exc:  # CRC mismatch, bad footer or thrift, truncated, decompression
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CorruptParquetFile(
            f"{path}{where} is corrupted and cannot be read: {reason}; restore it from a copy or move it "
            "out of the folder"
        ) from None
    if not checksummed:
        raise UnverifiableParquetFile(
            f"{path}{where} has no page checksums, so its bytes cannot be verified (write_parquet checksums every "
            "page); write it again with diffusionrl.trajectory.write_parquet or move it out of the folder")
    return table


BASE_COLUMNS = [
    "schema_version",  # int32
    "run_id",  # string
    "step",  # int64: the RL step (1-based) this rollout trained
    "policy_version",  # int64: weights version the engine sampled with
    "sample_index",  # int32: row within the step
    "group_id",  # int64
    "prompt",  # string
    "seed",  # int64
    "reward",  # float32: weighted total
    "advantage",  # float32
    "log_probs",  # list<float32> [T]: 0 at deterministic steps
    "sigmas",  # list<float32> [T+1]
    "timesteps",  # list<float32> [T]
    "sde_steps",  # list<int32>: indices of the stochastic steps
    "guidance_scale",  # float32
    "sde_type",  # string
    "noise_level",  # float32
    "micro_batch_size",  # int32: batch composition used for sampling
    "metadata_json",  # string: the prompt row's metadata as JSON
]
OPTIONAL_COLUMNS = [
    "reward_<name>",  # float32 per reward component
    "image_png",  # binary: PNG bytes of the decoded image (image models)
    "frames_png",  # list<binary>: PNG bytes of each decoded frame (video models; schema version 2)
    "latents",  # list<float32>: [T+1, C, H, W] (video: [T+1, C, F', H, W]) flattened (latent_shape gives the shape)
    "latent_shape",  # list<int32>: [T+1, C, H, W] (video: [T+1, C, F', H, W])
    "prompt_embeds",  # list<float32> + embeds_shape [S, D] (and the pooled/negative ones, the token masks
    #                   of families that pad text: prompt_embeds_mask [S] as 0/1, an editing family's
    #                   image_latents [C, h, w])
    "input_image_sha256",  # string: sha256 of the prompt row's input image (editing datasets: rows with ``image``)
    "input_image_uri",  # string (null for generated/bytes rows): where the input image was read from
    "input_image",  # binary: the input image's encoded bytes (with the images, or when it has no URI)
    "guidance_scale_2",  # float32: two experts (Wan2.2 A14B), the low-noise expert's CFG scale, where it was set
]


def _input_image_columns(meta: list[dict], images: bool) -> tuple[list[dict], dict[str, pa.Array]]:
    """The rows' input images (``image``: a ``data:`` URI, ``data/images.py``) as their own columns: the
    digest and URI always, the bytes with the images or where there is no URI to trace them by. The
    metadata JSON keeps the rest (not the bytes twice)."""
    if not any(isinstance(m.get("image"), str) for m in meta):
        return meta, {}
    data = [base64.b64decode(m["image"].partition(",")[2]) if isinstance(m.get("image"), str) else None
            for m in meta]
    keep = [d if images or not m.get("image_uri") else None for d, m in zip(data, meta)]
    cols = {
        "input_image_sha256": pa.array([m.get("image_sha256") for m in meta], pa.string()),
        "input_image_uri": pa.array([m.get("image_uri") for m in meta], pa.string()),
        "input_image": pa.array(keep, pa.binary()),
    }
    return [{k: v for k, v in m.items() if k not in ("image", "image_sha256", "image_uri")} for m in meta], cols


def _input_image_metadata(d: dict, metadata: list[dict]) -> list[dict]:
    """``_input_image_columns`` undone: each row's ``image`` (when its bytes were kept), digest and URI."""
    if "input_image_sha256" not in d:
        return metadata
    for m, digest, uri, data in zip(metadata, d["input_image_sha256"], d["input_image_uri"], d["input_image"]):
        if digest is not None:
            m["image_sha256"] = digest
        if uri is not None:
            m["image_uri"] = uri
        if data is not None:
            mime = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg"}.get(
                data[:4] if data[:4] == b"\x89PNG" else data[:3], "application/octet-stream")
            m["image"] = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    return metadata


def _flat(t: torch.Tensor) -> list[np.ndarray]:
    return [row.reshape(-1).numpy().astype(np.float32) for row in t.detach().cpu().float()]


def trajectory_table(
    traj: Trajectory, *, run_id: str, step: int, images: bool = True, latents: bool = False
) -> pa.Table:
    """One Arrow table of a scored trajectory (rewards and advantages must be set)."""
    if traj.rewards is None or traj.advantages is None:
        raise ValueError("trajectory_table needs a scored trajectory (rewards and advantages)")
    b, t = traj.batch_size, traj.num_steps
    sde_steps = [np.flatnonzero(row.numpy()).astype(np.int32) for row in traj.sde_mask]
    meta, input_cols = _input_image_columns(traj.metadata or [{}] * b, images)
    cols: dict[str, pa.Array] = {
        "schema_version": pa.array([SCHEMA_VERSION] * b, pa.int32()),
        "run_id": pa.array([run_id] * b, pa.string()),
        "step": pa.array([step] * b, pa.int64()),
        "policy_version": pa.array([traj.policy_version] * b, pa.int64()),
        "sample_index": pa.array(range(b), pa.int32()),
        "group_id": pa.array(traj.group_ids.tolist(), pa.int64()),
        "prompt": pa.array(traj.prompts, pa.string()),
        "seed": pa.array(traj.seeds.tolist(), pa.int64()),
        "reward": pa.array(traj.rewards.numpy(), pa.float32()),
        "advantage": pa.array(traj.advantages.numpy(), pa.float32()),
        "log_probs": pa.array(list(traj.log_probs.numpy()), pa.list_(pa.float32())),
        "sigmas": pa.array([traj.sigmas.numpy()] * b, pa.list_(pa.float32())),
        "timesteps": pa.array([traj.timesteps.numpy()] * b, pa.list_(pa.float32())),
        "sde_steps": pa.array(sde_steps, pa.list_(pa.int32())),
        "guidance_scale": pa.array([traj.guidance_scale] * b, pa.float32()),
        "sde_type": pa.array([traj.sde_type] * b, pa.string()),
        "noise_level": pa.array([traj.noise_level] * b, pa.float32()),
        "micro_batch_size": pa.array([traj.micro_batch_size] * b, pa.int32()),
        "metadata_json": pa.array([json.dumps(m, sort_keys=True, default=str) for m in meta], pa.string()),
    }
    cols.update(input_cols)
    if traj.guidance_scale_2 is not None:
        cols["guidance_scale_2"] = pa.array([traj.guidance_scale_2] * b, pa.float32())
    for name, values in sorted(traj.reward_components.items()):
        cols[f"reward_{name}"] = pa.array(values.numpy(), pa.float32())
    if images and traj.images is not None and traj.images.ndim == 5:  # videos: lossless PNG frames
        cols["frames_png"] = pa.array([[png_bytes(f) for f in video] for video in traj.images], pa.list_(pa.binary()))
    elif images and traj.images is not None:
        cols["image_png"] = pa.array([png_bytes(im) for im in traj.images], pa.binary())
    if latents:
        cols["latents"] = pa.array(_flat(traj.latents), pa.list_(pa.float32()))
        cols["latent_shape"] = pa.array([list(traj.latents.shape[1:])] * b, pa.list_(pa.int32()))
        cond = traj.conditioning
        for name in Conditioning.FIELDS:
            value = getattr(cond, name)
            if value is not None:
                cols[name] = pa.array(_flat(value), pa.list_(pa.float32()))
                cols[f"{name}_shape"] = pa.array([list(value.shape[1:])] * b, pa.list_(pa.int32()))
    table = pa.table(cols)
    meta_kv = {b"diffusionrl.schema_version": str(SCHEMA_VERSION).encode(), b"diffusionrl.num_steps": str(t).encode()}
    return table.replace_schema_metadata({**(table.schema.metadata or {}), **meta_kv})


def write_step(directory: str | Path, traj: Trajectory, *, run_id: str, step: int, images: bool = True,
               latents: bool = False) -> Path:
    """Write ``step-XXXXXX.parquet`` atomically; returns its path."""
    table = trajectory_table(traj, run_id=run_id, step=step, images=images, latents=latents)
    return write_parquet(table, Path(directory) / f"step-{step:06d}.parquet")


def list_step_files(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).glob("step-*.parquet"))


def _tensor(rows, shapes) -> torch.Tensor:
    return torch.stack(
        [torch.as_tensor(np.asarray(r, dtype=np.float32)).reshape(list(s)) for r, s in zip(rows, shapes)]
    )


def _mask(values: torch.Tensor | None) -> torch.Tensor | None:
    """A token mask stored as 0/1 floats -> int64, as the pipeline made it."""
    return None if values is None else values.to(torch.int64)


def read_trajectory(path: str | Path) -> Trajectory:
    """One step file back into a ``Trajectory`` (needs the optional latent/embedding columns)."""
    table = read_parquet(path)
    version = (table.schema.metadata or {}).get(b"diffusionrl.schema_version", b"none").decode()
    if version != str(SCHEMA_VERSION):
        raise ValueError(f"{path}: trajectory schema version {version} (diffusionrl.schema_version in its metadata), "
                         f"this reader reads {SCHEMA_VERSION}, the one write_step writes; write the file again with "
                         "write_step, or read it with pyarrow / pandas")
    if "latents" not in table.column_names:
        raise ValueError(
            f"{path} was written without latents; re-score it from its images (column image_png) or "
            "write trajectories with latents to rebuild Trajectory objects"
        )
    d = table.to_pydict()
    b = len(d["prompt"])
    t = len(d["timesteps"][0])
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i, steps in enumerate(d["sde_steps"]):
        mask[i, list(steps)] = True

    def emb(name):
        return _tensor(d[name], d[f"{name}_shape"]) if name in d else None

    images = None
    if "image_png" in d:
        from PIL import Image

        images = np.stack([np.asarray(Image.open(io.BytesIO(png)).convert("RGB")) for png in d["image_png"]])
    if "frames_png" in d:
        from PIL import Image

        images = np.stack([np.stack([np.asarray(Image.open(io.BytesIO(png)).convert("RGB")) for png in video])
                           for video in d["frames_png"]])
    components = {c[len("reward_"):]: torch.tensor(d[c], dtype=torch.float32) for c in d if c.startswith("reward_")}
    return Trajectory(
        prompts=list(d["prompt"]),
        group_ids=torch.tensor(d["group_id"], dtype=torch.int64),
        seeds=torch.tensor(d["seed"], dtype=torch.int64),
        sigmas=torch.tensor(d["sigmas"][0], dtype=torch.float32),
        timesteps=torch.tensor(d["timesteps"][0], dtype=torch.float32),
        sde_mask=mask,
        latents=_tensor(d["latents"], d["latent_shape"]),
        log_probs=torch.tensor(d["log_probs"], dtype=torch.float32),
        conditioning=Conditioning(*(_mask(emb(n)) if n.endswith("_mask") else emb(n) for n in Conditioning.FIELDS)),
        guidance_scale=float(d["guidance_scale"][0]),
        guidance_scale_2=float(d["guidance_scale_2"][0]) if "guidance_scale_2" in d else None,
        sde_type=d["sde_type"][0],
        noise_level=float(d["noise_level"][0]),
        micro_batch_size=int(d["micro_batch_size"][0]),
        policy_version=int(d["policy_version"][0]),
        images=images,
        rewards=torch.tensor(d["reward"], dtype=torch.float32),
        reward_components=components,
        advantages=torch.tensor(d["advantage"], dtype=torch.float32),
        metadata=_input_image_metadata(d, [json.loads(m) for m in d["metadata_json"]]),
    )


def read_trajectories(directory: str | Path) -> list[Trajectory]:
    """Every step of a run, in step order."""
    return [read_trajectory(p) for p in list_step_files(directory)]
