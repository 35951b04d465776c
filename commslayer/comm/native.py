"""The direct path in native code (``direct_path.cpp``): building it, and loading it.

Why native: after a real transfer every line of Python runs with cold
caches, so a synchronous collective's checks, issue and wait cost tens of
µs of the calling thread in Python; in C++ they cost what the backend call
alone does (docs/bench/direct-path.md, "The direct path in native code").

The README's commands build it once per venv (``commslayer-native``, run by
launch/env.sh): one ``c++`` command with torch's include and library paths,
about 20 s on 2 cores.  The module's name carries a hash of the source and
of torch's version, so a stale build is never loaded, and a changed source
is built anew.  Nothing builds at run time: where the module is not built
(no compiler, or commslayer installed another way), or
``COMMSLAYER_NATIVE=0``, communicators take the pure-Python direct path,
which does the same (``why_not`` says why).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from commslayer import config

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "direct_path.cpp")
BUILD_TIMEOUT_S = 600.0  # one compile of a file that includes torch's headers: ~30 s on 2 cores

_loaded: Optional[ModuleType] = None
_why_not: Optional[str] = None  # why the module is not loaded (None: not tried yet, or loaded)


def build_dir() -> str:
    """Where this venv keeps its build: beside its packages, so each venv has its own."""
    return os.path.join(sys.prefix, "commslayer-native")


def module_name() -> str:
    """The module's name: a hash of the source, torch's version and Python's ABI in
    it, so a build of other source, or against another torch, is never loaded."""
    digest = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        digest.update(f.read())
    digest.update(f"\0{torch.__version__}\0{sysconfig.get_config_var('SOABI')}".encode())
    return f"commslayer_direct_{digest.hexdigest()[:12]}"


def module_path(directory: Optional[str] = None) -> str:
    return os.path.join(directory or build_dir(), module_name() + ".so")


def compile_command(name: str, output: str) -> List[str]:
    """One ``c++`` command that compiles and links the module against this torch."""
    # Here, not at the top: it imports setuptools (about 70 ms), which only a build needs,
    # and every process that builds a communicator imports this module.
    import torch.utils.cpp_extension as cpp_extension

    command = [os.environ.get("CXX", "c++"), "-O2", "-fPIC", "-shared", "-std=c++20",
               f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
    for include in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]:
        command += ["-isystem", include]
    command += [SOURCE, "-o", output]
    for lib in cpp_extension.library_paths():
        command += [f"-L{lib}", f"-Wl,-rpath,{lib}"]
    return command + ["-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]


def build(directory: Optional[str] = None) -> str:
    """Build the module for the current source unless it is built; its path.

    Raises ``RuntimeError`` with the compiler's words when it fails.  The module
    is written under a temporary name and renamed, so a process that loads it
    never sees half a file.
    """
    path = module_path(directory)
    if os.path.exists(path):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    fd, partial = tempfile.mkstemp(suffix=".so.partial", dir=os.path.dirname(path))
    os.close(fd)
    try:
        done = subprocess.run(compile_command(module_name(), partial), capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"the compiler failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        os.chmod(partial, 0o755)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    for name in os.listdir(os.path.dirname(path)):  # builds of older source or another torch
        if name.startswith("commslayer_direct_") and name.endswith(".so") and name != os.path.basename(path):
            os.unlink(os.path.join(os.path.dirname(path), name))
    return path


def load(directory: Optional[str] = None) -> Optional[ModuleType]:
    """The built module, or None (``why_not`` says why). Loaded once per process."""
    global _loaded, _why_not
    if _loaded is not None or _why_not is not None:
        return _loaded
    try:
        path, name = module_path(directory), module_name()
    except OSError as exc:  # installed without its source
        _why_not = f"its source is missing ({exc})"
        return None
    if not os.path.exists(path):
        _why_not = f"not built for this source ({path} is missing; `commslayer-native` builds it)"
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:  # built against another torch, say
        _why_not = f"{path} does not load: {exc}"
        return None
    _loaded = module
    return module


def why_not() -> Optional[str]:
    """Why communicators take the pure-Python direct path; None when they take the native one."""
    if not config.native():
        return "COMMSLAYER_NATIVE is off"
    load()
    return _why_not


def _module() -> Optional[ModuleType]:
    """The built module, unless ``COMMSLAYER_NATIVE`` is off."""
    return load() if config.native() else None


def direct_path(backend: Any, size: int, device_type: str, dtypes: Any, untimed: List[int],
                ids: Tuple[str, str, int], timeout: Any, wait: Any, settle: Callable[..., bool]) -> Any:
    """A communicator's native direct path (``DirectPath`` in direct_path.cpp), or
    None: ``COMMSLAYER_NATIVE`` is off, or the module is not built.

    ``untimed`` are the kinds whose backend wait ignores its timeout (Gloo's
    reduce-scatter): it runs them as the backend does, with a wait that keeps
    its timeout.  ``ids`` name the communicator in its records
    (``Communicator.trace_ids``).  ``settle`` settles an async op whose wait
    did not simply complete (``commslayer.comm.op_path.settle_native_async``)."""
    module = _module()
    if module is None:
        return None
    module.set_settle(settle)
    return module.DirectPath(backend, size, device_type, list(dtypes), untimed, ids, timeout, wait)


def ring(capacity: int, thread_names: Dict[int, str], internal_dirs: Tuple[str, ...], threading_file: str) -> Any:
    """A flight recorder's ring for the records of native direct-path ops
    (``NativeRing`` in direct_path.cpp), or None where there is no native path."""
    module = _module()
    return None if module is None else module.NativeRing(capacity, thread_names, internal_dirs, threading_file,
                                                         threading.current_thread)


def main() -> int:
    """``commslayer-native``: build the module for this venv unless it is built (the
    README's commands run it); exit 1, with the compiler's words, where it cannot."""
    try:
        path = build()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"commslayer.comm.native: not built, communicators take the pure-Python direct path: {exc}",
              file=sys.stderr)
        return 1
    print(f"commslayer.comm.native: {path}")
    return 0

