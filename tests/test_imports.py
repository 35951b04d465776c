"""The import contract (import-linter, pinned in pyproject.toml's dev extra, its
contracts under [tool.importlinter], drawn in docs/architecture.md): the packages
and commslayer's layers import only downward, the trace reader imports neither
torch nor commslayer, and no package's modules import each other in a circle."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("commslayer", "tracing", "fsdp_overlap", "faults")

pytest.importorskip("importlinter", reason="the dev extra is not installed (pip install -e '.[dev]')")


def lint_imports(where: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the packages found in ``where`` (first on the path)."""
    env = dict(os.environ, PYTHONPATH=str(where))
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache"], cwd=where, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.timeout(150)
def test_the_tree_keeps_the_import_contract():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout, out.stdout[-3000:]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("module, line, broken, named", [
    # the base layer reaching up to the launcher: an upward import and a circle
    ("commslayer/errors.py", "from commslayer.run import launcher", ["commslayer's layers", "No circle"],
     "commslayer.errors is not allowed to import commslayer.run"),
    # the viewer importing torch: it must run where torch is not installed
    ("tracing/read/viewer.py", "import torch", ["The trace reader"], "tracing.read.viewer -> torch"),
    # commslayer reaching up into tracing
    ("commslayer/comm/work.py", "import tracing.record.recorder", ["The packages, top to bottom"],
     "commslayer is not allowed to import tracing"),
])
def test_an_import_against_the_contract_fails_it(tmp_path, module, line, broken, named):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{line}  # against the contract\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0, out.stdout[-3000:]
    report = out.stdout.split("Broken contracts", 1)[-1]
    for name in broken:
        assert name in report, report[-3000:]
    assert named in " ".join(report.split()), report[-3000:]
