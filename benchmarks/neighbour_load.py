"""Load on the neighbour service over loopback, with hostile connections held open throughout.

    python -m benchmarks.neighbour_load [--users 5000 --threads 50 --hostile 20]

The service runs as its own process (`start_local_service`, as in a simulation). One run is
opened with the admin token; `--users` honest clients, through `--threads` concurrent threads,
each submit an embedding and keyed item tokens, then fetch their neighbours. Meanwhile
`--hostile` connections are held open: half connect and send nothing (half-open), half send a
request head and then drip its body, one byte every 2 s (slow). When the service cuts one, it
reconnects. Records p50 / p99 latency of submit and fetch, the service's peak RSS, whether every
honest client was served with the right number of neighbours, and how often hostile connections
were cut. Every loop is bounded in count and in time (`--max-seconds`). Writes
benchmarks/results/neighbour_load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

import numpy as np

from fedrec_flwr.fsutil import atomic_write
from fedrec_flwr.neighbours import (
    NeighbourClient,
    NeighbourServiceError,
    item_tokens,
    new_handle,
    new_run_key,
)
from fedrec_flwr.neighbours.process import start_local_service


def _peak_rss_mb(pid: int) -> float:
    """VmHWM of a process (Linux): its peak resident memory so far."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _hostile(address: str, slow: bool, stop: threading.Event, cuts: list[float], max_cycles: int = 1000) -> None:
    """Hold one connection open; when the service closes it, note how long it lasted and reconnect."""
    host, port = address.split(":")
    for _ in range(max_cycles):
        if stop.is_set():
            return
        start = time.monotonic()
        try:
            with socket.create_connection((host, int(port)), timeout=2) as sock:
                if slow:
                    sock.sendall(b"POST /runs/x/submit HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
                while not stop.is_set():
                    try:
                        if slow:
                            sock.send(b" ")
                        if sock.recv(4096) == b"":
                            break  # closed by the service
                    except TimeoutError:  # recv waits at most 2 s, then drip again / look at stop
                        continue
                    if not slow:
                        break  # a reply to nothing cannot come; treat any bytes as a close
                else:
                    return
        except OSError:
            pass  # reset by the service: a cut too
        cuts.append(time.monotonic() - start)


def _co_rater_counts(items: list[np.ndarray], num_items: int) -> np.ndarray:
    """Per user, how many other users share at least one item (what the service must match)."""
    a = np.zeros((len(items), num_items), np.float32)
    for u, its in enumerate(items):
        a[u, its] = 1
    return ((a @ a.T) > 0).sum(1) - 1


def main() -> None:
    """Run the load, print and write the summary."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=50)
    ap.add_argument("--hostile", type=int, default=20)
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--items-per-user", type=int, default=20)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--max-neighbours", type=int, default=10)
    ap.add_argument("--idle-timeout", type=float, default=5.0, help="service --idle-timeout-s and --io-timeout-s")
    ap.add_argument("--max-seconds", type=float, default=100.0, help="honest requests not started by then are skipped")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/neighbour_load.json")
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    popularity = 1.0 / np.arange(1, args.items + 1) ** 0.8  # a long-tailed catalogue
    items = [rng.choice(args.items, args.items_per_user, replace=False, p=popularity / popularity.sum())
             for _ in range(args.users)]
    key = new_run_key()
    token_of = np.asarray(item_tokens(key, np.arange(args.items)))
    embeddings = rng.standard_normal((args.users, args.dim)).astype(np.float32)
    handles = [new_handle() for _ in range(args.users)]

    timeouts = ["--idle-timeout-s", str(args.idle_timeout), "--io-timeout-s", str(args.idle_timeout)]
    load_before = os.getloadavg()[0]
    address, proc, admin_token = start_local_service(extra_args=timeouts)
    wall = time.monotonic()
    stop, cuts = threading.Event(), []
    try:
        admin = NeighbourClient(address, retries=0, token=admin_token)
        secret = admin.open_run("load", args.dim, args.items, args.max_neighbours)
        hostile = [threading.Thread(target=_hostile, args=(address, i % 2 == 1, stop, cuts), daemon=True)
                   for i in range(args.hostile)]
        for t in hostile:
            t.start()
        time.sleep(0.5)  # they are connected before the honest load starts
        deadline = time.monotonic() + args.max_seconds

        def call(kind: str, u: int):
            if time.monotonic() > deadline:
                return kind, None, "skipped: past --max-seconds"
            client = NeighbourClient(address, retries=0, timeout_s=10, token=secret)
            start = time.perf_counter()
            try:
                if kind == "submit":
                    client.submit("load", handles[u], embeddings[u], token_of[items[u]].tolist())
                    out = None
                else:
                    out = client.neighbours("load", handles[u]).shape[0]
            except NeighbourServiceError as exc:
                return kind, None, str(exc)
            return kind, time.perf_counter() - start, out

        results = {}
        with ThreadPoolExecutor(args.threads) as pool:
            for kind in ("submit", "fetch"):
                results[kind] = list(pool.map(lambda u, k=kind: call(k, u), range(args.users)))
        load_s = time.monotonic() - wall
        peak_rss, service_cpu = _peak_rss_mb(proc.pid), _cpu_s(proc.pid)
        stop.set()
        for t in hostile:
            t.join(5)
        admin.close_run("load")
        try:
            NeighbourClient(address, retries=0, token=secret).neighbours("load", handles[0])
            closed = False
        except NeighbourServiceError as exc:
            closed = "unknown run" in str(exc)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(10)

    expected = np.minimum(_co_rater_counts(items, args.items), args.max_neighbours)
    summary = {}
    for kind, rows in results.items():
        lat = np.array([r[1] for r in rows if r[1] is not None]) * 1000
        failures = [r[2] for r in rows if r[1] is None]
        summary[kind] = {"served": int(lat.size), "failed": len(failures), "first_failures": failures[:3],
                         "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
                         "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
                         "max_ms": round(float(lat.max()), 2) if lat.size else None}
    got = np.array([r[2] if r[1] is not None else -1 for r in results["fetch"]])
    doc = {
        "date": date.today().isoformat(),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_1min_before": round(load_before, 2), "load_average_1min_after": round(os.getloadavg()[0], 2),
                    "note": "client threads and the service share these cores over loopback (and with any other job)"},
        "command": "python -m benchmarks.neighbour_load " + " ".join(sys.argv[1:]),
        "settings": {"users": args.users, "threads": args.threads, "hostile_connections": args.hostile,
                     "items": args.items, "items_per_user": args.items_per_user, "dim": args.dim,
                     "max_neighbours": args.max_neighbours, "service_flags": timeouts, "tls": False},
        "submit": summary["submit"], "fetch": summary["fetch"],
        "requests_per_s": round(2 * args.users / load_s, 1),
        "load_seconds": round(load_s, 2),
        "service_peak_rss_mb": round(peak_rss, 1),
        "service_cpu_s": round(service_cpu, 2),
        "every_honest_client_served": summary["submit"]["failed"] == 0 and summary["fetch"]["failed"] == 0,
        "neighbour_counts_match_brute_force": bool((got == expected).all()),
        "hostile": {"connections": args.hostile, "cut_by_service": len(cuts),
                    "median_s_until_cut": round(float(np.median(cuts)), 2) if cuts else None},
        "run_closed_after": closed,
    }
    atomic_write(Path(args.out), json.dumps(doc, indent=1))
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
