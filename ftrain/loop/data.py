"""Where a run is in its data: each epoch's opening (reseed, skip, restore) and the position
checkpoints record.

A loader with ``state_dict``/``load_state_dict`` (torchdata's ``StatefulDataLoader``) has
its position saved and restored; any other iterable is re-read up to the saved position,
with the random generators as when its epoch began. Taking the position never changes the
data order: the loader's ``state_dict()`` is called only on an iterator of the current epoch
the loop opened. On a loader that has none (a resumed run before its epoch opens) it would
start one, fixing the epoch's order before the loop reseeds the loader; the loop answers
from what it knows instead.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from ftrain.persist.rng import capture_rng, restore_rng

__all__ = ["DataPosition", "set_epoch", "generators"]


def _parts(data: Any) -> list[Any]:
    """The loader, its sampler, batch sampler and the batch sampler's sampler (deduplicated)."""
    batch_sampler = getattr(data, "batch_sampler", None)
    objs = (data, getattr(data, "sampler", None), batch_sampler)
    objs += (getattr(batch_sampler, "sampler", None),)
    return list({id(o): o for o in objs if o is not None}.values())


def set_epoch(data: Any, epoch: int) -> None:
    """``set_epoch`` on a distributed sampler wherever the loader keeps it."""
    for obj in _parts(data):
        if hasattr(obj, "set_epoch"):
            obj.set_epoch(epoch)


def generators(data: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a loader shuffles with (deduplicated).

    Example:
        >>> import torch
        >>> g = torch.Generator()
        >>> loader = torch.utils.data.DataLoader(range(4), shuffle=True, generator=g)
        >>> generators(loader) == [g]
        True
    """
    gens = (getattr(obj, "generator", None) for obj in _parts(data))
    return list({id(g): g for g in gens if isinstance(g, torch.Generator)}.values())


class DataPosition:
    """The loop's data and where the run is in it: ``batch`` micro-batches of the current
    epoch reached the step.

    Example:
        >>> pos = DataPosition([1, 2, 3], reseed=True)
        >>> pos.begin(0); it = pos.open(); next(it), pos.in_epoch
        (1, True)
    """

    def __init__(self, data: Iterable[Any], *, reseed: bool) -> None:
        self.data = data
        self.reseed = reseed
        self.loads = hasattr(data, "load_state_dict")
        #: The open iterator of the current epoch (``None`` between epochs).
        self.it: Iterator[Any] | None = None
        #: Micro-batches of the current epoch that reached the step.
        self.batch = 0
        self.seed: int | None = None  # the loader's shuffling seed (reseed: seed + epoch)
        self.exhausted = False  # the epoch's data ran out; its end is under way
        self.resume_in_epoch = False  # the next opening continues an epoch under way
        self.resume_at_end = False  # resumed after the epoch's data ran out: end it first
        self.epoch_rng: dict[str, Any] | None = None  # the RNG when a plain iterable's epoch began
        self._dead = False  # a generator died in next(): re-read it up to the position
        self._known: Any = None  # the loader's position while no iterator of ours is open
        self._skip = 0  # batches to re-read at the next opening

    @property
    def in_epoch(self) -> bool:
        """Whether an epoch is under way (its data opened, or a resumed epoch to continue)."""
        return self.it is not None or self.resume_in_epoch

    @property
    def batches_per_epoch(self) -> int | None:
        """``len(data)`` when the data has a usable length, else ``None``."""
        try:
            n = len(self.data)  # type: ignore[arg-type]
        except Exception:  # no __len__, or an IterableDataset loader that raises
            return None
        return n if isinstance(n, int) and n > 0 else None

    # ------------------------------------------------------------ each epoch
    def begin(self, epoch: int) -> None:
        """Before ``EpochBegin``: the sampler's epoch, the loader's seed, the count."""
        set_epoch(self.data, epoch)
        if self._dead:
            self._dead = False
            if not self.loads:
                self._skip = self.batch
        resuming = self.resume_in_epoch
        if self.reseed and (not resuming or self._skip):
            self._reseed(epoch)
        if not resuming:
            self.batch = 0

    def open(self) -> Iterator[Any]:
        """After ``EpochBegin``: ``iter(data)``; for a plain iterable resumed mid-epoch, the
        batches already trained on are re-read."""
        self.it = self._open()
        self.resume_in_epoch = False
        return self.it

    def _open(self) -> Iterator[Any]:
        skip, self._skip = self._skip, 0
        if self.loads:
            self.epoch_rng = None  # the loader restores its own position
            return iter(self.data)
        if not skip:
            self.epoch_rng = capture_rng()  # what a resumed run replays this epoch's order with
            return iter(self.data)
        # Re-read from the epoch's start with the generators as they were then (a
        # DataLoader without a generator shuffles from the global RNG), then put back.
        now = capture_rng() if self.epoch_rng is not None else None
        try:
            if self.epoch_rng is not None:
                restore_rng(self.epoch_rng)
            it = iter(self.data)
            next(itertools.islice(it, skip - 1, None), None)
        finally:
            if now is not None:
                restore_rng(now)
        return it

    def ran_out(self) -> None:
        """The epoch's data ran out: keep the loader's position (while its iterator is open)."""
        if self.it is not None and self.loads:
            self._known = self.data.state_dict()  # type: ignore[attr-defined]
        self.exhausted = True

    def end(self) -> None:
        """The epoch ended."""
        self.it = None
        self.batch = 0
        self.exhausted = False

    def failed(self) -> None:
        """``next(data)`` raised (Ctrl-C while loading): a dead generator is re-opened and
        re-read up to the position on the next iteration."""
        it = self.it
        if it is None or getattr(it, "gi_frame", True) is not None:
            return  # not a generator, or one still alive
        self.it = None
        self.resume_in_epoch = True
        self._dead = True

    # ------------------------------------------------------------ checkpoints
    def loader_state(self) -> Any:
        """The loader's position for a checkpoint. Never changes the data order:
        ``state_dict()`` only on an open iterator of the current epoch."""
        if self.it is not None and self.loads:
            return self.data.state_dict()  # type: ignore[attr-defined]
        return self._known

    def checkpoint(self) -> tuple[dict[str, Any], Any]:
        """The position (the ``loop`` section of a checkpoint) and the loader's state."""
        position = {
            "batch_in_epoch": self.batch,
            "in_epoch": self.in_epoch,
            "exhausted": self.exhausted,
            "epoch_rng": self.epoch_rng,
            "data_seed": self.seed,
        }
        return position, self.loader_state()

    def load(self, position: Mapping[str, Any], data_state: Any) -> None:
        """Continue from a checkpoint's position: mid-epoch a loader with ``load_state_dict``
        gets its saved position; any other data is re-read up to it (with the generators as
        when the epoch began). Between epochs the loader's state is restored only if the
        loop does not reseed it."""
        in_epoch = bool(position.get("in_epoch"))
        at_end = in_epoch and bool(position.get("exhausted"))
        self.batch = int(position.get("batch_in_epoch", 0)) if in_epoch else 0
        self.seed = position.get("data_seed")
        self.epoch_rng = position.get("epoch_rng")
        self.resume_at_end, self.resume_in_epoch = at_end, in_epoch and not at_end
        self._known, self._skip = data_state, 0  # its position until an epoch opens
        self.it = None
        reseeds = self.reseed and bool(generators(self.data))
        if data_state is not None and self.loads and (self.resume_in_epoch or not reseeds):
            self.data.load_state_dict(data_state)  # type: ignore[attr-defined]
        elif self.resume_in_epoch:
            if data_state is not None:
                warnings.warn(
                    f"The checkpoint holds a data loader's position, but data has no "
                    f"load_state_dict: re-reading the epoch's first {self.batch} batches "
                    "instead (exact only if the data is read in the same order).",
                    stacklevel=5,
                )
            self._skip = self.batch

    # ------------------------------------------------------------ internal
    def _reseed(self, epoch: int) -> None:
        """Seed the loader's shuffling generator with ``seed + epoch`` (as ``DistributedSampler``
        does), so a resumed run sees the same batches, also mid-epoch."""
        gens = generators(self.data)
        if not gens:
            return
        if self.seed is None:
            self.seed = gens[0].initial_seed()
        for g in gens:
            g.manual_seed(self.seed + epoch)
