"""Ctrl-C that stops a run whichever thread the kernel hands the signal to.

asyncio.run turns the first SIGINT into a cancel of the main task, but Python runs signal handlers only in
the main thread, when it next executes bytecode. A process-directed signal may be delivered to any thread
that does not block it (Linux picks another one when the main thread already has a signal pending); the main
thread, asleep in the event loop's select() with nothing due, then sleeps on — through the whole warm start,
which runs on a worker thread — and the run ignores Ctrl-C until it next wakes. A wakeup fd fixes that: the C
handler writes a byte to it from whatever thread caught the signal, and the loop, watching it, wakes.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(BlockingIOError, InterruptedError):
        while sock.recv(4096):
            pass


async def woken_by_signals(awaitable: Awaitable[T]) -> T:
    """Await `awaitable` with the running loop woken by any signal, on any thread. Leaves an existing
    wakeup fd alone (a loop with its own signal handlers already has one); off the main thread (vcpo's
    commands called from a thread) there is nothing to wake."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        return await awaitable
    loop = asyncio.get_running_loop()
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    previous = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        reader.close()
        writer.close()
        return await awaitable
    loop.add_reader(reader.fileno(), _drain, reader)
    try:
        return await awaitable
    finally:
        signal.set_wakeup_fd(-1)
        loop.remove_reader(reader.fileno())
        reader.close()
        writer.close()
