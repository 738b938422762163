"""Two network namespaces joined by a bandwidth-shaped veth pair: an emulated 2-node cluster.

``with NetnsPair(rate_gbit=1.0) as pair:`` creates namespaces ``dc-<tag>-a`` and ``dc-<tag>-b``,
a veth pair ``dc<tag>a`` <-> ``dc<tag>b`` with the two usable addresses of a private /30 chosen
here (10.213.x.y/30, present ONLY inside those namespaces), brings up ``lo`` in each, and shapes
each veth's egress with a ``tbf`` qdisc (``pair.set_rate(10.0)`` re-shapes it). Everything is
deleted on exit: the context manager, an ``atexit`` hook and SIGTERM/SIGINT/SIGHUP handlers all
call :meth:`NetnsPair.close` (idempotent). ``python -m bench.netns --cleanup`` removes leftovers
whose names start with the ``dc-`` / ``dc`` prefixes used here.

Safety: :meth:`NetnsPair.check_target` (and :func:`check_target`) REFUSES any address other
than the two veth addresses and 127.0.0.0/8, so benchmarks launched through this module can
only talk to processes inside the namespaces it created.

Latency: this kernel has no ``netem`` qdisc, so no delay is added in the kernel; the veth adds
only its own (~tens of µs) latency. Benchmarks that want more latency add it in user space.
Needs root (``ip netns``, ``tc``).
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import os
import secrets
import signal
import subprocess
from collections.abc import Iterable, Sequence
from types import FrameType, TracebackType

PREFIX = "dc-"          # namespace names
IF_PREFIX = "dc"        # interface names (IFNAMSIZ is 16, so no dash budget to spare)
POOL = ipaddress.ip_network("10.213.0.0/16")  # private range the /30s are drawn from
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr.strip()}\n"
                           "bench/netns.py needs root and the iproute2 tools (ip, tc)")
    return r


def _host_networks() -> list[ipaddress.IPv4Network]:
    """IPv4 networks already configured in the host namespace (to avoid choosing an overlapping /30)."""
    nets = []
    for line in _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_network(parts[parts.index("inet") + 1], strict=False))
    return nets


def check_target(addr: str, allowed: Iterable[str]) -> str:
    """Return ``addr`` if it is loopback or one of ``allowed``; raise ValueError otherwise."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError as exc:
        raise ValueError(f"refusing target {addr!r}: not an IP address (use the veth addresses "
                         f"{sorted(allowed)} or 127.0.0.0/8)") from exc
    allowed_ips = {ipaddress.ip_address(a) for a in allowed}
    if ip in LOOPBACK or ip in allowed_ips:
        return addr
    raise ValueError(f"refusing target {addr}: only the namespace veth addresses {sorted(allowed)} "
                     "and 127.0.0.0/8 may be contacted by this benchmark")


class NetnsPair:
    """Two namespaces + a shaped veth pair; see the module docstring."""

    def __init__(self, rate_gbit: float = 1.0, *, tag: str | None = None) -> None:
        self.tag = tag or secrets.token_hex(3)
        self.ns = (f"{PREFIX}{self.tag}-a", f"{PREFIX}{self.tag}-b")
        self.ifs = (f"{IF_PREFIX}{self.tag}a", f"{IF_PREFIX}{self.tag}b")
        self.net = self._pick_subnet()
        hosts = list(self.net.hosts())
        self.addrs = (str(hosts[0]), str(hosts[1]))
        self.rate_gbit = rate_gbit
        self._created: list[str] = []
        self._closed = False
        self._old_handlers: dict[int, object] = {}

    @staticmethod
    def _pick_subnet() -> ipaddress.IPv4Network:
        used = _host_networks()
        for _ in range(100):
            base = int(POOL.network_address) + 4 * secrets.randbelow(POOL.num_addresses // 4)
            net = ipaddress.ip_network(f"{ipaddress.ip_address(base)}/30")
            if not any(net.overlaps(u) for u in used):
                return net  # type: ignore[return-value]
        raise RuntimeError(f"no free /30 in {POOL} after 100 tries")

    # ------------------------------------------------------------------ lifecycle
    def open(self) -> NetnsPair:
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            for ns in self.ns:
                _run(["ip", "netns", "add", ns])
                self._created.append(ns)
            a, b = self.ifs
            _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
            for ns, ifname, addr in zip(self.ns, self.ifs, self.addrs):
                _run(["ip", "link", "set", ifname, "netns", ns])
                _run(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", ifname])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                _run(["ip", "-n", ns, "link", "set", ifname, "up"])
            self.set_rate(self.rate_gbit)
        except BaseException:
            self.close()
            raise
        return self

    def set_rate(self, rate_gbit: float) -> None:
        """(Re)shape both veth egresses with tbf at ``rate_gbit`` (burst: 4 ms of traffic, >= 128 KiB)."""
        if rate_gbit <= 0:
            raise ValueError(f"rate must be > 0 Gbit/s, got {rate_gbit}")
        rate_bytes = rate_gbit * 1e9 / 8
        # 4 ms of traffic (1 ms starved 10 Gbit/s here: 3.9-5.5 Gbit/s measured) and > a 64 KiB GSO packet
        burst = max(128 * 1024, int(rate_bytes * 0.004))
        for ns, ifname in zip(self.ns, self.ifs):
            _run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", ifname, "root", "tbf",
                  "rate", f"{int(rate_gbit * 1000)}mbit", "burst", str(burst), "latency", "50ms"])
        self.rate_gbit = rate_gbit

    def close(self) -> None:
        """Delete what was created (deleting a namespace deletes its end of the veth, and the peer)."""
        if self._closed:
            return
        self._closed = True
        for ns in reversed(self._created):
            _run(["ip", "netns", "del", ns], check=False)
        self._created.clear()
        _run(["ip", "link", "del", self.ifs[0]], check=False)  # only if setup failed before the move
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def __enter__(self) -> NetnsPair:
        return self.open()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ use
    def check_target(self, addr: str) -> str:
        return check_target(addr, self.addrs)

    def exec_argv(self, side: int, argv: Sequence[str]) -> list[str]:
        """argv that runs ``argv`` inside namespace ``side`` (0 = a, 1 = b)."""
        return ["ip", "netns", "exec", self.ns[side], *argv]

    def describe(self) -> dict[str, object]:
        return {"namespaces": list(self.ns), "veth": list(self.ifs), "addresses": list(self.addrs),
                "subnet": str(self.net), "rate_gbit": self.rate_gbit,
                "qdisc": "tbf (no netem: no added delay)"}


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Delete leftover namespaces named ``dc-*`` and host veths named ``dc<hex>a|b``; returns the names."""
    removed = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(prefix):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            ifname = parts[1].strip().split("@")[0]
            mid = ifname[len(IF_PREFIX):-1]
            if (ifname.startswith(IF_PREFIX) and len(mid) == 6 and ifname[-1] in "ab"
                    and all(ch in "0123456789abcdef" for ch in mid)):
                _run(["ip", "link", "del", ifname], check=False)
                removed.append(ifname)
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.netns", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cleanup", action="store_true", help="remove leftover dc-* namespaces and veths")
    ap.add_argument("--selftest", action="store_true", help="create a pair, ping across it, tear it down")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("bench/netns.py needs root (ip netns, tc)")
    if a.cleanup:
        print("removed:", cleanup() or "nothing")
    if a.selftest:
        with NetnsPair(1.0) as pair:
            print(pair.describe())
            for rate in (1.0, 10.0):
                pair.set_rate(rate)
                got = _throughput_gbit(pair)
                print(f"tbf {rate:g} Gbit/s: measured {got:.2f} Gbit/s a->b (64 MiB over one TCP stream)")
    return 0


_SERVER = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0
while True:
    b = c.recv(1 << 20)
    if not b: break
    n += len(b)
c.sendall(b"k"); c.close(); print(n, flush=True)
"""
_CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])))
buf = bytes(int(sys.argv[3]) if len(sys.argv) > 3 else 64 << 20)
t = time.perf_counter(); c.sendall(buf); c.shutdown(socket.SHUT_WR); c.recv(1)
print(len(buf) * 8 / (time.perf_counter() - t) / 1e9)
"""


def _throughput_gbit(pair: NetnsPair, port: int = 29411) -> float:
    """One TCP stream a -> b through the shaped veth (a self-test of the shaping)."""
    import sys

    dst = pair.check_target(pair.addrs[1])
    srv = subprocess.Popen(pair.exec_argv(1, [sys.executable, "-c", _SERVER, dst, str(port)]),
                           stdout=subprocess.PIPE, text=True)
    try:
        if srv.stdout is None or not srv.stdout.readline().startswith("ready"):
            raise RuntimeError("throughput server in the namespace did not start")
        out = _run(pair.exec_argv(0, [sys.executable, "-c", _CLIENT, dst, str(port)])).stdout
        return float(out.strip())
    finally:
        srv.wait(timeout=30)


if __name__ == "__main__":
    raise SystemExit(main())
