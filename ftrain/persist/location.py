"""Where a run directory is: a local path, or a URL on an object store (:class:`StoreURL`).

``s3://bucket/run``, ``gs://bucket/run``, ``memory://run``... name a directory on a store that
`fsspec <https://filesystem-spec.readthedocs.io>`_ reaches (its ``storage_options``: the
credentials, the endpoint); ``file:///abs/path`` is the local path ``/abs/path`` (the same
:class:`~pathlib.Path` as a plain path). Nothing here talks to a store: see
:mod:`ftrain.persist.store` for that.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = ["StoreURL", "Location", "is_url", "as_location", "location_key"]

_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_url(value: object) -> bool:
    """Whether ``value`` is a URL string (``scheme://...``) or a :class:`StoreURL`.

    Example:
        >>> is_url("s3://b/run"), is_url("runs/a"), is_url("C:/runs")
        (True, False, False)
    """
    return isinstance(value, StoreURL) or (isinstance(value, str) and bool(_SCHEME.match(value)))


def _options(value: Mapping[str, Any] | None) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"storage_options must be a dict of fsspec options (e.g. {{'key': ..., "
            f"'secret': ..., 'client_kwargs': {{'endpoint_url': ...}}}}), got "
            f"{type(value).__name__}."
        )
    return dict(value)


@attrs.frozen(eq=False)
class StoreURL:
    """A directory (or a file in one) on an object store: its URL and how to reach the store.

    ``storage_options``: what fsspec's filesystem for the URL's scheme takes (s3fs:
    ``key``, ``secret``, ``token``, ``client_kwargs={"endpoint_url": ...}``; default: the
    environment's credentials). ``staging_dir``: the local directory checkpoints are written
    to before their upload (default: ``$FTRAIN_STAGING_DIR`` or the system's temporary
    directory). Two are equal when their URLs are.

    Example:
        >>> run = StoreURL("s3://bucket/runs/a/", storage_options={"anon": False})
        >>> str(run / "iter_4.pth"), run.name, str(run.parent), run.protocol
        ('s3://bucket/runs/a/iter_4.pth', 'a', 's3://bucket/runs', 's3')
    """

    url: str = attrs.field(converter=lambda u: u.rstrip("/") if u.count("/") > 2 else u)
    storage_options: dict[str, Any] = attrs.field(factory=dict, converter=_options)
    staging_dir: str | None = None

    def __attrs_post_init__(self) -> None:
        if not _SCHEME.match(self.url):
            raise ValueError(f"StoreURL: {self.url!r} is not a URL (scheme://bucket/path).")

    def __str__(self) -> str:
        return self.url

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoreURL) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> StoreURL:
        return attrs.evolve(self, url=f"{self.url}/{name}")

    @property
    def protocol(self) -> str:
        """The URL's scheme: ``s3``, ``gs``, ``memory``..."""
        return _SCHEME.match(self.url).group(1).lower()  # type: ignore[union-attr]

    @property
    def name(self) -> str:
        """The last part of the path (``iter_4.pth``)."""
        return self.url.rsplit("/", 1)[-1] if self.url.count("/") > 2 else ""

    @property
    def parent(self) -> StoreURL:
        """The directory holding it."""
        if self.url.count("/") <= 2:
            return self
        return attrs.evolve(self, url=self.url.rsplit("/", 1)[0])


#: A run directory (or a checkpoint in one): a local path or a URL on a store.
Location = Path | StoreURL


def as_location(
    value: str | os.PathLike | StoreURL, storage_options: Mapping[str, Any] | None = None
) -> Location:
    """``value`` as a :class:`~pathlib.Path`, or a :class:`StoreURL` for a URL (with
    ``storage_options``, unless it is a :class:`StoreURL` already); ``file://`` URLs are paths.

    Example:
        >>> as_location("file:///tmp/run"), as_location("runs/a")
        (PosixPath('/tmp/run'), PosixPath('runs/a'))
        >>> as_location("memory://run")
        StoreURL(url='memory://run', storage_options={}, staging_dir=None)
    """
    if isinstance(value, StoreURL):
        return value
    if isinstance(value, str) and _SCHEME.match(value):
        if value.lower().startswith("file://"):
            return Path("/" + value[len("file://") :].lstrip("/"))
        return StoreURL(value, storage_options=_options(storage_options))
    return Path(value)


def location_key(value: str | os.PathLike | StoreURL) -> str:
    """One string per directory, whatever its spelling: a local path's real path, a URL.

    Example:
        >>> location_key("s3://b/run/"), location_key("file:///tmp/../tmp") == location_key("/tmp")
        ('s3://b/run', True)
    """
    where = as_location(value)
    return where.url if isinstance(where, StoreURL) else os.path.realpath(where)
