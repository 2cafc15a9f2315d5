"""Bounded capture of a child's stdout or stderr.

A `CappedReader` drains one pipe in the event loop and keeps only the first `max_bytes`; the rest
is read (so the writer never blocks on a full pipe) and counted, never stored. 100 MB of output
costs a little CPU and no memory. Reads happen in `loop.add_reader` callbacks: nothing blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

_CHUNK_BYTES = 1 << 16


class CappedReader:
    """Reads one non-blocking pipe to EOF, keeping at most `max_bytes`. Owns and closes the fd."""

    def __init__(self, fd: int, max_bytes: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._fd = fd
        self._max_bytes = max_bytes
        self._kept = bytearray()
        self.total_bytes = 0
        self._eof: asyncio.Future[None] = self._loop.create_future()
        os.set_blocking(fd, False)
        self._loop.add_reader(fd, self._on_readable)

    @property
    def data(self) -> bytes:
        return bytes(self._kept)

    @property
    def is_truncated(self) -> bool:
        return self.total_bytes > len(self._kept)

    def _on_readable(self) -> None:
        try:
            chunk = os.read(self._fd, _CHUNK_BYTES)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._stop()
            return
        self.total_bytes += len(chunk)
        room = self._max_bytes - len(self._kept)
        if room > 0:
            self._kept += chunk[:room]

    def _stop(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        if not self._eof.done():
            self._eof.set_result(None)

    async def wait_closed(self, timeout_s: float) -> None:
        """Wait until EOF (every writer closed the pipe), at most `timeout_s`; then stop reading.
        Writers still holding the pipe after that (a background process of a session) get EPIPE."""
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._eof), timeout_s)
        self._stop()


def decode_capped(data: bytes, total_bytes: int) -> str:
    """UTF-8 text of the kept bytes, with a marker line when bytes were dropped."""
    text = data.decode("utf-8", errors="replace")
    if total_bytes > len(data):
        text += f"\n[output truncated: showing the first {len(data)} of {total_bytes} bytes]\n"
    return text


def last_line(text: str, max_chars: int = 300) -> str:
    """The last non-empty line (for errors: the exception line of a traceback), shortened."""
    lines = [
        line
        for line in text.strip().splitlines()
        if line.strip() and not line.startswith("[output truncated")
    ]
    return lines[-1].strip()[:max_chars] if lines else ""


def cap_text(text: str, max_bytes: int) -> tuple[str, bool]:
    """`text` cut to `max_bytes` of UTF-8 with the truncation marker; and whether it was cut."""
    data = text.encode("utf-8", errors="replace")
    return decode_capped(data[:max_bytes], len(data)), len(data) > max_bytes
