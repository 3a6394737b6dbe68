"""Load on the neighbour service over loopback, with hostile connections held open throughout.

    python -m benchmarks.neighbour_load [--users 5000 --threads 50 --hostile 20 --slow-body 200]
    python -m benchmarks.neighbour_load --fill [--max-memory-bytes 300000000 --fill-runs 4]

The service runs as its own process (`start_local_service`, as in a simulation). One run is
opened with the admin token; `--users` honest clients, through `--threads` concurrent threads,
each submit an embedding and keyed item tokens, then fetch their neighbours. Meanwhile
`--hostile` connections are held open: half connect and send nothing (half-open), half send a
request head and then drip its body, one byte every 2 s (slow). And `--slow-body` strangers
(no credential) each send a submit's request head and one byte of its body, and hold; when the
service closes one (it answers 401 from the head), it reconnects after `--reconnect-delay`.
Records p50 / p99 latency of submit and fetch, the service's peak RSS, whether every honest
client was served with the right number of neighbours, and what the hostile connections got.

`--fill` instead fills every run of a service started with `--max-memory-bytes` until each is
refused (each run has its own budget), fetches for some of the stored handles, and records the
service's peak RSS against the limit, with the service's own accounting (GET /stats).

Every loop is bounded in count and in time (`--max-seconds`). Results are merged into
benchmarks/results/neighbour_load.json: the load run at the top level (the previous one kept under
"history"), a run with `--record-as NAME` under "variants", the fill run under "fill".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import sys
import threading
import time
from collections import Counter
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


def _proc_kb(pid: int, field: str) -> float:
    """A memory field of /proc/<pid>/status (Linux), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return float(line.split()[1])
    return float("nan")


def _peak_rss_mb(pid: int) -> float:
    """VmHWM of a process (Linux): its peak resident memory so far."""
    return _proc_kb(pid, "VmHWM") / 1024


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine(load_before: float) -> dict:
    return {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "load_average_1min_before": round(load_before, 2), "load_average_1min_after": round(os.getloadavg()[0], 2),
            "note": "client threads and the service share these cores over loopback (and with any other job)"}


def _hostile(address: str, slow: bool, stop: threading.Event, cuts: list[float], delay: float,
             max_cycles: int = 1000) -> None:
    """Hold one connection open; when the service closes it, note how long it lasted and reconnect after `delay`."""
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
        stop.wait(delay)


def _slow_body(address: str, run_id: str, stop: threading.Event, seen: list, delay: float,
               max_cycles: int = 10_000) -> None:
    """A stranger: a submit's request head and one byte of body, no credential, then hold; reconnect when cut.

    Appends (status or None, seconds from sending until the service closed the connection) per cycle.
    """
    host, port = address.split(":")
    head = (b"POST /runs/%s/submit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{" % run_id.encode())
    for _ in range(max_cycles):
        if stop.is_set():
            return
        status, reply = None, b""
        try:
            with socket.create_connection((host, int(port)), timeout=2) as sock:
                sock.sendall(head)
                start = time.monotonic()
                while not stop.is_set():
                    try:
                        chunk = sock.recv(4096)
                    except TimeoutError:
                        continue  # still held: keep holding
                    if not chunk:
                        break
                    reply += chunk
                else:
                    return
                held = time.monotonic() - start
        except OSError:
            held = None
        if reply.startswith(b"HTTP/1."):
            status = int(reply.split()[1])
        seen.append((status, held))
        stop.wait(delay)


def _co_rater_counts(items: list[np.ndarray], num_items: int) -> np.ndarray:
    """Per user, how many other users share at least one item (what the service must match)."""
    a = np.zeros((len(items), num_items), np.float32)
    for u, its in enumerate(items):
        a[u, its] = 1
    return ((a @ a.T) > 0).sum(1) - 1


def _merge(out: Path, update) -> dict:
    """Read the record, let `update` change it, write it back atomically."""
    doc = json.loads(out.read_text()) if out.exists() else {}
    update(doc)
    atomic_write(out, json.dumps(doc, indent=1))
    return doc


def _load(args) -> None:
    """The honest load with hostile and slow-body connections held throughout."""
    rng = np.random.default_rng(args.seed)
    popularity = 1.0 / np.arange(1, args.items + 1) ** 0.8  # a long-tailed catalogue
    items = [rng.choice(args.items, args.items_per_user, replace=False, p=popularity / popularity.sum())
             for _ in range(args.users)]
    key = new_run_key()
    token_of = np.asarray(item_tokens(key, np.arange(args.items)))
    embeddings = rng.standard_normal((args.users, args.dim)).astype(np.float32)
    handles = [new_handle() for _ in range(args.users)]

    flags = ["--idle-timeout-s", str(args.idle_timeout), "--io-timeout-s", str(args.idle_timeout), *args.service_arg]
    load_before = os.getloadavg()[0]
    address, proc, admin_token = start_local_service(extra_args=flags)
    wall = time.monotonic()
    stop, cuts, slow_seen = threading.Event(), [], []
    try:
        admin = NeighbourClient(address, retries=0, token=admin_token)
        secret = admin.open_run("load", args.dim, args.items, args.max_neighbours)
        hostile = [threading.Thread(target=_hostile, args=(address, i % 2 == 1, stop, cuts, args.reconnect_delay),
                                    daemon=True)
                   for i in range(args.hostile)]
        hostile += [threading.Thread(target=_slow_body, args=(address, "load", stop, slow_seen, args.reconnect_delay),
                                     daemon=True) for _ in range(args.slow_body)]
        for t in hostile:
            t.start()
        time.sleep(1.0)  # they are connected before the honest load starts
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
                    out = client.neighbours("load", handles[u], dim=args.dim,
                                            max_neighbours=args.max_neighbours).shape[0]
            except NeighbourServiceError as exc:
                return kind, None, str(exc)
            return kind, time.perf_counter() - start, out

        results, health = {}, []
        with ThreadPoolExecutor(args.threads) as pool:
            for kind in ("submit", "fetch"):
                results[kind] = list(pool.map(lambda u, k=kind: call(k, u), range(args.users)))
                start = time.perf_counter()  # and /health, between the phases, while the strangers hold on
                NeighbourClient(address, retries=0, timeout_s=5)._post("/health", None)
                health.append(round((time.perf_counter() - start) * 1000, 2))
        load_s = time.monotonic() - wall
        peak_rss, service_cpu = _peak_rss_mb(proc.pid), _cpu_s(proc.pid)
        held_now = sum(1 for t in hostile if t.is_alive())
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
    closes = [h for s, h in slow_seen if h is not None]
    record = {
        "date": date.today().isoformat(),
        "machine": _machine(load_before),
        "command": "python -m benchmarks.neighbour_load " + " ".join(sys.argv[1:]),
        "settings": {"users": args.users, "threads": args.threads, "hostile_connections": args.hostile,
                     "slow_body_connections": args.slow_body, "reconnect_delay_s": args.reconnect_delay,
                     "items": args.items, "items_per_user": args.items_per_user, "dim": args.dim,
                     "max_neighbours": args.max_neighbours, "service_flags": flags, "tls": False},
        "submit": summary["submit"], "fetch": summary["fetch"],
        "health_ms": health,
        "requests_per_s": round(2 * args.users / load_s, 1),
        "load_seconds": round(load_s, 2),
        "service_peak_rss_mb": round(peak_rss, 1),
        "service_cpu_s": round(service_cpu, 2),
        "every_honest_client_served": summary["submit"]["failed"] == 0 and summary["fetch"]["failed"] == 0,
        "honest_p99_under_1s": all(summary[k]["p99_ms"] is not None and summary[k]["p99_ms"] < 1000
                                   for k in ("submit", "fetch")),
        "neighbour_counts_match_brute_force": bool((got == expected).all()),
        "hostile": {"connections": args.hostile, "cut_by_service": len(cuts),
                    "note": "the dripping half ask for /runs/x/submit without a credential: now answered from the head",
                    "median_s_until_cut": round(float(np.median(cuts)), 2) if cuts else None},
        "slow_body": {"connections": args.slow_body, "still_holding_at_end": held_now - args.hostile,
                      "attempts": len(slow_seen), "answered": dict(Counter(str(s) for s, _ in slow_seen)),
                      "median_ms_until_closed": round(float(np.median(closes)) * 1000, 2) if closes else None,
                      "max_ms_until_closed": round(float(np.max(closes)) * 1000, 2) if closes else None},
        "run_closed_after": closed,
    }

    def update(doc: dict) -> None:
        if args.record_as:
            doc.setdefault("variants", {})[args.record_as] = record
            return
        previous = {k: v for k, v in doc.items() if k not in ("history", "fill", "variants")}
        history = doc.get("history", [])
        if previous:
            history = (history + [previous])[-5:]
        kept = {k: doc[k] for k in ("fill", "variants") if k in doc}
        doc.clear()
        doc.update(record)
        doc["history"] = history
        doc.update(kept)

    _merge(Path(args.out), update)
    print(json.dumps(record, indent=1))


def _fill(args) -> None:
    """Fill every run to its own budget; record the peak RSS against --max-memory-bytes."""
    key = new_run_key()
    catalogue = np.asarray(item_tokens(key, np.arange(args.fill_items)))
    limit = args.max_memory_bytes
    flags = ["--max-memory-bytes", str(limit), "--max-runs", str(args.fill_runs)]
    load_before = os.getloadavg()[0]
    address, proc, admin_token = start_local_service(extra_args=flags)
    wall = time.monotonic()
    try:
        admin = NeighbourClient(address, retries=0, token=admin_token)
        rss_start = _proc_kb(proc.pid, "VmRSS") * 1024
        runs = [f"fill{i}" for i in range(args.fill_runs)]
        secrets_ = {r: admin.open_run(r, args.dim, args.fill_tokens, args.max_neighbours) for r in runs}
        full, stored_handles, refusals = set(), {r: [] for r in runs}, Counter()
        deadline = time.monotonic() + args.max_seconds
        lock = threading.Lock()

        def worker(w: int):
            local = np.random.default_rng(args.seed + 1 + w)
            while time.monotonic() < deadline:
                with lock:
                    open_runs = [r for r in runs if r not in full]
                if not open_runs:
                    return
                run = open_runs[local.integers(len(open_runs))]
                handle = new_handle()
                toks = catalogue[local.choice(args.fill_items, args.fill_tokens, replace=False)].tolist()
                try:
                    NeighbourClient(address, retries=3, backoff_s=0.05, timeout_s=30, token=secrets_[run]).submit(
                        run, handle, local.standard_normal(args.dim), toks)
                    with lock:
                        stored_handles[run].append(handle)
                except NeighbourServiceError as exc:
                    with lock:
                        refusals[re.sub(r"\d+", "N", str(exc).split(": ", 1)[-1])[:100]] += 1
                        if "storage budget exhausted" in str(exc):
                            full.add(run)

        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(worker, range(args.threads)))
        fill_s = time.monotonic() - wall
        fetch_ms = []
        for run in runs:  # matching on full runs: its working memory counts in the peak too
            client = NeighbourClient(address, retries=0, timeout_s=30, token=secrets_[run])
            for h in stored_handles[run][:50]:
                start = time.perf_counter()
                client.neighbours(run, h, dim=args.dim, max_neighbours=args.max_neighbours)
                fetch_ms.append((time.perf_counter() - start) * 1000)
        stats = admin.stats()
        peak = _proc_kb(proc.pid, "VmHWM") * 1024
        rss_end = _proc_kb(proc.pid, "VmRSS") * 1024
    finally:
        proc.terminate()
        proc.wait(10)
    record = {
        "date": date.today().isoformat(),
        "machine": _machine(load_before),
        "command": "python -m benchmarks.neighbour_load " + " ".join(sys.argv[1:]),
        "settings": {"service_flags": flags, "runs": args.fill_runs, "dim": args.dim,
                     "tokens_per_submit": args.fill_tokens, "catalogue_items": args.fill_items,
                     "threads": args.threads},
        "max_memory_bytes": limit,
        "service_rss_bytes_at_start": int(rss_start),
        "service_peak_rss_bytes": int(peak),
        "service_rss_bytes_at_end": int(rss_end),
        "peak_rss_over_limit": round(peak / limit, 3),
        "within_1_2x": peak <= 1.2 * limit,
        "every_run_filled_to_its_budget": len(full) == len(runs),
        "fill_seconds": round(fill_s, 2),
        "handles_stored": {r: len(h) for r, h in stored_handles.items()},
        "refusals": dict(refusals),
        "fetch_on_full_runs_ms": {"p50": round(float(np.percentile(fetch_ms, 50)), 2),
                                  "p99": round(float(np.percentile(fetch_ms, 99)), 2)} if fetch_ms else None,
        "service_accounting": {k: stats[k] for k in ("fixed", "request_pool", "data_pool", "reserved_by_runs",
                                                      "stored_bytes")},
        "per_run": stats["runs"],
    }
    _merge(Path(args.out), lambda doc: doc.__setitem__("fill", record))
    print(json.dumps(record, indent=1))


def main() -> None:
    """Run the load (or the fill), print and merge the summary into the results file."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=5000)
    ap.add_argument("--threads", type=int, default=50)
    ap.add_argument("--hostile", type=int, default=20)
    ap.add_argument("--slow-body", type=int, default=200, help="strangers holding a request head + 1 body byte")
    ap.add_argument("--reconnect-delay", type=float, default=0.5, help="a cut stranger reconnects after this")
    ap.add_argument("--items", type=int, default=2000)
    ap.add_argument("--items-per-user", type=int, default=20)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--max-neighbours", type=int, default=10)
    ap.add_argument("--idle-timeout", type=float, default=5.0, help="service --idle-timeout-s and --io-timeout-s")
    ap.add_argument("--max-seconds", type=float, default=100.0, help="requests not started by then are skipped")
    ap.add_argument("--fill", action="store_true", help="fill every run to its budget and measure the RSS instead")
    ap.add_argument("--max-memory-bytes", type=int, default=300_000_000, help="--fill: the service's limit")
    ap.add_argument("--fill-runs", type=int, default=4)
    ap.add_argument("--fill-tokens", type=int, default=2000, help="--fill: tokens per submit")
    ap.add_argument("--fill-items", type=int, default=500_000, help="--fill: catalogue the tokens are drawn from")
    ap.add_argument("--service-arg", action="append", default=[], metavar="FLAG",
                    help="one more service flag (repeat: --service-arg=--exempt-loopback --service-arg=0)")
    ap.add_argument("--record-as", help="store this load run under variants.NAME instead of at the top level")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/neighbour_load.json")
    args = ap.parse_args()
    if args.fill:
        if "--threads" not in sys.argv:
            args.threads = 4
        _fill(args)
    else:
        _load(args)


if __name__ == "__main__":
    main()
