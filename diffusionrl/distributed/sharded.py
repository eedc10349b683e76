"""Sharded checkpoints (``train.checkpoint_format=sharded``): ``torch.distributed.checkpoint`` (DCP).

With the default ``gathered`` format the ranks gather the full trained tensors and optimizer states to the
driver, which writes one process's checkpoint (any world size resumes it). ``sharded`` instead has every rank
write its own shards of the training state with DCP, in parallel, so no process ever holds the whole model
and its AdamW states (what a full fine-tune of a multi-GB transformer needs). A checkpoint folder then holds
``sharded/``: one ``__<rank>_0.distcp`` file per rank (tensors only, which DCP reads with ``torch.load``'s
``weights_only`` loader) and DCP's ``.metadata``, which DCP reads with ``pickle``: a sharded checkpoint is
loaded only after the folder's manifest has verified every file's SHA-256, and only from a store the run
trusts (the gathered format has no pickle at all).

What is saved, as this process's tensors (``training_state``): the trained tensors and the optimizer's
per-parameter states under their module names (``torch.distributed.checkpoint.state_dict.get_state_dict``,
frozen base weights left out), the EMA and the objective's own groups (NFT's old policy). The optimizer's
hyper-parameters (floats, flags) go into ``state.json``. DCP reshards on load, so a sharded checkpoint resumes
on any world size, one process included (``no_dist``).

Where the ranks run on the driver's machine they read and write the checkpoint folder itself; a rank on
another machine writes into a folder of its own and returns its files, and receives the files to read.
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

OPTIM, MODEL = "optim.", "model."
# Frozen base weights stay out (and so are absent on load: not strict); DCP itself refuses a checkpoint that
# lacks a tensor the run holds.
STATE_OPTIONS = {"ignore_frozen_params": True, "flatten_optimizer_state_dict": True, "strict": False}


def _options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(**STATE_OPTIONS)


def training_state(policy, trainer, objective) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, plain)``: the tensors DCP writes for this process (DTensor shards on ranks) under
    ``model.`` / ``optim.`` / ``<group>.`` keys, and the optimizer's non-tensor entries (JSON-able)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from diffusionrl.training.objective import checkpointed_tensors

    module = policy.sharded_modules()[0]
    model_sd, optim_sd = get_state_dict(module, trainer.optimizer, options=_options())
    tensors = {MODEL + k: v for k, v in model_sd.items()}
    plain = {}
    for k, v in optim_sd.items():
        if isinstance(v, torch.Tensor):
            tensors[OPTIM + k] = v
        else:
            plain[k] = list(v) if isinstance(v, tuple) else v
    for group, values in checkpointed_tensors(trainer, objective).items():
        tensors.update({f"{group}.{k}": v for k, v in values.items()})
    return tensors, plain


def apply_training_state(policy, trainer, objective, tensors: dict[str, torch.Tensor], plain: dict[str, Any]) -> None:
    """Load what ``dcp.load`` filled into ``training_state``'s ``tensors`` (and the saved ``plain``) into the
    policy, the optimizer, the EMA and the objective."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    module = policy.sharded_modules()[0]
    model_sd = {k[len(MODEL):]: v for k, v in tensors.items() if k.startswith(MODEL)}
    optim_sd = {k[len(OPTIM):]: v for k, v in tensors.items() if k.startswith(OPTIM)}
    optim_sd.update({k: tuple(v) if k.endswith(".betas") else v for k, v in plain.items()})
    set_state_dict(module, trainer.optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_options())
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if not key.startswith((MODEL, OPTIM)):
            head, name = key.split(".", 1)
            groups.setdefault(head, {})[name] = value
    if trainer.ema is not None:
        with torch.no_grad():
            for name, value in groups.pop("ema").items():
                trainer.ema.shadow[name].copy_(value)
    loader = getattr(objective, "load_state_tensors", None)
    if loader:
        loader(groups)


@contextlib.contextmanager
def _quiet(no_dist: bool):
    """DCP warns that it assumes one process when no process group exists: here that is what was asked."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _writer(folder: Path):
    import torch.distributed.checkpoint as dcp

    return dcp.FileSystemWriter(str(folder))


def save(policy, trainer, objective, folder: str | None, no_dist: bool = False) -> tuple[dict, dict[str, bytes]]:
    """Write this process's part of a sharded checkpoint (a collective on ranks): into ``folder``, or, with
    ``folder=None`` (a rank that does not see the driver's), into a folder of its own whose files it returns.
    Returns ``(plain, files)``."""
    import torch.distributed.checkpoint as dcp

    tensors, plain = training_state(policy, trainer, objective)
    if folder is not None:
        with _quiet(no_dist):
            dcp.save(tensors, storage_writer=_writer(Path(folder)), no_dist=no_dist)
        return plain, {}
    with tempfile.TemporaryDirectory(prefix="diffusionrl-dcp-") as own:
        with _quiet(no_dist):
            dcp.save(tensors, storage_writer=_writer(Path(own)), no_dist=no_dist)
        return plain, {p.name: p.read_bytes() for p in Path(own).iterdir() if p.is_file()}


def load(policy, trainer, objective, folder: str, plain: dict, files: dict[str, bytes] | None = None,
         no_dist: bool = False) -> None:
    """Load a sharded checkpoint into this process (a collective on ranks): from ``folder``, or, where this
    process does not see it, from ``files`` (name -> bytes: the driver's copy)."""
    import torch.distributed.checkpoint as dcp

    tensors, _ = training_state(policy, trainer, objective)  # the live shards' layout, filled in place
    if files is None:
        with _quiet(no_dist):
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(folder), no_dist=no_dist)
    else:
        with tempfile.TemporaryDirectory(prefix="diffusionrl-dcp-") as own:
            for name, data in files.items():
                (Path(own) / name).write_bytes(data)
            with _quiet(no_dist):
                dcp.load(tensors, storage_reader=dcp.FileSystemReader(own), no_dist=no_dist)
    apply_training_state(policy, trainer, objective, tensors, plain)


# -- the driver's side with ranks (distributed.ranks.RankGroup) --------------------------------------------------


def sees(folder: str, listing: dict[str, int]) -> bool:
    """Whether this process sees the driver's ``folder``: every file of ``listing`` (name -> size) is there
    with its size (on ``save`` the listing is a marker file only the driver's folder holds)."""
    root = Path(folder)
    return all((root / name).is_file() and (root / name).stat().st_size == size for name, size in listing.items())


def write_from_ranks(call, folder: Path, world_size: int) -> dict[str, Any]:
    """Have the ranks write a sharded checkpoint into ``folder`` (``call(method, *args)`` runs a method on every
    rank): ranks that see it write there, the others return their files, which land there too. Returns what
    ``state.json`` records (the optimizer's hyper-parameters, the world size)."""
    import uuid

    marker = folder / f".driver-{uuid.uuid4().hex}"
    marker.write_text("")
    try:
        results = call("save_sharded", str(folder), {marker.name: 0})
    finally:
        marker.unlink()
    for _, files in results:
        for name, data in files.items():
            (folder / name).write_bytes(data)
    return {"optimizer": results[0][0], "world_size": world_size}


def load_on_ranks(call, sharded_record: dict[str, Any], put=None) -> None:
    """Have the ranks load the sharded checkpoint ``sharded_record`` describes (``load_checkpoint``'s
    ``state.sharded``): ranks that see its folder read it there, the others get its files from the driver
    through the object store (``put``, default ``ray.put``: once, only when some rank needs them)."""
    if put is None:
        import ray

        put = ray.put
    folder = Path(sharded_record["folder"])
    listing = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    files = None
    if not all(call("sees_sharded", str(folder), listing)):
        files = [put({name: (folder / name).read_bytes() for name in listing})]  # a list: not resolved on call
    call("load_sharded", str(folder), listing, sharded_record["optimizer"], files)


def read_tensors(folder: str | Path) -> dict[str, torch.Tensor]:
    """A sharded checkpoint's tensors whole, in this process, keyed as ``training_state`` writes them
    (``model.<name>``, ``optim.state.<name>.<key>``, ``ema.<name>``, ``old.<name>``): to inspect or compare one."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype)
               for k, m in reader.read_metadata().state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    with _quiet(True):
        dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors
