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
which does the same (``why_not`` says why).  Nor is a module loaded that another
user could have planted or changed (a file not this user's, or writable by others,
or in a directory others may write), or that is cut short (a truncated module
would fault with SIGBUS inside the loader): those too take the Python path.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import stat
import struct
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


def compile_command(name: str, output: str, source: str = SOURCE) -> List[str]:
    """One ``c++`` command that compiles ``source`` and links it, as module ``name``, against this
    torch (launch/bench/bench_overhead.py builds a probe backend with it too)."""
    # Here, not at the top: it imports setuptools (about 70 ms), which only a build needs,
    # and every process that builds a communicator imports this module.
    import torch.utils.cpp_extension as cpp_extension

    command = [os.environ.get("CXX", "c++"), "-O2", "-fPIC", "-shared", "-std=c++20",
               f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
    for include in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]:
        command += ["-isystem", include]
    command += [source, "-o", output]
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
    if os.path.exists(path) and _elf_problem(path) is None:
        return path
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    _remove_stale_partials(os.path.dirname(path))
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} is not on PATH)")
    # named for this process, so a later build can tell a killed build's leftover from a running one
    fd, partial = tempfile.mkstemp(prefix=f"{module_name()}.{os.getpid()}.", suffix=".so.partial",
                                   dir=os.path.dirname(path))
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


def _remove_stale_partials(directory: str) -> None:
    """Remove what builds killed mid-way left (``<module>.<pid>.<random>.so.partial``
    whose process is gone); a running build's partial stays."""
    for name in os.listdir(directory):
        parts = name.split(".")
        if not (name.startswith("commslayer_direct_") and name.endswith(".so.partial") and parts[1].isdigit()):
            continue
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            os.unlink(os.path.join(directory, name))
        except PermissionError:  # alive, another user's
            pass


def _unsafe(path: str) -> Optional[str]:
    """Why loading the module at ``path`` could run code another user planted (None: it
    cannot): the file must be this user's and writable by no one else, and no directory
    above it writable by another user unless sticky (where others cannot rename or remove
    what is ours), nor owned by anyone but this user or root."""
    me = os.geteuid()
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != me:
        return f"{path} is owned by uid {st.st_uid}, not this process's uid {me}"
    if st.st_mode & 0o022:
        return f"{path} is writable by {_writers(st.st_mode)} (mode {stat.S_IMODE(st.st_mode):04o})"
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        st = os.stat(directory)
        if st.st_uid not in (me, 0):
            return f"its directory {directory} is owned by uid {st.st_uid}, not this process's uid {me} or root"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"its directory {directory} is writable by {_writers(st.st_mode)} " \
                   f"(mode {stat.S_IMODE(st.st_mode):04o}): another user could put code in its place"
        if directory == os.path.dirname(directory):
            return None
        directory = os.path.dirname(directory)


def _writers(mode: int) -> str:
    return " and ".join(who for who, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)


def _elf_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a whole 64-bit ELF file (None: it is): a truncated module
    would be mapped by the loader and fault with SIGBUS when a missing page is touched,
    so every program segment and the section table must lie inside the file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] not in (1, 2):
            return "not a 64-bit ELF file"
        order = "<" if head[5] == 1 else ">"
        phoff, shoff = struct.unpack_from(order + "QQ", head, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36)
        if phoff + phnum * phentsize > size or shoff + shnum * shentsize > size or phentsize < 56:
            return f"truncated ({size} bytes: its headers end past the end of the file)"
        f.seek(phoff)
        table = f.read(phnum * phentsize)
    for i in range(phnum):
        kind, = struct.unpack_from(order + "I", table, i * phentsize)
        offset, = struct.unpack_from(order + "Q", table, i * phentsize + 8)
        filesz, = struct.unpack_from(order + "Q", table, i * phentsize + 32)
        if kind == 1 and offset + filesz > size:  # PT_LOAD
            return f"truncated ({size} bytes; a segment ends at byte {offset + filesz})"
    return None


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
    refused = _unsafe(path)
    broken = None if refused else _elf_problem(path)
    if refused or broken:
        _why_not = f"{path} is not loaded: " + (refused or f"{broken}; `commslayer-native` builds it again")
        return None
    try:
        module = load_extension(name, path)
    except ImportError as exc:  # built against another torch, say
        _why_not = f"{path} does not load: {exc}"
        return None
    _loaded = module
    return module


def load_extension(name: str, path: str) -> ModuleType:
    """The extension module ``name`` built at ``path`` (``compile_command``), loaded
    without a place on ``sys.path``; ``ImportError`` when it does not load."""
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
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
                ids: Tuple[str, str, int], timeout: Any, wait: Any, settle: Callable[..., int]) -> Any:
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


def group_backend(rank: int, size: int, side: Any, inners: Dict[str, Any]) -> Any:
    """A c10d group's backend (``GroupBackend`` in direct_path.cpp) whose ops go to
    ``side`` (commslayer.comm.process_group's ``CommslayerGroup``) unless native code
    issues them, and those commslayer does not carry to ``inners[device type]`` (c10d's
    backends of the group's first communicators); None where there is no native path."""
    module = _module()
    return None if module is None else module.GroupBackend(rank, size, side, inners)


def ring(capacity: int, thread_names: Dict[int, str], internal_paths: Tuple[str, ...], threading_file: str) -> Any:
    """A flight recorder's ring for the records of native direct-path ops
    (``NativeRing`` in direct_path.cpp), or None where there is no native path."""
    module = _module()
    return None if module is None else module.NativeRing(capacity, thread_names, internal_paths, threading_file,
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

