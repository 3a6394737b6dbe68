"""What the neighbour service's memory is spent on, counted in bytes, and the budget that bounds it.

`--max-memory-bytes` bounds the whole service process. `MemoryBudget` splits it into:

- fixed reserves: the process itself once started (its RSS before the first request, measured by
  the console script), every connection it may hold (`max_connections` x `CONNECTION_BYTES`, the
  worst case of a held connection) and the working memory of one matching computation;
- the request pool (`max_request_memory_bytes`, default 1/8): each authenticated request reserves
  the bytes its body and reply can take (from its Content-Length, before it is read) and returns
  them when it ends; a request that does not fit now is answered 503, one that can never fit 413;
- the data pool (the rest): each run reserves its own storage budget from it when it opens
  (`max_run_memory_bytes`, default data pool / `max_runs`), so no run can use another's.

Stored bytes are counted from the objects really kept (`sys.getsizeof`, numpy `nbytes`, the
allocator's 16-byte blocks and malloc headers), not from a per-item guess; tests compare the count
with tracemalloc and the benchmark with the process RSS.
"""

from __future__ import annotations

import array
import os
import sys
import threading

import numpy as np

ALIGN = 16  # CPython's small-object allocator and glibc malloc both hand out 16-byte multiples on 64-bit
MALLOC_HEADER = 8  # glibc: the size word in front of every malloc'd chunk
CONNECTION_BYTES = 64 << 10  # one held connection at worst: a 16-header head never finished (measured 57 KiB; idle: 4)
DICT_BYTES_PER_ENTRY = 45  # str-keyed dict right after a resize (measured worst: 44.0, n >= 8)
DICT_FIXED_BYTES = 640
LIST_BYTES_PER_ENTRY = 15  # list right after a resize (measured worst: 14.2, n >= 8)
LIST_FIXED_BYTES = 160
ARRAY_FIXED = sys.getsizeof(array.array("i"))  # an empty array.array object
ARRAY_OVERHEAD = 32  # an array.array's object block rounding, its buffer's malloc header and rounding
NDARRAY_EXTRA = 32  # a numpy array's shape / strides block, allocated apart from the object (measured per handle)
INT_BYTES = 32  # an int above 256 (smaller ones are cached): 28 bytes in a 32-byte block
PARSE_FACTOR = 16  # working memory of a JSON body per byte (measured worst: 12.8 for 2-character strings, + the bytes)
PARSE_FIXED = 16 << 10


_EMPTY = {dict: sys.getsizeof({}), list: sys.getsizeof([])}


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


TOKEN_STR_BYTES = _align(sys.getsizeof("0" * 32))  # a stored token or handle: 32 ASCII characters


def _heap(n: int) -> int:
    """A malloc'd buffer of n bytes: header, 16-byte rounding, 32-byte minimum chunk."""
    return max(32, _align(n + MALLOC_HEADER))


def obj_bytes(obj) -> int:
    """Bytes one stored object occupies: its header block plus, for numpy and array buffers, the buffer."""
    if isinstance(obj, np.ndarray):
        return _align(sys.getsizeof(obj) - obj.nbytes) + _heap(obj.nbytes) + NDARRAY_EXTRA
    if isinstance(obj, array.array):
        buffer = sys.getsizeof(obj) - ARRAY_FIXED
        return _align(ARRAY_FIXED) + (_heap(buffer) if buffer > 0 else 0)
    if isinstance(obj, (dict, list)):  # the object and its separately allocated table
        base = _EMPTY[type(obj)]
        table = sys.getsizeof(obj) - base
        return _align(base) + (_heap(table) if table > 0 else 0)
    return _align(sys.getsizeof(obj))


def array_bytes(n_items: int, itemsize: int = 4) -> int:
    """Upper bound of what an array.array of n appended items occupies (CPython over-allocates n/16 + 7)."""
    return _align(ARRAY_FIXED) + (_heap(itemsize * (n_items + (n_items >> 4) + 8)) if n_items else 0)


def dict_bytes(n: int) -> int:
    """Upper bound of a str-keyed dict with n entries, including the moment right after it grew."""
    return DICT_FIXED_BYTES + DICT_BYTES_PER_ENTRY * n


def list_bytes(n: int) -> int:
    """Upper bound of a list with n slots, including the moment right after it grew."""
    return LIST_FIXED_BYTES + LIST_BYTES_PER_ENTRY * n


def ndarray_bytes(n_items: int, itemsize: int = 4) -> int:
    """What a 1-D owning numpy array of n items occupies (header block plus its data)."""
    return _align(sys.getsizeof(np.zeros(0, np.float32))) + _heap(itemsize * n_items) + NDARRAY_EXTRA


def process_rss_bytes() -> int | None:
    """This process's resident memory now (Linux /proc/self/statm), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class MemoryBudget:
    """The split of `max_memory_bytes` into fixed reserves, the request pool and the data pool (thread-safe).

    Runs reserve their storage budget from the data pool when they open and give it back when they
    close or expire; requests reserve from the request pool while they are served.
    """

    def __init__(self, total: int, request_pool: int = 0):
        self.total = int(total)
        self.request_capacity = int(request_pool) if request_pool > 0 else self.total // 8
        self.fixed: dict[str, int] = {}
        self.request_used = 0
        self.run_reserved = 0
        self.lock = threading.Lock()

    @property
    def data_pool(self) -> int:
        """Bytes left for stored data once fixed reserves and the request pool are taken."""
        return self.total - sum(self.fixed.values()) - self.request_capacity

    def set_fixed(self, name: str, nbytes: int) -> None:
        """Set one fixed reserve (the process baseline, the connections, one computation)."""
        with self.lock:
            self.fixed[name] = max(0, int(nbytes))

    def reserve_run(self, nbytes: int) -> bool:
        """Take a run's storage budget from the data pool; False when the pool cannot give it."""
        with self.lock:
            if self.run_reserved + nbytes > self.data_pool:
                return False
            self.run_reserved += nbytes
            return True

    def release_run(self, nbytes: int) -> None:
        """Give a closed or expired run's budget back."""
        with self.lock:
            self.run_reserved = max(0, self.run_reserved - nbytes)

    def acquire_request(self, nbytes: int) -> bool:
        """Reserve working memory for one request; False when the pool is full now."""
        with self.lock:
            if self.request_used + nbytes > self.request_capacity:
                return False
            self.request_used += nbytes
            return True

    def release_request(self, nbytes: int) -> None:
        """Return a finished request's working memory."""
        with self.lock:
            self.request_used = max(0, self.request_used - nbytes)

    def snapshot(self) -> dict:
        """The accounting as plain numbers (the admin's /stats)."""
        with self.lock:
            return {"max_memory_bytes": self.total, "fixed": dict(self.fixed),
                    "request_pool": {"capacity": self.request_capacity, "used": self.request_used},
                    "data_pool": self.data_pool, "reserved_by_runs": self.run_reserved}
