"""Idle HTTP connections stay open for `keep_alive_s`, then the server closes them."""

from __future__ import annotations

import http.client
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from antiphon.engine_ext.scripted import ScriptedEngine
from tests.conftest import scripted_config
from tests.liveserver import live_server


@pytest.mark.parametrize(("keep_alive_s", "still_open"), [(0.3, False), (10.0, True)])
def test_an_idle_connection_lasts_the_keep_alive(tmp_path: Path, keep_alive_s: float,
                                                 still_open: bool) -> None:
    config = scripted_config(tmp_path, keep_alive_s=keep_alive_s)
    with live_server(config, ScriptedEngine()) as url:
        address = urlsplit(url)
        conn = http.client.HTTPConnection(address.hostname or "", address.port, timeout=10)
        try:
            conn.request("GET", "/healthz")
            response = conn.getresponse()
            assert response.status == 200
            response.read()
            sock = conn.sock
            time.sleep(1.0)  # idle
            if still_open:
                conn.request("GET", "/healthz")
                assert conn.getresponse().status == 200
                assert conn.sock is sock  # on the same connection
            else:
                assert sock.recv(4096) == b""  # closed by the server
        finally:
            conn.close()


def test_the_keep_alive_must_be_positive() -> None:
    with pytest.raises(ValueError, match="keep_alive_s must be positive"):
        scripted_config(Path("."), keep_alive_s=0)
