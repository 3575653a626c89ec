"""Slot allocation for preallocated per-sequence state (admission control lives here)."""

from __future__ import annotations

from dflash_serve.errors import CapacityError, InvalidRequestError


class SlotAllocator:
    """Hands out slot indices 0..max_slots-1, lowest first; full means CapacityError."""

    def __init__(self, max_slots: int, what: str) -> None:
        self.max_slots = max_slots
        self.what = what
        self._free = list(range(max_slots - 1, -1, -1))
        self._open: set[int] = set()

    @property
    def num_active(self) -> int:
        return len(self._open)

    def acquire(self) -> int:
        if not self._free:
            raise CapacityError(f"all {self.max_slots} {self.what} slots are in use")
        slot = self._free.pop()
        self._open.add(slot)
        return slot

    def release(self, slot: int) -> None:
        self.check_open(slot)
        self._open.remove(slot)
        self._free.append(slot)

    def check_open(self, slot: int) -> None:
        if slot not in self._open:
            raise InvalidRequestError(f"slot {slot} is not an open {self.what} sequence")
