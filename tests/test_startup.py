"""Start-up without hidden side effects: the torch entry points wait for the commslayer
package through ``commslayer.startup.when_ready``, whichever of torch and commslayer a
job imports first (real interpreters, each a few seconds)."""

import os
import subprocess
import sys

import pytest

_PROBE = """
import {first}
import commslayer, torch.distributed as dist
from commslayer import startup
from tracing.record.recorder import recorder
print(startup.is_ready(), recorder() is not None, dist.Backend.backend_list.count("commslayer"))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("first", ["commslayer", "torch"])
def test_tracing_autoload_starts_the_recorder_whichever_package_is_imported_first(tmp_path, first):
    env = {**os.environ, "COMMSLAYER_TRACE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _PROBE.format(first=first)], env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "1"], (out.stdout, out.stderr)
