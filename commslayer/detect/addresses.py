"""Which address of this host its peers should dial, and which host each rank is on
(how a store's address is written: ``commslayer.endpoints``).

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

Which node each rank is on (``rank_hosts``), for placing a rank's liveness
watchers on other hosts, costs nothing and must come out the same on every
rank (each one chooses the watch topology from it), so it is read only from
what the launcher gives every rank alike, in blocks of consecutive ranks:

1. ``COMMSLAYER_NODE_SIZES``: the ranks on each node, in rank order (set by
   ``commslayer-run`` when it lays out the survivors of a resharding, or by
   the user for another launcher);
2. torchrun's layout: ``LOCAL_WORLD_SIZE`` ranks a node, which this process
   checks holds for itself (``RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK``);
3. Slurm's ``SLURM_TASKS_PER_NODE`` (``4(x2),3``) under its default block
   distribution, checked against ``SLURM_NODEID`` of this process.

Anything else: no layout, and watchers are chosen without regard to hosts.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import itertools
import os
import re
import socket
import struct
from typing import Any, List, Optional, Sequence, Tuple

from commslayer import config
from commslayer.errors import InvalidArgument

LOOPBACK = "127.0.0.1"
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)  # not a bad address: raised for the caller to name


def resolve(host: str, what: str) -> str:
    """``host`` as an IPv4 address; ``InvalidArgument`` naming ``what`` if it has none."""
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError) as exc:
        if isinstance(exc, OSError) and exc.errno in OUT_OF_FILES:
            raise  # out of file descriptors, not a bad name: the caller names it
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
    except OSError as exc:  # no route to the store from here: only loopback can be right
        if exc.errno in OUT_OF_FILES:
            raise
        return LOOPBACK


def rank_hosts(members: Sequence[int]) -> Optional[List[int]]:
    """The node of each member (a global rank of the job) in the launcher's layout
    (see the module doc); None where no layout is given or it does not hold."""
    sizes = config.node_sizes() or _torchrun_layout() or _slurm_layout()
    if sizes is None or any(not 0 <= m < sum(sizes) for m in members):
        return None
    starts = list(itertools.accumulate(sizes))
    return [bisect.bisect_right(starts, m) for m in members]


def on_one_host(members: Sequence[int], job_ranks: Optional[Sequence[int]] = None) -> bool:
    """Whether the launcher's layout puts every member on one node, read over their
    ``job_ranks`` where the layout covers those, else over ``members`` (their ranks in
    their own torchrun: a job of several torchruns, replica mode, numbers its ranks past
    one torchrun's layout); False where no layout is given. The same on every rank,
    like ``rank_hosts``."""
    hosts = None if job_ranks is None else rank_hosts(job_ranks)
    if hosts is None:
        hosts = rank_hosts(members)
    return hosts is not None and len(set(hosts)) == 1


def _torchrun_layout() -> Optional[List[int]]:
    try:
        rank, node = int(os.environ["RANK"]), int(os.environ["GROUP_RANK"])
        local, per_node = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
        world = int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    if per_node < 1 or world < 1 or rank != node * per_node + local:
        return None
    return [per_node] * (world // per_node) + ([world % per_node] if world % per_node else [])


def _slurm_layout() -> Optional[List[int]]:
    """Ranks per node from ``SLURM_TASKS_PER_NODE`` (``2(x3),1`` is 2, 2, 2, 1) when
    Slurm placed the tasks in blocks and this task sits where the layout says."""
    raw = os.environ.get("SLURM_TASKS_PER_NODE", "")
    if not raw or not os.environ.get("SLURM_DISTRIBUTION", "block").startswith("block"):
        return None
    sizes: List[int] = []
    for part in raw.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None or int(match.group(1)) < 1:
            return None
        sizes += [int(match.group(1))] * int(match.group(2) or 1)
    try:
        rank = int(os.environ.get("RANK") or os.environ["SLURM_PROCID"])
        node = int(os.environ["SLURM_NODEID"])
    except (KeyError, ValueError):
        return None
    starts = list(itertools.accumulate(sizes))
    if not 0 <= rank < starts[-1] or bisect.bisect_right(starts, rank) != node:
        return None
    return sizes
