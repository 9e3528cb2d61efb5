"""The engine's start-up output is kept for the error message and still shown."""

from __future__ import annotations

import subprocess
import sys

from .conftest import REPO, proxima_env

SCRIPT = r"""
import subprocess, sys, time
from proxima.serve.tee import OutputTee

tee = OutputTee()
with tee:
    child = subprocess.Popen([sys.executable, "-c",
        "import sys, time; print('engine says hello', flush=True); "
        "sys.stderr.write('ValueError: No available memory for the cache blocks.\\n'); "
        "sys.stderr.flush(); time.sleep(0.5); print('still running after restore', flush=True)"])
    time.sleep(0.3)
child.wait()
time.sleep(0.3)
print("CAPTURED=" + repr(tee.text()), flush=True)
"""


def test_child_output_is_forwarded_and_kept():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=proxima_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # forwarded to the real stdout / stderr, each to its own
    assert "engine says hello" in done.stdout and "still running after restore" in done.stdout
    assert "ValueError: No available memory" in done.stderr
    captured = done.stdout.split("CAPTURED=", 1)[1]
    assert "engine says hello" in captured and "No available memory" in captured
    # the child keeps writing through the pipe after the descriptors were put back
    assert "still running after restore" in captured
