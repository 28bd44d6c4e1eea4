"""One bounded, thread-safe, least-recently-used map for every in-process memory.

jitbyoc remembers compiled code (:mod:`jitbyoc.toolchain.cache`), partitions (:mod:`jitbyoc.tvm.partition`)
and loaded runtime modules (:mod:`jitbyoc.toolchain.driver`); each is an :class:`LRU` bounded in
entries and, where its values vary in size, in their total size, so a process that builds
many models does not grow with them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable


class LRU:
    """At most ``entries`` values, and at most ``max_size`` in total of ``size(value)``
    (the newest value always stays); the least recently used go first."""

    def __init__(self, entries: int, max_size: int | None = None, size: Callable[[Any], int] | None = None):
        self.entries, self.max_size, self._size = entries, max_size, size or (lambda _: 0)
        self._items: OrderedDict = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def get(self, key, default=None):
        with self._lock:
            if key not in self._items:
                return default
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key, value) -> None:
        with self._lock:
            if key in self._items:
                self._total -= self._size(self._items.pop(key))
            self._items[key] = value
            self._total += self._size(value)
            while len(self._items) > self.entries or (
                    self.max_size is not None and self._total > self.max_size and len(self._items) > 1):
                self._total -= self._size(self._items.popitem(last=False)[1])

    def values(self) -> list:
        with self._lock:
            return list(self._items.values())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._total = 0

    def __len__(self) -> int:
        return len(self._items)
