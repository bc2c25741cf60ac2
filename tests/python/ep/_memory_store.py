"""An in-memory stand-in for torch's Store, for tests whose ranks are
threads of one process (the fast path's setup agreements)."""

import threading
from datetime import timedelta


class MemoryStore:
    """The part of torch's Store that the choice uses: set, get, wait."""

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self.sets = 0

    def set(self, key: str, value: str) -> None:
        with self._changed:
            self._data[key] = value.encode()
            self.sets += 1
            self._changed.notify_all()

    def get(self, key: str) -> bytes:
        with self._changed:
            return self._data[key]

    def wait(self, keys, timeout: timedelta) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: all(k in self._data for k in keys), timeout.total_seconds()):
                raise RuntimeError(f"wait timed out for {[k for k in keys if k not in self._data]}")


class CheckingStore(MemoryStore):
    """MemoryStore plus torch's Store.check (are these keys all set?)."""

    def check(self, keys) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)
