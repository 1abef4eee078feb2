"""Where a run is in its data: each epoch's opening, the position checkpoints record, and
re-opening the data after a resume or after ``next(data)`` raised.

The position advances only when a batch reached the step. An epoch's data is opened in a
way that can be repeated (:class:`Opening`: the random generators, the loader's generators
and the loader state it started from), so the loop can open it again at any position: on
resume, and when reading a batch raised (a second Ctrl-C, a data error the caller caught)
and the batch being read was lost with the iterator's state. The loader's ``state_dict()``
is called only on an iterator of the current epoch the loop opened: on a loader that has
none, it would start one, fixing the order before the epoch's reseed.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs
import torch

from ftrain.persist.rng import capture_rng, restore_rng

__all__ = ["DataPosition", "Opening", "set_epoch", "generators"]


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


@attrs.frozen
class Opening:
    """How an epoch's data was opened: enough to open it again the same way.

    Attributes:
        state: the loader state loaded before ``iter(data)`` (``None``: none).
        at: micro-batches of the epoch before the opened iterator's first.
        rng: the random generators (:func:`~ftrain.persist.rng.capture_rng`) at the opening.
        gens: the states of the loader's own generators at the opening.
    """

    state: Any
    at: int
    rng: dict[str, Any]
    gens: list[torch.Tensor]


class DataPosition:
    """The loop's data and where the run is in it: ``batch`` micro-batches of the current
    epoch reached the step.

    Example:
        >>> pos = DataPosition([1, 2, 3], reseed=True)
        >>> pos.begin(0); it = pos.open(); next(it), pos.in_epoch
        (1, True)
        >>> pos.batch = 1; pos.failed()  # the next read raised: open again at batch 1
        >>> pos.begin(0); next(pos.open())
        2
    """

    def __init__(self, data: Iterable[Any], *, reseed: bool) -> None:
        self.data = data
        self.reseed = reseed
        self.loads = hasattr(data, "load_state_dict")
        self.one_shot = isinstance(data, Iterator)
        #: The open iterator of the current epoch (``None`` between epochs).
        self.it: Iterator[Any] | None = None
        #: Micro-batches of the current epoch that reached the step.
        self.batch = 0
        self.seed: int | None = None  # the loader's shuffling seed (reseed: seed + epoch)
        self.exhausted = False  # the epoch's data ran out; its end is under way
        self.resume_in_epoch = False  # the next opening continues an epoch under way
        self.resume_at_end = False  # resumed after the epoch's data ran out: end it first
        self.epoch_rng: dict[str, Any] | None = None  # the RNG at the epoch's opening
        self._epoch_gens: list[torch.Tensor] | None = None  # its loader generators (resumed)
        self._opening: Opening | None = None  # how the current epoch's data was opened
        self._broken = False  # next() raised: open again before reading on
        self._lost: str | None = None  # what a one-shot iterator lost (it cannot be re-read)
        self._known: Any = None  # the loader's position while no iterator of ours is open
        self._load: Any = None  # a loader state to load at the next opening
        self._reopen = False  # the next opening repeats the epoch's (its generators' states)
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
        resuming = self.resume_in_epoch
        if self.reseed and (not resuming or self._reopen):
            self._reseed(epoch)
        if not resuming:
            self.batch = 0

    def open(self) -> Iterator[Any]:
        """After ``EpochBegin``: ``iter(data)``, positioned at :attr:`batch`."""
        self.check_can_continue()
        if self._broken and self._opening is not None:  # next() raised: the same opening
            opening = self._opening
            skip, fresh = self.batch - opening.at, False
        else:
            skip, fresh = self._skip, not (self._skip or self._reopen)
            opening = self._first_opening(skip)
        it = self._replay(opening, skip, fresh)
        self._opening, self._broken = opening, False
        self._load, self._skip, self._reopen = None, 0, False
        self.epoch_rng = opening.rng
        self.resume_in_epoch = False
        self.it = it
        return it

    def ran_out(self) -> None:
        """The epoch's data ran out: keep the loader's position (while its iterator is open)."""
        if self.it is not None and self.loads and not self._broken:
            self._known = self.data.state_dict()  # type: ignore[attr-defined]
        self.exhausted = True

    def end(self) -> None:
        """The epoch ended."""
        self.it = None
        self.batch = 0
        self.exhausted = False

    def failed(self) -> None:
        """``next(data)`` raised: the batch being read never reached the step (the position
        stays); the data is opened again at the position before it is read on."""
        if self.one_shot:
            self._lost = (
                f"reading batch {self.batch + 1} of the epoch raised, and the data "
                f"({type(self.data).__name__}) is a one-shot iterator"
            )
        self._broken = True
        self.it = None
        self.resume_in_epoch = True

    def check_can_continue(self) -> None:
        """Raise when the data cannot continue where the run is (a one-shot iterator broke)."""
        if self._lost is not None:
            raise RuntimeError(
                f"Loop: {self._lost}: the batch it was reading is lost and it cannot be read "
                "again, so continuing would train without it. Pass data that can be read again "
                "(a list, a DataLoader, an object whose __iter__ makes a new generator), and "
                "continue from a checkpoint (resume='auto') or start the run again."
            )

    # ------------------------------------------------------------ checkpoints
    def loader_state(self) -> tuple[Any, int]:
        """The loader's position for a checkpoint, and the batches to re-read after restoring
        it. Never changes the data order: ``state_dict()`` only on an open, intact iterator."""
        if self._broken and self._opening is not None:
            return self._opening.state, self.batch - self._opening.at
        if self.it is not None and self.loads:
            return self.data.state_dict(), 0  # type: ignore[attr-defined]
        return self._known, 0

    def checkpoint(self) -> tuple[dict[str, Any], Any]:
        """The position (the ``loop`` section of a checkpoint) and the loader's state."""
        data, skip = self.loader_state()
        opening = self._opening
        position = {
            "batch_in_epoch": self.batch,
            "in_epoch": self.in_epoch,
            "exhausted": self.exhausted,
            "epoch_rng": self.epoch_rng,
            "epoch_generators": None if opening is None else opening.gens,
            "data_skip": skip,
            "data_seed": self.seed,
        }
        return position, data

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
        self._epoch_gens = position.get("epoch_generators")
        self.resume_at_end, self.resume_in_epoch = at_end, in_epoch and not at_end
        self._known, self._opening, self._broken, self._lost = data_state, None, False, None
        self._load, self._skip, self._reopen = None, 0, False
        self.it = None
        reseeds = self.reseed and bool(generators(self.data))
        if data_state is not None and self.loads and (self.resume_in_epoch or not reseeds):
            self._load, self._skip = data_state, int(position.get("data_skip", 0))
        elif self.resume_in_epoch:
            if data_state is not None:
                warnings.warn(
                    f"The checkpoint holds a data loader's position, but data has no "
                    f"load_state_dict: re-reading the epoch's first {self.batch} batches "
                    "instead (exact only if the data is read in the same order).",
                    stacklevel=5,
                )
            self._skip, self._reopen = self.batch, True  # from the epoch's start, as it began

    # ------------------------------------------------------------ internal
    def _first_opening(self, skip: int) -> Opening:
        """This epoch's opening: from a loaded state, from the epoch's start re-read with the
        generators as they were then (a resumed plain iterable), or fresh."""
        gens = [g.get_state() for g in generators(self.data)]
        if self._reopen and self.epoch_rng is not None:
            return Opening(None, self.batch - skip, self.epoch_rng, self._epoch_gens or gens)
        return Opening(self._load, self.batch - skip, capture_rng(), gens)

    def _replay(self, opening: Opening, skip: int, fresh: bool) -> Iterator[Any]:
        """``iter(data)`` as ``opening`` did, then ``skip`` batches read and dropped. The
        generators are put back after re-reading (they were where the run is); with nothing
        re-read they stay as at the opening, as the uninterrupted run had them then."""
        now = capture_rng() if skip else None
        try:
            if not fresh:
                restore_rng(opening.rng)
                for g, state in zip(generators(self.data), opening.gens):
                    g.set_state(state)
            if opening.state is not None:
                self.data.load_state_dict(opening.state)  # type: ignore[attr-defined]
            it = iter(self.data)
            if skip:
                next(itertools.islice(it, skip - 1, None), None)
        finally:
            if now is not None:
                restore_rng(now)
        return it

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
