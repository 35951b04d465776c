"""How an address is written: ``host:port``, and the job's store on etcd as
``etcd://host:port,.../job``; parsed here and nowhere else.

Only the standard library: the launcher's argument checks, the configuration
(``COMMSLAYER_JOB_STORE``) and the stores all read addresses through it.
"""

from __future__ import annotations

from typing import List, Tuple

SCHEME = "etcd://"  # how an address of the job's store on etcd begins (``--store``, ``COMMSLAYER_JOB_STORE``)


def is_etcd(address: str) -> bool:
    """Whether ``address`` names a store on etcd (else it is a TCPStore's ``host:port``)."""
    return address.startswith(SCHEME)


def parse_url(url: str) -> Tuple[List[Tuple[str, int]], str]:
    """``etcd://h1:2379,h2:2379/job`` as ((host, port) pairs, the job's name ``job``; empty
    without a path); ``ValueError`` saying why not."""
    if not is_etcd(url):
        raise ValueError(f"{url!r} is not an etcd:// address")
    hosts, _, path = url[len(SCHEME):].partition("/")
    if "@" in hosts:  # the address itself is not shown: it may hold a password
        raise ValueError("an etcd:// address holds no user or password (addresses are printed and logged): set "
                         "COMMSLAYER_ETCD_USER and COMMSLAYER_ETCD_PASSWORD")
    path = path.strip("/")
    if any(c.isspace() or not c.isprintable() for c in path):
        raise ValueError(f"the path {path!r} of {url!r} is not a plain key prefix")
    out = []
    for part in hosts.split(","):
        try:
            out.append(host_port(part))
        except ValueError:
            raise ValueError(f"{part!r} in {url!r} is not host:port") from None
    return out, path


def host_port(text: str) -> Tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) as (host, port); ``ValueError`` saying what is expected."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"{text!r}: expected HOST:PORT, PORT in 1..65535")
    return host.strip("[]"), int(port)
