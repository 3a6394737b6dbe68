"""`fedrec-neighbour-service`: the neighbour service's console script.

    fedrec-neighbour-service --host 0.0.0.0 --port 8765 --admin-token-file TOKEN [--certfile PEM --keyfile KEY]
                             [--parent-pid PID] [--max-... N | --...-s SECONDS ...]

Every flag is checked before the service starts: the port (1-65535), the admin token (a readable
file, else $FEDREC_NB_ADMIN_TOKEN, at least 16 characters), the certificate and key (readable files
that load as a matching pair, given together), the parent process, and every limit (`Limits.check`).
A bad flag prints one line naming it and what was expected, and exits 2, without a traceback, as
`fedrec` does; so does an address the service cannot listen on, or a `--max-memory-bytes` that
leaves no room for data once the process itself is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import ssl

from .limits import Limits
from .memory import process_rss_bytes
from .runs import RUN_FIXED_BYTES
from .server import start, tls_context
from .service import NeighbourService

log = logging.getLogger("fedrec_flwr.neighbours")
PROG = "fedrec-neighbour-service"
ADMIN_TOKEN_ENV = "FEDREC_NB_ADMIN_TOKEN"
MIN_TOKEN_CHARS = 16


class FlagError(ValueError):
    """A flag whose value the service cannot run with; the message names the flag."""


class _Parser(argparse.ArgumentParser):
    """argparse with its usage errors on one line (naming the command and the flag), exit status 2, and no
    abbreviated flags."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port in 1-65535, got {text!r}")
    return port


def _pid(text: str) -> int:
    try:
        pid = int(text)
    except ValueError:
        pid = -1
    if pid < 0:
        raise argparse.ArgumentTypeError(f"expected a process id, or 0 for none, got {text!r}")
    return pid


def parser() -> argparse.ArgumentParser:
    """The console script's flags: where to listen, the credentials, and one flag per field of `Limits`."""
    ap = _Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    ap.add_argument("--port", type=_port, default=8765, help="TCP port, 1-65535 (default 8765)")
    ap.add_argument("--admin-token-file", metavar="FILE",
                    help=f"file holding the operator token (else ${ADMIN_TOKEN_ENV})")
    ap.add_argument("--certfile", metavar="PEM", help="TLS certificate; with --keyfile the service speaks HTTPS only")
    ap.add_argument("--keyfile", metavar="KEY", help="TLS private key (PEM)")
    ap.add_argument("--parent-pid", type=_pid, default=0, metavar="PID",
                    help="stop when this process (the one that started the service) is gone; 0: never")
    for f in dataclasses.fields(Limits):
        seconds = isinstance(f.default, float)
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default,
                        metavar="SECONDS" if seconds else "N", help=f"default {f.default}")
    return ap


def read_admin_token(path: str | None) -> str:
    """The operator's admin token from --admin-token-file, else the environment; FlagError if missing or short."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise FlagError(f"--admin-token-file {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})")
        where = f"--admin-token-file {path}"
    else:
        token, where = os.environ.get(ADMIN_TOKEN_ENV, "").strip(), f"${ADMIN_TOKEN_ENV}"
    if len(token) < MIN_TOKEN_CHARS:
        raise FlagError(f"an admin token of at least {MIN_TOKEN_CHARS} characters is required: --admin-token-file "
                        f"FILE or ${ADMIN_TOKEN_ENV} ({where} holds {len(token)})")
    return token


def load_tls(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    """The TLS context of --certfile / --keyfile (None without them); FlagError naming the flag that is wrong."""
    if not certfile and not keyfile:
        return None
    if not certfile or not keyfile:
        raise FlagError("--certfile and --keyfile go together")
    for flag, path in (("--certfile", certfile), ("--keyfile", keyfile)):
        if not os.path.isfile(path):
            raise FlagError(f"{flag} {path}: no such file")
        if not os.access(path, os.R_OK):
            raise FlagError(f"{flag} {path}: not readable")
    try:
        return tls_context(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        raise FlagError(f"--certfile {certfile} --keyfile {keyfile}: not a PEM certificate and its private key "
                        f"({reason})") from None


def check_flags(args: argparse.Namespace) -> tuple[str, Limits, ssl.SSLContext | None]:
    """(admin token, limits, TLS context) from the parsed flags; FlagError naming the first bad one."""
    if not args.host.strip():
        raise FlagError(f"--host must be a host name or IP address (0.0.0.0 for every interface), got {args.host!r}")
    if args.parent_pid and args.parent_pid != os.getppid():
        raise FlagError(f"--parent-pid {args.parent_pid} is not this process's parent ({os.getppid()}); expected "
                        "the PID of the process that starts the service, or 0")
    try:
        limits = Limits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
        limits.check()
    except ValueError as exc:
        raise FlagError(str(exc)) from None
    token = read_admin_token(args.admin_token_file)
    return token, limits, load_tls(args.certfile, args.keyfile)


def raise_fd_limit(wanted: int) -> None:
    """Let the process hold `wanted` file descriptors if the hard limit allows (max_connections needs them)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE,
                               (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY and soft < wanted:
            log.warning("file-descriptor limit %d is below --max-connections + 64 = %d", soft, wanted)
    except (ImportError, ValueError, OSError):
        pass


async def run_service(args: argparse.Namespace, token: str, limits: Limits, ctx: ssl.SSLContext | None) -> None:
    """Serve until interrupted, or until --parent-pid is gone; FlagError when it cannot listen or has no memory."""
    service = NeighbourService(limits, token)
    try:
        listening = await start(service, args.host, args.port, ctx)
    except OSError as exc:
        raise FlagError(f"--host {args.host} --port {args.port}: cannot listen there "
                        f"({exc.strerror or exc})") from None
    service.budget.set_fixed("process", process_rss_bytes() or 0)  # the interpreter, numpy, aiohttp: measured
    pool = service.budget.data_pool
    if pool < RUN_FIXED_BYTES * limits.max_runs:
        await listening.stop()
        raise FlagError(f"--max-memory-bytes {limits.max_memory_bytes} leaves no room for data: "
                        f"{json.dumps(service.budget.snapshot()['fixed'])} and a request pool of "
                        f"{service.budget.request_capacity} bytes take it all")
    log.info("neighbour service listening on %s://%s:%d (data pool %d bytes, %d per run by default)",
             "https" if ctx else "http", args.host, listening.port, pool, service.default_run_budget())
    if not args.parent_pid:
        await asyncio.Event().wait()
    while os.getppid() == args.parent_pid:  # re-parented once the parent dies, however it died
        await asyncio.sleep(1.0)
    log.info("parent process %d is gone: stopping", args.parent_pid)
    await listening.stop()


def main(argv: list[str] | None = None) -> None:
    """Check every flag, then serve; a bad flag prints one line naming it and exits 2."""
    ap = parser()
    args = ap.parse_args(argv)
    try:
        token, limits, ctx = check_flags(args)
    except FlagError as exc:
        ap.error(str(exc))
    logging.basicConfig(level=logging.INFO)
    raise_fd_limit(limits.max_connections + 64)
    try:
        asyncio.run(run_service(args, token, limits, ctx))
    except FlagError as exc:
        ap.error(str(exc))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
