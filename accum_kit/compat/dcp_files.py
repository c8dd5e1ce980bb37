"""``torch.distributed.checkpoint``'s files read as data, never as code (checked: torch 2.11 and 2.13).

FSDP2's sharded checkpoints (Accelerate's ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_0/`` and
``optimizer_0/``) are written by torch's ``FileSystemWriter``: a ``.metadata`` file and ``__<rank>_<n>.distcp``
files. torch's ``FileSystemReader`` loads ``.metadata`` with plain ``pickle.load``
(``torch/distributed/checkpoint/filesystem.py``, ``read_metadata``), and the items it stores as bytes (the
optimizer's ``param_groups`` values) with ``torch.load(..., weights_only=False)``
(``default_planner.py``, ``DefaultLoadPlanner.load_bytes``): a planted pickle in either runs on resume.
Tensor items are read with ``weights_only=True``.

Here the same files are opened safely: ``.metadata`` through :class:`MetadataUnpickler` (a
``pickle.Unpickler`` whose ``find_class`` allows only the classes a real ``.metadata`` names:
DCP's metadata dataclasses, ``_StorageInfo``, ``torch.Size``, torch dtypes and layouts, ``pathlib`` paths),
and every item the metadata locates in a ``.distcp`` file (file, offset, length) through torch's
weights-only unpickler: byte items whole, tensor items with ``map_location="meta"`` (only the item's
pickle is read, not its tensor data). The private names used: ``filesystem._StorageInfo`` (the item's place),
``filesystem._create_file_view`` and ``_StorageReaderTransforms`` (the reader's own slice and its
decompression, for checkpoints written with a stream extension such as ZStandard).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

METADATA = ".metadata"
#: classes DCP's ``.metadata`` pickles (torch 2.13: found by unpickling real FSDP2 and HSDP checkpoints of this
#: project with a recording ``find_class``), by module; torch dtypes and ``torch.Size`` are added below
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # how torch.layout pickles: the layout's name looked up in torch
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # their module in 3.13
}


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP ``.metadata`` file; any other global (a function, ``os.system``, ``builtins.eval``...)
    raises ``pickle.UnpicklingError`` before it is looked up, so nothing in the file runs."""

    def find_class(self, module: str, name: str):
        import torch

        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not a class of torch.distributed.checkpoint's "
                                     "metadata")


def read_metadata(path: Path):
    """``path`` (a ``.metadata`` file) as torch's ``Metadata``, unpickled by :class:`MetadataUnpickler`.

    Raises:
        pickle.UnpicklingError: a global outside the allowed classes (nothing was run);
        ValueError: the pickle is not a ``Metadata``; any error of a truncated or corrupt pickle.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    with open(path, "rb") as f:
        metadata = MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise ValueError(f"holds a {type(metadata).__name__}, not torch.distributed.checkpoint's Metadata")
    return metadata


def check_items(folder: Path, metadata) -> tuple[Path, str] | None:
    """Open every item ``metadata`` places in ``folder``'s ``.distcp`` files through torch's weights-only
    unpickler: a byte item as ``DefaultLoadPlanner.load_bytes`` reads it (whole), a tensor item with
    ``map_location="meta"`` (its pickle, not its data). Returns None, or ``(file, why)`` for the first item
    that cannot be read (a missing file, an item past the file's end, a pickle the unpickler refuses)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _create_file_view, _StorageReaderTransforms
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    transforms = _StorageReaderTransforms()
    by_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    for relative, items in sorted(by_file.items()):
        path = folder / relative
        if not path.is_file():
            return path, f"missing: its {METADATA} places {len(items)} items in it"
        size = path.stat().st_size
        with open(path, "rb") as f:
            for index, info in sorted(items, key=lambda item: item[1].offset):
                where = f"item {index.fqn!r}, {info.length} bytes at byte {info.offset}"
                if info.offset + info.length > size:
                    return path, f"{where}: past the end of the file ({size} bytes): truncated"
                view = transforms.transform_load_stream(None, info.transform_descriptors or (),
                                                        _create_file_view(f, info.offset, info.length))
                as_bytes = isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
                try:
                    if as_bytes:
                        torch.load(io.BytesIO(view.read(-1)), weights_only=True)
                    else:
                        stream = view if view.seekable() else io.BytesIO(view.read(-1))
                        torch.load(stream, map_location="meta", weights_only=True)
                except pickle.UnpicklingError:
                    return path, (f"{where}: not a torch state: torch's weights-only unpickler refused it, and "
                                  "nothing in it was run")
                except Exception as exc:  # noqa: BLE001 - any failure to read it is a corrupt file
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    return path, f"{where}: {type(exc).__name__}: {first[:200]}"
    return None
