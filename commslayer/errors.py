"""The error hierarchy: every failure commslayer reports is a ``CommError``.

A message always says where the failure happened: the communicator, the op,
its sequence number, the timeout and elapsed time, and the ranks involved
where they are known.  Callers branch on the class; people read the message.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterable, Optional, Tuple, Type


class CommError(RuntimeError):
    """Base class of every error raised by commslayer.

    Attributes mirror the message so code can act on them: ``comm`` (name),
    ``op``, ``seq``, ``timeout_s``, ``elapsed_s`` and ``ranks``.
    """

    def __init__(
        self,
        what: str,
        *,
        comm: Optional[str] = None,
        op: Optional[str] = None,
        seq: Optional[int] = None,
        timeout_s: Optional[float] = None,
        elapsed_s: Optional[float] = None,
        ranks: Iterable[int] = (),
    ) -> None:
        self.what = what
        self.comm = comm
        self.op = op
        self.seq = seq
        self.timeout_s = timeout_s
        self.elapsed_s = elapsed_s
        self.ranks = tuple(sorted(set(ranks)))
        super().__init__(self._render())

    def _render(self) -> str:
        where = []
        if self.comm is not None:
            where.append(f"communicator {self.comm!r}")
        if self.op is not None:
            where.append(f"op {self.op}" + (f" #{self.seq}" if self.seq is not None else ""))
        if self.timeout_s is not None:
            where.append(f"timeout {self.timeout_s:g}s")
        if self.elapsed_s is not None:
            where.append(f"elapsed {self.elapsed_s:.3f}s")
        if self.ranks:
            where.append("ranks " + ",".join(map(str, self.ranks)))
        return f"{self.what} [{'; '.join(where)}]" if where else self.what

    def __reduce__(self) -> Tuple[Any, ...]:  # keep the keyword attributes across pickling
        return (_rebuild, (type(self), self.what, self.__dict__.copy()))


def first_line(exc: BaseException) -> str:
    """An exception's message without what torch appends to it (C++ frames), or its class name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


_CXX_SOURCE = re.compile(r"^\[[^\]\s]*\.(?:cc|cpp|cxx|h|hpp|cu):\d+\] ?")


_NCCL_LAST_ERROR = "\nLast error:\n"


def backend_words(exc: BaseException) -> str:
    """A backend's message cut to its own first sentence: without the C++ file and line
    before it, and the advice (and Gloo's banner) after it.  NCCL puts the cause on a
    line of its own after ``Last error:`` ("Duplicate GPU detected : rank 0 and rank 1
    both on CUDA device 60"); that line is kept."""
    text = _CXX_SOURCE.sub("", first_line(exc))
    end = text.find(". ")
    text = text[:end] if end > 0 else text
    _, found, cause = str(exc).partition(_NCCL_LAST_ERROR)
    cause = cause.strip().splitlines()[0].strip() if found and cause.strip() else ""
    return f"{text}: {cause}" if cause else text


def _rebuild(cls: Type["CommError"], what: str, state: Dict[str, Any]) -> "CommError":
    err = cls.__new__(cls)
    RuntimeError.__init__(err, what)
    err.__dict__.update(state)
    RuntimeError.__init__(err, err._render())
    return err


class CollectiveTimeout(CommError):
    """An op did not complete before its deadline."""


class PeerLost(CommError):
    """A peer died or closed its connection; ``ranks`` names it where known."""


class CommAborted(CommError):
    """The communicator was aborted or finalized (``abort()``/``finalize()``).

    A communicator broken by a failure raises the class of that first failure
    (``PeerLost``, ``CollectiveTimeout``, ...) on every later op instead.
    """


class InvalidArgument(CommError, ValueError):
    """The call's arguments are wrong on this rank; nothing was sent."""


class ConfigError(CommError, ValueError):
    """A ``COMMSLAYER_*`` environment variable has a value that is not allowed; the
    message names the variable, the value and what is allowed (commslayer.config).
    Raised at start-up (``new_comm``, ``join``, a commslayer c10d group, the tracing
    autoload), before anything is built."""


class CollectiveMismatch(CommError):
    """Ranks called different ops, shapes, dtypes or reduce ops at one sequence number."""


class NanDetected(CommError):
    """The NaN check (``commslayer.comm.nan_check``, off by default) found a NaN in a tensor
    an op was about to send: the message names the tensor and the element, ``ranks``
    this rank. Nothing was sent; like any failed op it breaks the communicator."""


class OutOfFiles(CommError):
    """This process cannot open another socket: it holds as many file descriptors as its
    limit allows (``RLIMIT_NOFILE``, ``ulimit -n``), or the host's table is full. The
    message names the limit; raise it, or open fewer communicators."""


class StoreUnreachable(CommError):
    """The store that decides membership and commits cannot be reached: the process
    that hosts it (torchrun's agent, rank 0, or a job's coordinator) is gone or cut off."""
