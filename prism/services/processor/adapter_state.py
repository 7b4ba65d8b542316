"""The adapters a mesh serves, once they change at run time, kept in a file (`--lora-state`)
rather than in one processor's memory: fronts that share their ports each serve what any of
them loaded or unloaded, and a front started again serves what was loaded before it died.

The file holds every adapter served (name → path), those of `--lora-modules` included, from
the first change on; until then there is none and the flags' adapters are served. A change
is a read, an edit and an atomic replace under an exclusive lock (a file beside it), held
only for that: never while an engine loads."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator


class AdapterState:
    def __init__(self, path: str) -> None:
        self.path = path
        # The file as last read: its identity and what it held.
        self._seen: tuple[int, int, int] | None = None
        self._held: dict[str, str] | None = None

    def read(self) -> dict[str, str] | None:
        """The adapters the file holds (None: no change yet), read again only when it was
        replaced since."""
        try:
            status = os.stat(self.path)
        except FileNotFoundError:
            return None
        seen = (status.st_ino, status.st_mtime_ns, status.st_size)
        if seen != self._seen:
            with open(self.path, encoding="utf-8") as file:
                self._held = json.load(file)
            self._seen = seen
        return self._held

    @contextlib.contextmanager
    def changing(self, served: dict[str, str]) -> Iterator[dict[str, str]]:
        """The adapters to change (the file's, else `served`), written back when the block
        ends without an error; no other front changes them meanwhile."""
        with open(f"{self.path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = self.read()
            adapters = dict(served if held is None else held)
            yield adapters
            temporary = f"{self.path}.{os.getpid()}"
            with open(temporary, "w", encoding="utf-8") as file:
                json.dump(adapters, file)
            os.replace(temporary, self.path)
