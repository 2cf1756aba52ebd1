"""Worker "hosts" made of network namespaces, for fleet tests and benchmarks on one machine.

Each host is a namespace joined to a bridge in the root namespace by a veth pair. The bridge carries
the address the stack's embedded Redis listens on (`redis.bind`), so a host reaches Redis only over
its own link, and cutting that link (`cut`) cuts the host off as a network fault would. Namespaces
share the file system: that is the folder every host mounts at the same real path.

Everything made here has a random tag in its name and is deleted by `fake_hosts` on the way out,
even after a failure; workers are started through the stack (`Stack.start_worker`), kept by PID and
stopped by it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field


def why_no_namespaces() -> str | None:
    """Why network namespaces cannot be made here (None: they can), for a skip reason."""
    if os.geteuid() != 0:
        return "making network namespaces takes root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to make network namespaces with"
    probe = f"sits-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    bridge = f"sitsp{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "link", "add", bridge, "type", "bridge"], capture_output=True, text=True)
    if made.returncode:
        return f"cannot make a bridge: {made.stderr.strip()}"
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Hosts:
    """The namespaces made, the root side of each one's link, and the address Redis listens on."""

    bridge: str
    redis_address: str
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    """The root-namespace end of each host's veth pair."""

    def launcher(self, host: int) -> list[str]:
        """The command that runs a worker in host `host` (`Stack.start_worker(launcher=...)`); `ip netns
        exec` execs the command, so the PID the stack keeps is the worker's."""
        return ["ip", "netns", "exec", self.namespaces[host]]

    def cut(self, host: int) -> None:
        """Take host `host`'s link down: its packets go nowhere, its connections hang, as a cable pulled."""
        _ip("link", "set", self.links[host], "down")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no interface here uses."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    taken = [ipaddress.ip_interface(word).network for line in used.splitlines()
             for prev, word in zip(line.split(), line.split()[1:], strict=False) if prev == "inet"]
    for _ in range(100):
        subnet = ipaddress.ip_network(f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24")
        if not any(subnet.overlaps(other) for other in taken):
            return subnet
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test hosts")


@contextlib.contextmanager
def fake_hosts(count: int) -> Iterator[Hosts]:
    """`count` namespaces on one bridge; all of it deleted on the way out. Stop the workers in them first
    (a namespace whose processes live on is only unnamed by `ip netns del`)."""
    tag = secrets.token_hex(3)
    subnet = _free_subnet()
    addresses = list(subnet.hosts())
    hosts = Hosts(bridge=f"sitsbr{tag}", redis_address=str(addresses[0]))
    try:
        _ip("link", "add", hosts.bridge, "type", "bridge")
        _ip("addr", "add", f"{addresses[0]}/{subnet.prefixlen}", "dev", hosts.bridge)
        _ip("link", "set", hosts.bridge, "up")
        for host in range(count):
            namespace, link, inside = f"sits-{tag}-h{host}", f"sv{tag}{host}r", f"sv{tag}{host}n"
            _ip("netns", "add", namespace)
            hosts.namespaces.append(namespace)
            _ip("link", "add", link, "type", "veth", "peer", "name", inside)
            hosts.links.append(link)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", link, "master", hosts.bridge, "up")
            _ip("-n", namespace, "addr", "add", f"{addresses[host + 1]}/{subnet.prefixlen}", "dev", inside)
            _ip("-n", namespace, "link", "set", inside, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace in hosts.namespaces:  # (its end of a veth pair goes with it, and so does ours)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        for link in hosts.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)  # (gone already, unless a process held on)
        subprocess.run(["ip", "link", "del", hosts.bridge], capture_output=True)


def leftovers(hosts: Hosts) -> list[str]:
    """What of `hosts` still exists (for a test that checks its teardown)."""
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    return ([name for name in hosts.namespaces if name in namespaces]
            + [name for name in (*hosts.links, hosts.bridge) if f" {name}:" in links or f" {name}@" in links])
