"""Trace text made readable: the first cause of an error, how a dump's process ended, call sites.

Errors carry the backend's own words (Gloo's C++ file and line, the peer's
address, advice and a joke) and commslayer's context in brackets.  The
viewer's headlines and tables show the cause alone; the full text stays in
the detail views (hover, ``--json``).  Imports neither torch nor commslayer.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional

HEADLINE_CHARS = 200  # a cause longer than this is cut (the detail view has it whole)
IN_FLIGHT = "in flight"  # an op that began and has not ended, as watch and the status page say it

# "(backend: [/path/pair.cc:553] Connection closed by peer [127.0.0.1]:27868. This is typically ...)"
_BACKEND = re.compile(r"\(backend: (?:\[[^\]]*\] ?)?(.*?)(?: \[[0-9a-fA-F.:]*\]:\d+)?(?:\. [^()]*)?\)")
_CXX_PATH = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cxx|h|hpp|cu):\d+\] ?")
_CONTEXT = re.compile(r" \[communicator [^\]]*\]$")  # commslayer's "[communicator ..; op ..; ..]" at the end
_ADDRESS = re.compile(r" \[[0-9a-fA-F.:]+\]:\d+")  # a peer's "[127.0.0.1]:25480"


def op_name(op: object, seq: object, comm: object) -> str:
    """An op as ``commslayer-trace watch`` and the status page name it: ``all_reduce #412 of 'c10d:0'``
    (the page through the name a rank's flight recorder writes into its status, tracing.record.figures)."""
    return f"{op} #{seq} of '{comm}'"


def short_error(text: Optional[str]) -> str:
    """The cause in ``text`` without the backend's file paths, addresses, advice and
    jokes, or commslayer's trailing context: ``peer lost: rank(s) 1 (backend:
    Connection closed by peer)``."""
    if not text:
        return ""
    out = _ADDRESS.sub("", _CONTEXT.sub("", _CXX_PATH.sub("", _BACKEND.sub(r"(backend: \1)", text.strip()))))
    out = out.splitlines()[0] if out else out
    return out if len(out) <= HEADLINE_CHARS else out[:HEADLINE_CHARS - 3] + "..."


_LOST_PREFIX = re.compile(r"^peer lost: (?:rank \d+ \(member \d+\)(?:, rank \d+ \(member \d+\))*: )?(?:rank \d+: )?"
                          r"(?:rank\(s\) [\d, ]+ \(backend: (.*)\)$)?")


def loss_cause(text: Optional[str]) -> str:
    """How a peer was found lost, from a ``PeerLost`` message: ``its process exited
    (connection closed)``, ``no heartbeat for 5.00s (stopped or hung)``, ``(backend:
    Connection closed by peer)``."""
    return _LOST_PREFIX.sub(lambda m: m.group(1) or "", short_error(text))


def split_reasons(reason: Optional[str]) -> List[str]:
    """The reasons a dump was written for (the recorder joins them with ``; ``; a
    ``;`` inside brackets or parentheses belongs to one reason).  A bracket that is
    never closed (the recorders before this one cut a reason's context at a ``; ``)
    is taken as text, so that the reasons after it still come apart."""
    text = reason or ""
    stack: List[int] = []
    for i, c in enumerate(text):  # which openers have a closer
        if c in "[(":
            stack.append(i)
        elif c in "])" and stack:
            stack.pop()
    unclosed = set(stack)
    out: List[str] = []
    depth, start = 0, 0
    for i, c in enumerate(text):
        if c in "[(":
            depth += i not in unclosed
        elif c in "])":
            depth = max(0, depth - 1)
        elif c == ";" and depth == 0 and text.startswith("; ", i):
            out.append(text[start:i])
            start = i + 2
    if text[start:]:
        out.append(text[start:])
    return out


_EXIT = re.compile(r"^exit (-?\d+): ?(.*)$", re.S)


def ended(reason: Optional[str]) -> bool:
    """True when a dump with these reasons was written as its process ended (its last
    reason: ``exit``, ``exit N: ...``, or SIGTERM), not earlier in its life."""
    parts = split_reasons(reason)
    return bool(parts) and (parts[-1] == "exit" or bool(_EXIT.match(parts[-1])) or parts[-1].startswith("SIGTERM"))


def short_reason(reason: Optional[str]) -> str:
    """How a dump's process ended, in words, from its reasons (oldest first; the file
    holds the last dump, so the last reason is why it was written): ``finished (exit
    0)``, ``exit 1: StateLost: ...``, ``dumped on SIGTERM``, then the first earlier
    reason and a count: ``finished (exit 0); earlier dump on PeerLost: peer lost:
    rank 2 ... (+1 more)``."""
    parts = split_reasons(reason)
    if not parts:
        return ""
    last, earlier = parts[-1], parts[:-1]
    m = _EXIT.match(last)
    text = "finished (exit 0)" if last == "exit" else \
        f"exit {m.group(1)}: {short_error(m.group(2))}" if m else f"dumped on {short_error(last)}"
    if earlier:
        more = f" (+{len(earlier) - 1} more)" if len(earlier) > 1 else ""
        text += f"; earlier dump on {short_error(earlier[0])}{more}"
    return text


def relative_site(site: Optional[str], cwd: Optional[str]) -> Optional[str]:
    """A call site (``file:line``) relative to the job's working directory ``cwd``
    when the file lies below it; else as it is."""
    if not site or not cwd or not os.path.isabs(site):
        return site
    prefix = cwd.rstrip(os.sep) + os.sep
    return site[len(prefix):] if site.startswith(prefix) else site


def human_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (up to GiB): ``5.06 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" or n == int(n) else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:g} GiB"
