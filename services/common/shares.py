"""Fair shares: how much of a pool of slots one tenant may hold at once.

A tenant's share is a fraction in (0, 1] (``max_generator_share``,
``max_device_share`` in services/common/tenants.py). Of a pool of ``total`` slots it
may hold :func:`share_slots` of them: ``floor(share * total)``, at least one (a tenant
is never locked out), at most ``total``.

Where each pool is:

- a generator's job slots and lowering slots (:class:`TenantSlots`, one process);
- a backend/arch's devices (services/worker/fleet.py, every worker's leases in the
  ``leases`` bucket).

In both a share is a cap: a tenant at its share waits, even while slots or devices
are free, so a burst of work that hangs cannot take every slot before another
tenant's work arrives (that work then starts at once, on a slot the cap kept free).
With ``share_borrow_idle`` (``AIKG_SHARE_BORROW_IDLE``, off by default) a tenant at
its share may take a free slot while no other tenant's work waits for one; the
other tenant's work arriving later then waits for a borrowed slot to come back,
which can be a whole run's timeout (docs/tenants.md, "Fair shares").
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import AsyncIterator, Callable


def share_slots(share: float, total: int) -> int:
    """Slots of a ``total``-slot pool a tenant with ``share`` may hold: ``floor(share *
    total)`` clamped to [1, total] (1 when ``total`` is 0)."""
    if total <= 0:
        return 1
    return max(1, min(total, math.floor(share * total + 1e-9)))


class TenantSlots:
    """A pool of ``total`` slots of which each tenant holds at most its share.

    Args:
        total: slots in the pool (>= 1).
        share_of: tenant name -> its share (a fraction in (0, 1]).
        name: what the slots are, for messages (``job``, ``lowering``).
        borrow: a tenant at its share may take a free slot while no other tenant
            below its share waits for one (``share_borrow_idle``); False: never.
    """

    def __init__(self, total: int, share_of: Callable[[str], float], name: str = "slot",
                 *, borrow: bool = False) -> None:
        self.total = max(1, total)
        self.share_of = share_of
        self.name = name
        self.borrow = borrow
        self.held: Counter[str] = Counter()
        # Tenants waiting in hold() now, with how many waits each.
        self.waiting: Counter[str] = Counter()
        self._changed = asyncio.Condition()

    def cap(self, tenant: str) -> int:
        """Slots ``tenant`` may hold at once."""
        return share_slots(self.share_of(tenant), self.total)

    def in_use(self) -> int:
        return sum(self.held.values())

    def at_share(self, tenant: str) -> bool:
        """Whether ``tenant`` holds its share (it must wait for one of its own)."""
        return self.held[tenant] >= self.cap(tenant)

    def free_for(self, tenant: str) -> bool:
        """Whether a slot may be taken for ``tenant`` now: one is free and the tenant
        is below its share, or (``borrow``) no other tenant below its share waits."""
        if self.in_use() >= self.total:
            return False
        if not self.at_share(tenant):
            return True
        return self.borrow and not any(
            other != tenant and not self.at_share(other) for other in self.waiting)

    def take(self, tenant: str) -> None:
        """Count a slot as ``tenant``'s without waiting (the caller checked
        :meth:`free_for`)."""
        self.held[tenant] += 1

    def give_back(self, tenant: str) -> None:
        """Return one of ``tenant``'s slots and wake the waiters."""
        self.held[tenant] -= 1
        if self.held[tenant] <= 0:
            del self.held[tenant]
        asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str) -> AsyncIterator[None]:
        """Hold one slot for ``tenant`` while the block runs, waiting until one is free
        and the tenant is below its share."""
        async with self._changed:
            self.waiting[tenant] += 1
            try:
                await self._changed.wait_for(lambda: self.free_for(tenant))
            finally:
                self.waiting[tenant] -= 1
                if self.waiting[tenant] <= 0:
                    del self.waiting[tenant]
                # One waiter fewer can let a borrower in (a cancelled wait).
                self._changed.notify_all()
            self.take(tenant)
        try:
            yield
        finally:
            self.give_back(tenant)
