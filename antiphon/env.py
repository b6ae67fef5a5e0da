"""Every environment variable Antiphon reads, in one place.

Each function returns the variable's value or the default; nothing else in the code base calls
`os.environ` for Antiphon settings.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """ANTIPHON_CACHE_DIR: where prepared models live (default `~/.cache/antiphon`)."""
    value = os.environ.get("ANTIPHON_CACHE_DIR")
    if value:  # (a `~` no shell expanded: a systemd unit's, a Docker env file's)
        return Path(value).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # (a relative XDG_CACHE_HOME is invalid, the XDG spec says, and is ignored)
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "antiphon"


def data_dir() -> Path | None:
    """ANTIPHON_DATA_DIR: sessions database, batch files and the SSD tier (`--data-dir`
    overrides it; unset, `~/.local/share/antiphon`)."""
    value = os.environ.get("ANTIPHON_DATA_DIR")
    return Path(value).expanduser().absolute() if value else None


def api_keys() -> tuple[str, ...]:
    """ANTIPHON_API_KEYS: comma-separated API keys accepted by the server."""
    return _keys("ANTIPHON_API_KEYS")


def best_effort_api_keys() -> tuple[str, ...]:
    """ANTIPHON_BEST_EFFORT_API_KEYS: comma-separated API keys whose requests run as BE."""
    return _keys("ANTIPHON_BEST_EFFORT_API_KEYS")


def _keys(name: str) -> tuple[str, ...]:
    value = os.environ.get(name, "")
    return tuple(k.strip() for k in value.split(",") if k.strip())


def model() -> str | None:
    """ANTIPHON_MODEL: a Hugging Face model folder to serve instead of the default model."""
    return os.environ.get("ANTIPHON_MODEL") or None


def is_ci() -> bool:
    """CI: set by CI runners; tests use it to choose bounded workloads."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")
