"""`python -m antiphon.bench.tier_cost` refuses unknown systems before starting any engine."""

import subprocess
import sys


def test_unknown_system_is_refused_with_the_valid_ones() -> None:
    result = subprocess.run([sys.executable, "-m", "antiphon.bench.tier_cost", "--systems",
                             "none,nvme"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "unknown systems ['nvme']; valid: none, host, ssd" in result.stderr
