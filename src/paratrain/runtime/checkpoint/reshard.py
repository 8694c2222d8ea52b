"""Loading a checkpoint into the layout of this run, whatever layout wrote it.

Every key is a full-model name (:mod:`.state`), and DCP stores each tensor with its global shape
and the offsets of the pieces the writing ranks held. Loading asks for the pieces *this* layout
holds (a tensor-parallel shard, an FSDP2 shard, a pipeline stage's parameters, a whole replicated
tensor) and DCP reads exactly those byte ranges: dp/tp/pp and FSDP2-or-not may all differ between
the run that saved and the run that loads.

No code is unpickled: tensor data goes through ``torch.load(weights_only=True)`` (DCP's reader),
and DCP's ``.metadata`` index, a pickle, is read by :class:`SafeReader` with an unpickler that
builds only DCP's own metadata records, ``torch.Size``, dtypes and paths. The checksums of the
completion marker are verified before either is opened.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ..comm import layer as comm
from . import state
from .store import CheckpointInfo

if TYPE_CHECKING:
    from paratrain.runtime.train import Trainer

__all__ = ["SafeReader", "read_metadata", "load_into", "load_full_model"]

_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}
_ALLOWED_MODULES = {"torch.distributed.checkpoint.metadata"}
_PATHS = {"Path": Path, "PosixPath": PosixPath, "WindowsPath": WindowsPath, "PurePosixPath": PurePosixPath,
          "PureWindowsPath": PureWindowsPath}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "pathlib" and name in _PATHS:
            return _PATHS[name]
        if (module, name) in _ALLOWED or module in _ALLOWED_MODULES:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint never holds")


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by a restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("checkpoint metadata is not a DCP Metadata record")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The checkpoint's tensors by key: DCP ``TensorStorageMetadata`` (``size``, ``properties.dtype``)."""
    return dict(SafeReader(str(path)).read_metadata().state_dict_metadata)


def load_into(trainer: Trainer, info: CheckpointInfo) -> None:
    """Load ``info`` into the trainer's parameters, AdamW state and generators (a collective:
    every rank calls it). Raises ValueError when the checkpoint does not fit this model."""
    saved = read_metadata(info.path)
    targets = state.load_targets(trainer, saved)
    dcp.load(targets, storage_reader=SafeReader(str(info.path)))
    state.apply_loaded(trainer, targets)
    comm.barrier(purpose="checkpoint_load")


def load_full_model(path: str | Path) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model, unsharded, by name (no process group needed)."""
    saved = read_metadata(path)
    out = {k.removeprefix("model/"): torch.empty(tuple(m.size), dtype=m.properties.dtype)
           for k, m in saved.items() if k.startswith("model/")}
    targets = {f"model/{k}": v for k, v in out.items()}
    with warnings.catch_warnings():  # DCP notes that it runs without a process group, as asked
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, storage_reader=SafeReader(str(path)), no_dist=True)
    return out
