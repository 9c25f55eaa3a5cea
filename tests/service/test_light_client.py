"""The light client: ``import dgserve.client`` and ``dgserve generate --server`` do not import
torch, so backend services and the CLI start fast (checked in a fresh interpreter's ``sys.modules``)."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import dgserve.client
assert "torch" not in sys.modules, "import dgserve.client imported torch"
from dgserve.__main__ import main
code = main(["generate", "hello", "--server", sys.argv[1], "--max-new-tokens", "8", "--max-denoising-steps", "2",
             "--seed", "1"])
print()
print("exit", code, "torch" in sys.modules)
"""


def test_client_and_remote_cli_do_not_import_torch(server):
    r = subprocess.run([sys.executable, "-c", PROBE, server.target], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "exit 0 False", r.stdout + r.stderr
