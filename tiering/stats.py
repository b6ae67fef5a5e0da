"""Per-tier counters: what the manager reports and `/metrics` exports."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TierStats:
    """Monotonic counters of one tier since it was opened (chunk-layers and bytes)."""

    # `get` calls that returned data or None (absent, or dropped as corrupt); the host tier's
    # are the chunk-layers turns load from it, and those they fetch from below first
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0  # payload bytes stored by `put` (not counting no-op re-puts)
    bytes_out: int = 0  # payload bytes returned by `get` (the host tier: loaded by turns)
    evictions: int = 0  # chunk-layers evicted to make room
    refused: int = 0  # `put` calls refused for capacity (everything left is pinned)
    corrupt_dropped: int = 0  # chunk-layers dropped because they failed verification
    write_failed: int = 0  # chunk-layers dropped because their write failed (a full disk)

    def reset(self) -> None:
        """Every counter back to zero."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, 0)

    def snapshot(self) -> TierStats:
        """A copy that later updates do not change."""
        return dataclasses.replace(self)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses), 0.0 before the first `get`."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0
