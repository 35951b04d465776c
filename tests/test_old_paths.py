"""The modules' paths from before the subpackages (commslayer/old_paths.py):
each still imports, warns once naming its new path, and is the new module itself."""

import subprocess
import sys
from pathlib import Path

import pytest

from commslayer.old_paths import MOVED

ROOT = Path(__file__).resolve().parent.parent


def test_every_old_path_names_a_module_that_exists():
    for new in MOVED.values():
        assert (ROOT / (new.replace(".", "/") + ".py")).is_file(), new
    assert not [old for old in MOVED if (ROOT / (old.replace(".", "/") + ".py")).exists()]


@pytest.mark.timeout(60)
def test_an_old_path_warns_and_gives_the_new_module():
    code = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    import commslayer.redundancy as old
    from commslayer.peerjob import PeerJob
import commslayer.train.redundancy as new
from commslayer.train.peerjob import PeerJob as Same
assert old is new and PeerJob is Same, (old, new)
assert old.__spec__.name == "commslayer.train.redundancy", old.__spec__
said = [str(w.message) for w in seen if w.category is DeprecationWarning]
assert said == ["commslayer.redundancy moved to commslayer.train.redundancy; the old path goes in the next release",
                "commslayer.peerjob moved to commslayer.train.peerjob; the old path goes in the next release"], said
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.timeout(60)
def test_an_old_path_fails_where_deprecations_are_errors():
    out = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", "import commslayer.launcher"],
                         cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert out.returncode != 0 and "commslayer.launcher moved to commslayer.run.launcher" in out.stderr, out.stderr
