"""Configuration of the session store."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from antiphon.configfields import check_int_fields, doc
from antiphon.sessions.store import ADVISORIES_KEPT, KV_CHAINS_KEPT


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    data_dir: Path = doc("Directory for the sessions database (also ANTIPHON_DATA_DIR)",
                         default=Path("~/.local/share/antiphon"))
    sqlite_synchronous: str = doc(
        "SQLite synchronous mode: FULL survives power loss, NORMAL only process crashes",
        default="FULL")
    kv_chains_kept: int = doc(
        "Per session, the token chains its conversation no longer extends (regenerated replies,"
        " a moved context window) whose KV the tiers may keep; older ones are erased",
        default=KV_CHAINS_KEPT)
    advisories_kept: int = doc(
        "Per session, the most recent advisories it received that the database keeps (for "
        "its detail and the dashboard); older ones are dropped as new ones come",
        default=ADVISORIES_KEPT)

    def __post_init__(self) -> None:
        check_int_fields(self)
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        if self.sqlite_synchronous not in ("FULL", "NORMAL"):
            raise ValueError("sqlite_synchronous must be FULL or NORMAL")
        if self.kv_chains_kept < 1:
            raise ValueError("kv_chains_kept must be at least 1")
        if self.advisories_kept < 1:
            raise ValueError("advisories_kept must be at least 1")

    @property
    def db_path(self) -> Path:
        return self.data_dir / "sessions.sqlite3"
