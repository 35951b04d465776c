"""How a Gloo or NCCL group is built, how its failures are classified, and how
it is torn down.  The communicator calls the c10d backend object directly
(``ProcessGroupGloo``/``ProcessGroupNCCL``): the Python layer of
``torch.distributed`` has no per-op deadline, the backend's option structs do.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any, Callable, Dict, FrozenSet, Mapping, Optional, Type

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

from commslayer.errors import CollectiveTimeout, CommAborted, CommError, InvalidArgument, PeerLost

# Gloo's messages when the other end of a pair went away (measured in torch 2.13).
_PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "read error",
    "write error",
    "broken pipe",
    "socket closed",
    "nccl communicator was aborted",
    "remote process exited",
)
# Gloo's messages when a peer's published address cannot be reached: its listener is gone
# (a refused connection, which Gloo retries until "Connect timeout") or the network drops it.
_UNREACHABLE = ("connect timeout", "connection refused", "no route to host", "network is unreachable")
_TIMED_OUT = ("timed out", "timeout")
# NCCL's ncclInvalidUsage: a mistake of the job's (two ranks on one GPU, say) that a retry repeats.
_MISUSE = ("invalid usage",)


def classify(exc: BaseException) -> Type[CommError]:
    """Map a backend's exception (plain ``RuntimeError`` text) to our class."""
    text = str(exc).lower()
    if any(s in text for s in _PEER_GONE) or unreachable(exc):
        return PeerLost
    if any(s in text for s in _MISUSE):
        return InvalidArgument
    if any(s in text for s in _TIMED_OUT):
        return CollectiveTimeout
    return CommError


def unreachable(exc: BaseException) -> bool:
    """Whether a backend's exception says a peer could not be reached at all (not a slow op)."""
    text = str(exc).lower()
    return any(s in text for s in _UNREACHABLE)


MAX_GLOO_THREADS = 256  # each is an OS thread; a few per group is what helps


def _gloo_threads(value: object) -> str:
    allowed = f"an integer from 1 to {MAX_GLOO_THREADS} (Gloo's worker threads)"
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(allowed)
    try:
        n = int(value)
    except ValueError:
        raise ValueError(allowed) from None
    if not 1 <= n <= MAX_GLOO_THREADS:  # 0 hangs every op until its deadline; < 0 fails inside Gloo
        raise ValueError(allowed)
    return str(n)


def _interfaces(value: object) -> str:
    have = sorted(name for _, name in socket.if_nameindex())
    allowed = f"the name of a network interface of this host, or several separated by commas (this host has: " \
              f"{', '.join(have)})"
    if not isinstance(value, str) or not all(name in have for name in value.split(",")):
        raise ValueError(allowed)
    return value


def _algorithm(value: object) -> str:
    if isinstance(value, str) and value.lower() in ("auto", "ring", "native"):
        return value.lower()
    raise ValueError("'auto', 'ring' or 'native' (the reduce-scatter algorithm: commslayer.comm.ring)")


def _switch(value: object) -> str:
    if isinstance(value, (int, str)) and value in (1, "1", 0, "0"):  # True and False are 1 and 0
        return str(int(value))
    raise ValueError("'1' or '0' (or True/False)")


class BackendSpec:
    """What the communicator needs to know about one kind of backend."""

    name: str
    device_type: str
    dtypes: FrozenSet[torch.dtype]
    untimed_waits: FrozenSet[str] = frozenset()  # backend ops whose work.wait(timeout) blocks anyway
    # Backend ops whose work completes inside a wait and takes no second one (Gloo's
    # send/recv: a second wait waits for another message and, timing out, closes
    # every connection of the group, measured).
    single_waits: FrozenSet[str] = frozenset()
    # The hints this backend takes, each with the check that turns a value into the string it uses
    # (raising ValueError that says what is allowed).
    hint_checks: Mapping[str, Callable[[object], str]] = {}

    def check_hints(self, hints: Mapping[str, object]) -> Dict[str, str]:
        """``hints`` as this backend uses them; ``ValueError`` naming the first hint that is
        unknown here or whose value is not allowed, before anything is built (a bad value
        would otherwise hang every op, or fail inside the backend with a C++ message)."""
        checked = {}
        for key, value in hints.items():
            check = self.hint_checks.get(key)
            if check is None:
                raise ValueError(f"unknown hint {key}={value!r} for the {self.name} backend; it takes: "
                                 f"{', '.join(sorted(self.hint_checks)) or 'none'}")
            try:
                checked[key] = check(value)
            except ValueError as exc:
                raise ValueError(f"hint {key}={value!r} is not allowed: {exc}") from None
        return checked

    def create(self, store: dist.Store, rank: int, size: int, timeout: timedelta, hints: Dict[str, str]):
        raise NotImplementedError

    def barrier_options(self, timeout: timedelta, device: torch.device) -> c10d.BarrierOptions:
        opts = c10d.BarrierOptions()
        opts.timeout = timeout
        return opts

    def release(self, backend) -> None:
        """Let go of a group whose generation ended (Gloo: dropping the last
        reference closes its connections, which is all it takes)."""

    @staticmethod
    def abort(backend) -> None:
        """Tear the group down so blocked peers fail fast; never raises."""
        for name in ("abort", "shutdown"):
            fn = getattr(backend, name, None)
            if fn is not None:
                try:
                    fn()
                    return
                except Exception:
                    continue


    @staticmethod
    def shutdown(backend) -> None:
        """Release a group after normal use; never raises."""
        try:
            backend.shutdown() if hasattr(backend, "shutdown") else None
        except Exception:
            pass


class Released:
    """Stands in for a backend the communicator let go of after a membership change.
    Op methods still resolve (op closures are built before the op is issued), but
    the communicator refuses a closed generation before it would call one."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise CommAborted("the backend was released after a membership change", op=name)

        return refuse


_COMMON_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
})


class GlooSpec(BackendSpec):
    name = "gloo"
    device_type = "cpu"
    dtypes = _COMMON_DTYPES
    # Gloo's reduce-scatter works ignore the timeout of wait() and block until the op ends
    # or fails (measured: a 50 ms wait returned after the op's 3 s deadline).
    untimed_waits = frozenset({"_reduce_scatter_base", "reduce_scatter"})
    single_waits = frozenset({"send", "recv", "send/recv"})
    hint_checks = {"interface": _interfaces, "threads": _gloo_threads, "reduce_scatter": _algorithm}

    def create(self, store, rank, size, timeout, hints):
        # c10d reads GLOO_SOCKET_IFNAME for the groups it builds; so do we (several hosts).
        interface = hints.get("interface") or os.environ.get("GLOO_SOCKET_IFNAME") or None
        threads = hints.get("threads")  # reduce_scatter is the communicator's (commslayer.comm.ring)
        if interface is None and threads is None:
            return c10d.ProcessGroupGloo(store, rank, size, timeout)
        opts = c10d.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._threads = int(threads) if threads is not None else 2
        if interface is not None:
            opts._devices = [c10d.ProcessGroupGloo.create_device(interface=i) for i in interface.split(",")]
        else:
            opts._devices = [c10d.ProcessGroupGloo.create_default_device()]
        return c10d.ProcessGroupGloo(store, rank, size, opts)


class NcclSpec(BackendSpec):
    name = "nccl"
    device_type = "cuda"
    dtypes = _COMMON_DTYPES | {torch.float8_e4m3fn, torch.float8_e5m2}
    hint_checks = {"high_priority_stream": _switch}

    def create(self, store, rank, size, timeout, hints):
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise CommError("the nccl backend needs CUDA and a torch built with NCCL")
        # NCCL's default error handling kills the process; recovery needs it alive:
        # CleanUpOnly (2) aborts the NCCL communicator and surfaces the error in wait().
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        opts = c10d.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.is_high_priority_stream = hints.get("high_priority_stream", "0") == "1"
        return c10d.ProcessGroupNCCL(store, rank, size, opts)

    def release(self, backend) -> None:
        """NCCL: abort the communicator, which also stops its kernels still in flight
        (a rebuilt group replaces it; ``shrink_group`` is not used yet)."""
        self.abort(backend)

    def barrier_options(self, timeout, device):
        opts = super().barrier_options(timeout, device)
        opts.device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
        return opts


SPECS: Dict[str, BackendSpec] = {"gloo": GlooSpec(), "nccl": NcclSpec()}


def resolve(backend: str, device: Optional[torch.device]) -> tuple:
    """(spec, device) for ``backend`` in ``"gloo"``, ``"nccl"``, ``"auto"``."""
    if backend == "auto":
        if device is not None:
            backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        else:
            backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in SPECS:
        raise ValueError(f"unknown backend {backend!r}: use 'gloo', 'nccl' or 'auto'")
    spec = SPECS[backend]
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if spec.device_type == "cuda" else torch.device("cpu")
    device = torch.device(device)
    if device.type != spec.device_type:
        raise ValueError(f"backend {backend!r} runs on {spec.device_type} tensors, not {device}")
    return spec, device
