"""Sharded checkpoints (FSDP: each rank writes its own part, loadable at any other world size), with
torch.distributed.checkpoint (DCP); checkpoint.py's run directory keeps one as out_dir/ckpt.dcp.

    save_sharded(path, model, optimizers, header)   collective; path is a directory name
    load_sharded(path, model, optimizers)           collective; returns the header
    load_model(path, map_location)                  one process: the header and the whole model's state dict

A sharded checkpoint is a directory written by DCP plus header.pt (everything but the tensors of
model and optimizers) and crc32.json (a CRC32 of every file, checked before anything is loaded).
`path` itself is a symlink to the directory, swapped atomically, as checkpoint.save renames a file.
DCP's .metadata is a pickle: it is read with an allow-list of the classes DCP puts there, and its
non-tensor values (the optimizers' param_groups) with weights_only=True. Failures are one line
(CheckpointError, the error of checkpoints of either layout, defined here since checkpoint.py
imports this module); out of memory is raised as it is.
"""
import io
import json
import os
import pickle
import secrets
import shutil
import warnings
import zlib

import torch

from util import UserError, first_line, fsync_dir, temp_path, write_atomic

HEADER = "header.pt"  # everything but the model's and optimizers' tensors
CRCS = "crc32.json"  # {file name: CRC32} of every other file in the directory


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupt, not one, or cannot be written; one line, says what to do."""


def _crc32(path):
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; this allows only the classes DCP puts there, so a crafted
    file cannot run code (what weights_only does for torch.load)."""

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        obj = None
        if module.split(".")[0] == "torch":  # importing torch's own modules is safe
            try:
                obj = super().find_class(module, name)
            except (ImportError, AttributeError):
                pass
        if (module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
                and isinstance(obj, type)) or (
                module == "torch" and isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))):
            return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")

    # torch.Size of shapes, _get_layout("torch.strided"), the checkpoint's path as DCP recorded it
    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
               ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}


def _metadata(path, directory):
    """DCP's .metadata of the checkpoint at path, unpickled with the allow-list, before DCP is given it: a
    payload of other classes (a crafted file, one of another torch version) is one line here, where DCP
    would log a traceback of each of its two attempts to read it before failing."""
    from torch.distributed.checkpoint.metadata import Metadata
    try:
        with open(os.path.join(directory, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except MemoryError:
        raise
    except Exception as e:  # unpickling untrusted bytes can fail with anything: none of it is a checkpoint's
        raise CheckpointError(f"{path} is not a sharded checkpoint this code can read: its .metadata does not "
                              f"unpickle to DCP's metadata ({type(e).__name__}: {first_line(e)[:200]}); it is damaged "
                              f"or of another torch (this is {torch.__version__})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} is not a sharded checkpoint this code can read: its .metadata holds a "
                              f"{type(metadata).__name__}, not DCP's metadata")
    return metadata


def _reader(directory, metadata):
    """DCP's reader of the directory, given the metadata _metadata read."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(directory)


def _planner(empty):
    """DCP's load planner, but non-tensor values (optimizer param_groups) with weights_only=True;
    empty: build the state dict from the checkpoint (its "model" part only) instead of filling one."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    class Planner(_EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            from torch.distributed.checkpoint._traverse import set_element
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner(keys={"model"}) if empty else Planner()


def _target(path, part=(0, 1)):
    """The directory a sharded checkpoint's symlink points to, checked file by file against
    crc32.json; part=(i, n): check only every n-th file from the i-th (rank i of n checks its share)."""
    if not os.path.lexists(path):
        raise CheckpointError(f"no checkpoint at {path}")
    directory = os.path.realpath(path)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{path} is not a sharded checkpoint (not a directory)")
    try:
        with open(os.path.join(directory, CRCS)) as f:
            crcs = json.load(f)
        if not isinstance(crcs, dict):
            raise ValueError("not a dict")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a sharded checkpoint of this code (no {CRCS})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is corrupt: {CRCS} is not valid JSON ({first_line(e)})") from None
    for name, crc in sorted(crcs.items())[part[0]::part[1]]:
        file = os.path.join(directory, name)
        try:
            if _crc32(file) != crc:
                raise CheckpointError(f"{path} is corrupt: {name} fails its CRC32 check; use an earlier copy "
                                      f"or start a new run")
        except FileNotFoundError:
            raise CheckpointError(f"{path} is incomplete: {name} is missing") from None
        except OSError as e:
            raise CheckpointError(f"cannot read {file}: {first_line(e)}") from None
    return directory


def save_sharded(path, model, optimizers, header):
    """Collective (every rank calls it): each rank writes its own shards of the model and the
    optimizers with DCP into a fresh directory beside path; rank 0 adds header.pt (header: a dict
    of everything else, e.g. model_args, iter_num, rng_state) and crc32.json, then points the
    symlink path at the new directory (an atomic rename) and deletes the previous one.
    A crash at any point leaves path pointing at the previous complete checkpoint."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    token = [secrets.token_hex(4) if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)  # one directory name for all ranks
    directory = os.path.join(parent, f"{name}.{token[0]}")
    state = {"model": get_model_state_dict(model),
             "optimizer": {str(i): get_optimizer_state_dict(model, o) for i, o in enumerate(optimizers)}}
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory, sync_files=True))
        if rank == 0:
            buffer = io.BytesIO()  # small (no model tensors): serialised here, written as CRCS is
            torch.save(header, buffer)
            write_atomic(os.path.join(directory, HEADER), buffer.getvalue())
            crcs = {f: _crc32(os.path.join(directory, f)) for f in sorted(os.listdir(directory))}
            write_atomic(os.path.join(directory, CRCS), json.dumps(crcs, indent=1))  # and fsyncs the directory
            old = os.path.realpath(path) if os.path.islink(path) else None
            link = temp_path(path)
            os.symlink(os.path.basename(directory), link)  # relative: out_dir can be moved
            os.replace(link, path)
            fsync_dir(parent)
            if old and old != directory and os.path.isdir(old):
                shutil.rmtree(old, ignore_errors=True)
    except (OSError, CheckpointException) as e:  # DCP gathers every rank's failure into the latter
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        causes = _causes(e) or [e]
        raise CheckpointError(f"cannot save {path}: {first_line(causes[0])}; the previous checkpoint there, "
                              f"if any, is unchanged") from None
    finally:
        if dist.is_initialized():
            dist.barrier()  # no rank goes on (or reads path) before the swap


def _causes(e):
    """The exceptions of the ranks that failed, out of DCP's CheckpointException ((exc, stack) pairs)."""
    failures = getattr(e, "failures", None) or {}
    return [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def _dcp_load(path, state, directory, empty):
    """dcp.load, its failures (which it wraps per rank) as one line; out of memory raised as is."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    metadata = _metadata(path, directory)
    try:
        import torch.distributed as dist
        if empty:  # dcp.load fills only the keys given; torch's own dcp_to_torch_save does this
            from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
            _load_state_dict(state, storage_reader=_reader(directory, metadata), planner=_planner(empty), no_dist=True)
        else:
            with warnings.catch_warnings():  # DCP warns that one process loads alone: that is the point
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
                dcp.load(state, storage_reader=_reader(directory, metadata), planner=_planner(empty),
                         no_dist=not dist.is_initialized())
    except CheckpointException as e:
        causes = _causes(e)
        for cause in causes:
            if isinstance(cause, (MemoryError, torch.OutOfMemoryError)):
                raise cause from e
        raise CheckpointError(f"cannot load {path}: {first_line(causes[0]) if causes else first_line(e)}") from None
    except (pickle.UnpicklingError, AssertionError, RuntimeError, KeyError, ValueError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise CheckpointError(f"cannot load {path}: {type(e).__name__}: {first_line(e)}") from None


def load_sharded(path, model, optimizers):
    """Collective: verify the checkpoint at path, load each rank's part of the model and the
    optimizers in place (resharded for this world size) and return the header dict."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    if dist.is_initialized():  # each rank checks its share of the files; all fail together
        try:
            directory, error = _target(path, (dist.get_rank(), dist.get_world_size())), None
        except CheckpointError as e:
            directory, error = None, str(e)
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        if any(errors):
            raise CheckpointError(next(e for e in errors if e))
    else:
        directory = _target(path)
    header = _header(path, directory)
    state = {"model": get_model_state_dict(model),
             "optimizer": {str(i): get_optimizer_state_dict(model, o) for i, o in enumerate(optimizers)}}
    _dcp_load(path, state, directory, empty=False)
    set_model_state_dict(model, state["model"])
    for i, o in enumerate(optimizers):
        set_optimizer_state_dict(model, o, state["optimizer"][str(i)])
    return header


def _header(path, directory, map_location="cpu"):
    """header.pt of the checkpoint at path (its directory checked by _target), loaded weights_only."""
    try:
        return torch.load(os.path.join(directory, HEADER), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused an object: not a checkpoint of ours
        raise CheckpointError(f"{path} is not a checkpoint this code can read: its {HEADER} holds objects that "
                              f"weights_only loading refuses ({first_line(e)[:200]})") from None
    except (OSError, RuntimeError) as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise CheckpointError(f"cannot read {os.path.join(directory, HEADER)}: {first_line(e)}") from None


def load_model(path, map_location="cpu"):
    """{"model": full state dict, **the header} of the sharded checkpoint at path, in one process,
    without the optimizers' state (what checkpoint.read gives the readers), verified first."""
    directory = _target(path)
    header = _header(path, directory, map_location)
    state = {}
    _dcp_load(path, state, directory, empty=True)
    return {**header, "model": {k: v.to(map_location) for k, v in state["model"].items()}}
