"""The frames wire's reading side (ft_core.control.frames): frames out of a byte stream, and a one-reader box.

Every frame is `u32 length` (big-endian) + body; a frame over MAX_FRAME is a protocol error, not a message.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import struct
from typing import Any

__all__ = ["MAX_FRAME", "FrameReader", "Mailbox"]

_LENGTH = struct.Struct("!I")
MAX_FRAME = 4 << 20  # as gRPC's message cap


def _frame(body: bytes) -> bytes:
    return _LENGTH.pack(len(body)) + body


class FrameReader(asyncio.BufferedProtocol, metaclass=abc.ABCMeta):
    """A protocol that reads length-prefixed frames into one reused buffer (recv_into) and hands each frame's
    body to frame_received. asyncio's plain Protocol allocates a 256 KiB bytes object for every read, which
    glibc maps, shrinks and unmaps: three system calls beside each recv, a quarter of a busy lighthouse's CPU."""

    _FIRST_BUFFER = 8 << 10  # most frames are a few hundred bytes; a longer one grows the buffer to fit

    def __init__(self) -> None:
        self._rbuf = bytearray(self._FIRST_BUFFER)
        self._rstart = self._rend = 0  # unread bytes are _rbuf[_rstart:_rend]
        self._rneed = 0  # bytes the frame at _rstart needs in all, once its length is known
        self._reading = True

    def get_buffer(self, sizehint: int) -> memoryview:
        buf, start, end = self._rbuf, self._rstart, self._rend
        if self._rneed > len(buf) - start or len(buf) - end < 1024:  # make room: move the unread bytes to the front
            unread = end - start
            if self._rneed > len(buf):
                bigger = bytearray(self._rneed)
                bigger[:unread] = buf[start:end]
                self._rbuf = buf = bigger
            else:
                buf[:unread] = buf[start:end]  # same length: no resize, so safe whatever views exist
            self._rstart, self._rend = 0, unread
        return memoryview(buf)[self._rend:]

    def buffer_updated(self, nbytes: int) -> None:
        self._rend += nbytes
        buf = self._rbuf
        while self._reading:
            start, available = self._rstart, self._rend - self._rstart
            if available < _LENGTH.size:
                break
            (length,) = _LENGTH.unpack_from(buf, start)
            if length > MAX_FRAME:
                self.stop_reading()
                self.frame_too_long(length)
                return
            total = _LENGTH.size + length
            if available < total:
                self._rneed = total
                break
            self._rneed = 0
            self._rstart = start + total
            with memoryview(buf) as view:
                body = bytes(view[start + _LENGTH.size:start + total])
            self.frame_received(body)
        if self._rstart == self._rend:
            self._rstart = self._rend = 0

    def stop_reading(self) -> None:
        """Drop what is buffered and ignore what arrives later (the connection is being closed)."""
        self._reading = False
        self._rstart = self._rend = self._rneed = 0

    @abc.abstractmethod
    def frame_received(self, body: bytes) -> None:
        """One whole frame's body, in order."""

    @abc.abstractmethod
    def frame_too_long(self, length: int) -> None:
        """A frame announced itself longer than MAX_FRAME: reading has stopped; close the connection."""


class Mailbox:
    """A first-in first-out box with one reader, on one loop: what asyncio.Queue does for this case without its
    per-call loop lookup (get_running_loop makes a getpid system call on every get)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: collections.deque = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> Any:
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()

    def get_nowait(self) -> Any:
        return self._items.popleft()

    def empty(self) -> bool:
        return not self._items
