"""Files and folders a run writes: atomic writes, folders checked before use, and a run's lock on its folder.

A folder that cannot be used (not a directory, not writable, full, or held by another run) raises a
FolderError naming it and what was expected, instead of an OSError from deep inside a write.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".fedrec.lock"  # in a locked folder: the pid of the run that holds it
_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)


class FolderError(OSError):
    """A folder that cannot be used: not a directory, not writable, or in use by another run (an input error)."""


class DiskFullError(FolderError):
    """No space left on the device (or quota) while writing into a folder (the run fails; not an input error)."""


def _blocker(path: Path) -> Path:
    """The nearest of `path` and its parents that exists (the file in the way of a folder)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return path


def _reason(exc: OSError, folder: Path, what: str, doing: str) -> FolderError | None:
    """The FolderError an OSError raised while `doing` something in `folder` stands for, or None (another error)."""
    if exc.errno in _FULL:
        return DiskFullError(f"{what} {folder}: no space left on the device while {doing}; expected free space "
                             "(free some, or choose another folder)")
    if isinstance(exc, (FileExistsError, NotADirectoryError)) or exc.errno in (errno.EEXIST, errno.ENOTDIR):
        blocker = _blocker(folder)
        return FolderError(f"{what} {folder}: not a directory ({blocker} is a file); expected a folder")
    if exc.errno in _DENIED:
        return FolderError(f"{what} {folder}: not writable ({exc.strerror}); expected a folder this user can write")
    return None


@contextmanager
def writing_into(folder: Path | str, what: str = "folder", doing: str = "writing") -> Iterator[None]:
    """Turn the OSErrors of writes into `folder` that mean the folder is unusable (not a directory, not
    writable, full) into a FolderError naming it; other errors pass unchanged."""
    try:
        yield
    except FolderError:
        raise
    except OSError as exc:
        mapped = _reason(exc, Path(folder), what, doing)
        if mapped is None:
            raise
        raise mapped from exc


def writable_folder(path: Path | str, what: str = "folder") -> Path:
    """`path` as a folder this process can write (created with its parents); FolderError naming it otherwise."""
    path = Path(path)
    with writing_into(path, what, "creating it"):
        if path.exists() and not path.is_dir():
            raise FileExistsError(errno.EEXIST, "File exists", str(path))
        path.mkdir(parents=True, exist_ok=True)
    with writing_into(path, what, "writing a probe file"):
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        try:
            os.write(fd, b"probe")
            os.fsync(fd)
        finally:
            os.close(fd)
            Path(probe).unlink(missing_ok=True)
    return path


def atomic_write(path: Path, data: bytes | str) -> Path:
    """Write `data` to `path` so readers see the old file or the whole new one, never a part; a folder that
    cannot take it raises FolderError (DiskFullError when the device is full) naming the folder."""
    path = Path(path)
    with writing_into(path.parent, "folder", f"writing {path.name}"):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data.encode() if isinstance(data, str) else data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _holder(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _in_use(what: str, folder: Path, holder: int | None, path: Path) -> FolderError:
    """The one-line error for a folder another live run holds the lock of."""
    return FolderError(f"{what} {folder} is in use by another run (pid {holder if holder else '?'}, lock file {path}); "
                       "expected a folder no running run writes: wait for it to end, or choose another folder")


@contextmanager
def exclusive_lock(lock: Path) -> Iterator[None]:
    """Wait for an exclusive advisory lock on the file `lock` (created, with its folder, if missing) and hold it for
    a read-modify-write that another process may be doing at the same time."""
    import fcntl

    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def folder_lock(folder: Path | str, what: str = "output folder") -> Iterator[Path]:
    """Hold `folder` (created and checked writable) for one run: an advisory lock file `.fedrec.lock` holding
    this process's pid, refused with a FolderError while another live run holds it, removed at exit.

    The lock is an flock(2) on the file, so the kernel drops it when its process dies however it ends: a
    lock file left by a dead run is taken over. Where flock is not supported, the pid decides: a file
    naming a live process other than this one is held, one naming a dead process is stale and taken over.
    """
    import fcntl

    folder = writable_folder(folder, what)
    path = folder / LOCK_FILE
    while True:
        with writing_into(folder, what, f"creating the lock file {LOCK_FILE}"):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _in_use(what, folder, _holder(path), path) from None
        except OSError as exc:  # no flock on this file system: the pid in the file decides
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            holder = _holder(path)
            if holder is not None and holder != os.getpid() and _pid_alive(holder):
                os.close(fd)
                raise _in_use(what, folder, holder, path) from None
        try:  # a run that finished unlinked the file we opened: lock the new one instead
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        try:
            if _holder(path) == os.getpid():
                path.unlink()
        except FileNotFoundError:
            pass
        os.close(fd)
