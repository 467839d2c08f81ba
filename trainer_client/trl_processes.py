"""One step gathered across training processes (``torch.distributed`` initialized, e.g.
``accelerate launch``): the process group to gather over, the gather itself, and the order in
which concurrent reward calls take their turns at it. torch is imported only when the trainer
has already initialized ``torch.distributed``.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from typing import Any


def process_group() -> Any | None:
    """The process group to gather a step over, or None when one process trains.

    torch is never imported here (the adapter needs only httpx): several processes mean the
    trainer already initialized ``torch.distributed``. Objects are gathered over gloo (CPU): the
    default group when it is gloo, else one gloo group over every rank, created on first use (all
    processes score the same steps, so all create it at the same point).

    The adapter never keeps the group beyond a call: only ``torch.distributed`` holds it (the
    gloo group created here is remembered by a weak reference), and no frame of a failed call's
    traceback refers to it (``all_gather`` looks it up itself). A group still referenced after
    the trainer's ``destroy_process_group`` is freed whenever the garbage collector reaches it,
    at exit too, where gloo's destructor can abort the process (SIGABRT, "terminate called
    without an active exception") over the error the user should have seen.
    """
    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    global _GLOO_GROUP
    group = None if _GLOO_GROUP is None else _GLOO_GROUP()
    if group is None:  # first use, or the trainer destroyed the groups and made new ones
        group = dist.new_group(backend="gloo")
        _GLOO_GROUP = weakref.ref(group)
    return group


_GLOO_GROUP: weakref.ref[Any] | None = None


class GatherTurns:
    """Tickets taken as reward calls begin, served in order at the gather: a call whose answer
    came back early waits for the calls that began before it. TRL starts its reward functions'
    calls in one order on every process (``asyncio.gather`` over its list), so every process
    gathers them in that order (in the order answers came back, rank 0 merged one function's
    rewards with rank 1's of another: wrong rewards, no error).

    Every ticket is released once its call ends, however it ends (a call cancelled before its
    gather would otherwise hold every later one, this step's and the next steps')."""

    def __init__(self) -> None:
        self.issued = 0
        self.serving = 0
        self.released: set[int] = set()
        self.waiting: dict[int, asyncio.Event] = {}

    @classmethod
    def of_loop(cls) -> GatherTurns:
        """This event loop's turns (TRL runs its reward functions on one loop)."""
        loop = asyncio.get_running_loop()
        turns = _TURNS.get(loop)
        if turns is None:
            turns = _TURNS[loop] = cls()
        return turns

    def take(self) -> int:
        """The next ticket."""
        self.issued += 1
        return self.issued - 1

    async def wait(self, ticket: int) -> None:
        """Until the calls that took the tickets before ``ticket`` have released them."""
        while self.serving != ticket:
            await self.waiting.setdefault(ticket, asyncio.Event()).wait()

    def release(self, ticket: int) -> None:
        """``ticket``'s call has ended (a second release is nothing): the next one's turn."""
        if ticket < self.serving:
            return
        self.released.add(ticket)
        while self.serving in self.released:
            self.released.discard(self.serving)
            self.serving += 1
        event = self.waiting.pop(self.serving, None)
        if event is not None:
            event.set()


_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, GatherTurns]
_TURNS = weakref.WeakKeyDictionary()


def all_gather(obj: Any) -> list[Any]:
    """``obj`` from every process of the step's group, in rank order."""
    import torch.distributed as dist

    group = process_group()
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def process_rank() -> int:
    import torch.distributed as dist

    return int(dist.get_rank())
