"""Fair shares: how much of a pool of slots one tenant may hold at once.

A tenant's share is a fraction in (0, 1] (``max_generator_share``,
``max_device_share`` in services/common/tenants.py). Of a pool of ``total`` slots it
may hold :func:`share_slots` of them: ``floor(share * total)``, at least one (a tenant
is never locked out), at most ``total``.

Where each pool is:

- a generator's job slots and lowering slots (:class:`TenantSlots`, one process): a
  tenant at its share waits, even while slots are free, so a burst of jobs whose
  code hangs cannot take every slot before another tenant's job arrives;
- a backend/arch's devices (services/worker/service.py, every worker's leases in the
  ``leases`` bucket): a tenant at its share is served after the other tenants' lanes
  (work-conserving: with nothing else waiting it still gets a free device).
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
    """

    def __init__(self, total: int, share_of: Callable[[str], float], name: str = "slot") -> None:
        self.total = max(1, total)
        self.share_of = share_of
        self.name = name
        self.held: Counter[str] = Counter()
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
        """Whether a slot may be taken for ``tenant`` now."""
        return self.in_use() < self.total and not self.at_share(tenant)

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
            await self._changed.wait_for(lambda: self.free_for(tenant))
            self.take(tenant)
        try:
            yield
        finally:
            self.give_back(tenant)
