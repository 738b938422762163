"""``deploy/local-cluster.sh status``: one line per node of the local cluster (or the full JSON).

Per node: its Redis master (does it answer PING?), its cache daemon's ``/health``, and from the
daemon's ``/status`` the fill of its datasets (cached / owned samples, %, fill rate, status).
Stdlib only (urllib, sockets): it runs in the same interpreter as the daemons but needs none of
their extras.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import urllib.error
import urllib.request
from typing import Any


def redis_alive(port: int) -> bool:
    """Whether a server on 127.0.0.1:``port`` answers PING (an ACL server's NOAUTH counts as up)."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1.0) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))
    return False


def fetch_json(url: str, timeout: float = 3.0) -> tuple[int, Any]:
    """``(HTTP status, decoded JSON)``; ``(0, reason)`` when nothing answered or the body is not JSON."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 from /health still carries the JSON detail
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, None
    except (OSError, ValueError) as e:
        return 0, str(getattr(e, "reason", e))


def node_line(i: int, redis_port: int, http_port: int) -> tuple[str, dict[str, Any]]:
    """One node's status line and the JSON behind it."""
    up = redis_alive(redis_port)
    code, health = fetch_json(f"http://127.0.0.1:{http_port}/health")
    daemon = "ok" if code == 200 else ("unreachable" if code == 0 else f"unhealthy ({code})")
    scode, status = fetch_json(f"http://127.0.0.1:{http_port}/status") if code else (0, None)
    datasets = status.get("datasets", []) if scode == 200 and isinstance(status, dict) else []
    owned = sum(int(d.get("owned", 0)) for d in datasets)
    done = sum(int(d.get("done", 0)) for d in datasets)
    rate = sum(float(d.get("rate", 0.0)) for d in datasets)
    states = ",".join(sorted({str(d.get("status")) for d in datasets})) or "-"
    fill = f"{100.0 * done / owned:5.1f}%" if owned else "    -"
    name = status.get("node") if isinstance(status, dict) and status.get("node") else f"node-{i}"
    line = (f"{name:<8} redis 127.0.0.1:{redis_port} {'up' if up else 'DOWN':<4}"
            f"  daemon :{http_port} {daemon:<11}  fill {fill}"
            f"  cached {done}/{owned}  rate {rate:.1f}/s  {states}")
    return line, {"node": name, "redis_port": redis_port, "redis_alive": up, "http_port": http_port,
                  "health": health, "status": status}


def print_status(path: str, redis_ports: list[int], http_ports: list[int], *, as_json: bool = False) -> int:
    """Print the status of every node; exit status 1 when a master or a daemon is down."""
    rows = [node_line(i, rp, hp) for i, (rp, hp) in enumerate(zip(redis_ports, http_ports, strict=True))]
    if as_json:
        json.dump([doc for _, doc in rows], sys.stdout, indent=1)
        print()
    else:
        for line, _ in rows:
            print(line)
    healthy = all(doc["redis_alive"] and isinstance(doc["health"], dict) and doc["health"].get("ok")
                  for _, doc in rows)
    if not healthy and not as_json:
        print(f"some nodes are down (logs in {path}); `deploy/local-cluster.sh up` restarts what is missing",
              file=sys.stderr)
    return 0 if healthy else 1
