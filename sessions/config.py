"""Configuration of the session store."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from antiphon.configfields import doc


@dataclasses.dataclass(frozen=True)
class SessionConfig:
    data_dir: Path = doc("Directory for the sessions database (also ANTIPHON_DATA_DIR)",
                         default=Path("~/.local/share/antiphon"))
    sqlite_synchronous: str = doc(
        "SQLite synchronous mode: FULL survives power loss, NORMAL only process crashes",
        default="FULL")

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir).expanduser())
        if self.sqlite_synchronous not in ("FULL", "NORMAL"):
            raise ValueError("sqlite_synchronous must be FULL or NORMAL")

    @property
    def db_path(self) -> Path:
        return self.data_dir / "sessions.sqlite3"
