"""Which address of this host its peers should dial, and which host each rank is on.

A rank's liveness listener (and a launcher's replica groups) must be reached
from other hosts, so the address it advertises must be one of *its own*
interfaces, on the network its peers share with it.  The first of these that
is given decides:

1. ``COMMSLAYER_LIVENESS_HOST``: the user's word (a name or an address);
2. ``GLOO_SOCKET_IFNAME``: the interface Gloo is told to use (its first name,
   as Gloo reads a list), so liveness runs where the collectives run;
3. the address of the interface on this host's route towards the job's store
   (the host every rank already reaches), found by a UDP ``connect``, which
   sends nothing;
4. loopback, where the store is not a network store (one host).

Using the store's own address (``MASTER_ADDR``) for every rank was the old
rule: right on one host, and wrong for every rank not on the store's host.

Which host each rank is on (``torchrun_hosts``), for placing a rank's
liveness watchers on other hosts, costs nothing: torchrun gives each node a
block of ``LOCAL_WORLD_SIZE`` consecutive ranks, which this process checks
holds for itself (``RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from typing import Any, List, Optional, Sequence, Tuple

from . import config
from .errors import InvalidArgument

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def resolve(host: str, what: str) -> str:
    """``host`` as an IPv4 address; ``InvalidArgument`` naming ``what`` if it has none."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError) as exc:
        raise InvalidArgument(f"{what}={host!r} does not resolve to an IPv4 address ({exc})") from None


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (Linux)."""
    packed = struct.pack("256s", name.encode()[:15])
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), _SIOCGIFADDR, packed)[20:24])
        except OSError as exc:
            raise InvalidArgument(f"GLOO_SOCKET_IFNAME names interface {name!r}, which has no IPv4 address on "
                                  f"this host ({exc.strerror or exc})") from None


def address_towards(host: str, port: int) -> str:
    """This host's address on its route to ``host:port``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((resolve(host, "store host"), port))  # a UDP connect only picks the route
        return s.getsockname()[0]


def store_address(store: Any) -> Optional[Tuple[str, int]]:
    """``(host, port)`` of the TCP store under ``store`` (through prefix stores and
    commslayer's wrappers), or None for a store that is not on the network."""
    for _ in range(32):  # wrappers are few; a cycle must not spin
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if isinstance(host, str) and isinstance(port, int):
            return host, port
        inner = getattr(store, "underlying_store", None) or getattr(store, "_store", None)  # _store: membership's
        if inner is None:
            return None
        store = inner
    return None


def advertised_host(store: Any = None) -> str:
    """The address this rank's peers should dial to reach it (rules in the module docstring)."""
    named = config.liveness_host()
    if named:
        return resolve(named, "COMMSLAYER_LIVENESS_HOST")
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if ifname:
        return interface_address(ifname)
    target = store_address(store)
    if target is None and os.environ.get("MASTER_ADDR"):
        target = (os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT") or 1))
    if target is None:
        return LOOPBACK
    try:
        return address_towards(*target)
    except OSError:  # no route to the store from here: only loopback can be right
        return LOOPBACK


def torchrun_hosts(members: Sequence[int]) -> Optional[List[int]]:
    """The node of each member (a global rank) under torchrun's layout of equal
    nodes; None where this process was not started that way."""
    try:
        rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
        local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        world = int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if per_node < 1 or rank != node * per_node + local or any(not 0 <= m < world for m in members):
        return None
    return [m // per_node for m in members]
