"""Where ``torch.distributed.checkpoint`` (DCP) reads and writes a sharded checkpoint: a
local directory, or a prefix on an object store through DCP's own ``FsspecWriter`` /
``FsspecReader`` (every rank writes its shards straight to the store; DCP writes
``.metadata`` last).
"""

from __future__ import annotations

import os
from typing import Any

from ftrain.persist.location import Location, StoreURL, as_location

__all__ = ["dcp_storage", "dcp_reader"]


def dcp_storage(op: str, path: str | os.PathLike | Location) -> dict[str, Any]:
    """The arguments telling ``dcp.<op>`` (``save``, ``async_save``, ``load``) where the
    checkpoint ``path`` is: its ``checkpoint_id``, or for a URL its fsspec reader or writer.

    Example:
        >>> dcp_storage("save", "/tmp/iter_4.dcp")
        {'checkpoint_id': PosixPath('/tmp/iter_4.dcp')}
        >>> sorted(dcp_storage("load", "memory://doc/iter_4.dcp"))
        ['storage_reader']
    """
    where = as_location(path)
    if not isinstance(where, StoreURL):
        return {"checkpoint_id": where}
    # DCP's fsspec storage (torch 2.13 does not re-export it from torch.distributed.checkpoint;
    # a URL given alone as checkpoint_id would reach it without the storage_options)
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    from ftrain.persist.store import fs_options, open_store

    open_store(where)  # a missing package is named, with the extra that brings it
    # no checkpoint_id: DCP would reset the reader or writer to it, without the options
    if op == "load":
        return {"storage_reader": FsspecReader(where.url, **fs_options(where))}
    return {"storage_writer": FsspecWriter(where.url, sync_files=False, **fs_options(where))}


def dcp_reader(path: str | os.PathLike | Location) -> Any:
    """A DCP storage reader of the sharded checkpoint ``path`` (for its ``read_metadata()``)."""
    where = as_location(path)
    if isinstance(where, StoreURL):
        return dcp_storage("load", where)["storage_reader"]
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(where)
