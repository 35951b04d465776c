"""Trace text made readable: the first cause of an error, a dump's reasons, call sites.

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

# "(backend: [/path/pair.cc:553] Connection closed by peer [127.0.0.1]:27868. This is typically ...)"
_BACKEND = re.compile(r"\(backend: (?:\[[^\]]*\] ?)?(.*?)(?: \[[0-9a-fA-F.:]*\]:\d+)?(?:\. [^()]*)?\)")
_CXX_PATH = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cxx|h|hpp|cu):\d+\] ?")
_CONTEXT = re.compile(r" \[communicator [^\]]*\]$")  # commslayer's "[communicator ..; op ..; ..]" at the end
_ADDRESS = re.compile(r" \[[0-9a-fA-F.:]+\]:\d+")  # a peer's "[127.0.0.1]:25480"


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
    ``;`` inside brackets or parentheses belongs to one reason)."""
    out: List[str] = []
    depth, start = 0, 0
    text = reason or ""
    for i, c in enumerate(text):
        if c in "[(":
            depth += 1
        elif c in "])":
            depth = max(0, depth - 1)
        elif c == ";" and depth == 0 and text.startswith("; ", i):
            out.append(text[start:i])
            start = i + 2
    if text[start:]:
        out.append(text[start:])
    return out


def short_reason(reason: Optional[str]) -> str:
    """A dump's reasons as their first cause and a count: ``PeerLost: peer lost:
    rank 2 ... (+5 more)``."""
    parts = split_reasons(reason)
    if not parts:
        return ""
    more = f" (+{len(parts) - 1} more)" if len(parts) > 1 else ""
    return short_error(parts[0]) + more


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
