"""How the ranks agree, beside the training collectives: the loop's stop vote, arrival at a
point within a time limit, and gathering small objects on rank 0. Internal to the loop and the
saver (:mod:`ftrain.loop.signals`, :mod:`ftrain.persist`); one process: no-ops.

Example:
    >>> from ftrain._agreement import all_arrive, gather_object
    >>> gather_object({"rank": 0}), all_arrive("ready", timeout=1.0)
    ([{'rank': 0}], True)
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist

from ftrain.dist import is_main, rank, world_size


def gather_object(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 (``None`` elsewhere); ``[obj]`` alone."""
    if world_size() == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size() if is_main() else None
    tdist.gather_object(obj, out, dst=0)
    return out


def all_arrive(tag: str, timeout: float) -> bool:
    """Whether every rank calls this with the same ``tag`` within ``timeout`` seconds."""
    if world_size() == 1:
        return True
    try:
        store = tdist.distributed_c10d._get_default_store()
        store.set(f"{tag}/{rank()}", b"1")
        keys = [f"{tag}/{r}" for r in range(world_size())]
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception:  # timeout (RuntimeError / DistStoreError) or no store
        return False
    return True


_SIDE: list[Any] = []  # [default group, its gloo side group]


def side_group() -> Any:
    """One gloo group of every rank beside the default group, made once (a collective then).

    Small CPU collectives that must not wait on the GPU stream run on it (:class:`StopVote`),
    so a NCCL job needs a second group only once. Every rank must call it at the same point
    the first time. Not for collectives issued from another thread (DCP's background saves):
    gloo pairs a group's collectives by the order each rank issues them, so two threads on
    one group can pair different collectives and hang.

    Example:
        >>> import ftrain
        >>> ftrain.dist.is_distributed()   # one process: no group to make, nothing to vote on
        False
    """
    world = tdist.group.WORLD
    if not _SIDE or _SIDE[0] is not world:
        _SIDE[:] = [world, tdist.new_group(backend="gloo")]
    return _SIDE[1]


class StopVote:
    """Ranks agree, at the same update, whether any of them wants to stop (and why).

    :meth:`update` after each update: at each vote point every rank waits for the previous vote
    (an async MAX all-reduce of two integers on :func:`side_group`: no GPU sync) and launches
    the next, which also agrees how many updates until the vote after it: about
    :attr:`interval` seconds of the *slowest* rank's updates. A signal is therefore agreed
    about two intervals after it arrives. :meth:`settle` agrees at once. ``clock``: the time
    source (seconds), e.g. a fake clock in a test.

    Example:
        >>> from ftrain._agreement import StopVote
        >>> StopVote.interval   # seconds of updates between votes
        2.0
    """

    #: Seconds of updates between votes.
    interval = 2.0
    #: The most updates between votes (a clock that does not move cannot stall the vote).
    max_every = 100_000

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._group = side_group()
        self._clock = clock
        self._buf = torch.zeros(2, dtype=torch.int64)  # [signal code, -updates to next vote]
        self._work: Any = None
        self.every = 1  # updates between votes, the same on every rank
        self.votes = 0  # votes launched (all-reduces on the side group)
        self._left = 1
        self._span = 1  # updates since the last vote
        self._since: float | None = None  # when the last vote was launched

    def _proposal(self, now: float) -> int:
        """Updates in :attr:`interval` seconds at this rank's measured pace."""
        if self._since is None or now <= self._since:
            return 1
        per_update = (now - self._since) / self._span
        return min(self.max_every, max(1, int(self.interval / per_update)))

    def update(self, mine: int) -> int:
        """After each update: at a vote point the last vote's result (else 0)."""
        self._left -= 1
        if self._left:
            return 0
        now = self._clock()
        agreed = 0
        if self._work is not None:
            self._work.wait()
            agreed, slowest = self._buf.tolist()
            self.every = max(1, -slowest)  # MAX of -proposal: the smallest proposal
        proposal = self._proposal(now)
        self._since, self._span, self._left = now, self.every, self.every
        self._buf[0], self._buf[1] = mine, -proposal
        self.votes += 1
        self._work = tdist.all_reduce(
            self._buf, op=tdist.ReduceOp.MAX, group=self._group, async_op=True
        )
        return agreed

    def settle(self, mine: int) -> int:
        """Agree now (every rank calls it at the same point): the vote in flight, then ``mine``."""
        agreed = 0
        if self._work is not None:
            self._work.wait()
            agreed = int(self._buf[0])
            self._work = None
        self._buf[0], self._buf[1] = mine, 0
        self.votes += 1
        tdist.all_reduce(self._buf, op=tdist.ReduceOp.MAX, group=self._group)
        self._since = None  # a pause or the end: no update time to measure across it
        return max(agreed, int(self._buf[0]))

    def close(self) -> None:
        """Forget the vote in flight (every rank launched it when they stopped together)."""
        self._work = None
