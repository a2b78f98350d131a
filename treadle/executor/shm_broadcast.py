"""One writer, several readers: messages broadcast through a ring of slots in shared memory.

The `mp` executor writes each step message once, and every worker rank reads it from
the same memory, instead of one socket write per rank. The memory is a file under
/dev/shm mapped by every process. Layout: one 64-byte line per reader holding the last
sequence number it consumed (its acknowledgement), then per slot a 64-byte header
(sequence number, payload bytes, whether more chunks follow) and the payload area. A
message larger than a slot travels in consecutive slots. The writer fills a slot only
when every reader has acknowledged the message that held it before, writing the payload
first and the sequence number last; a reader copies the payload once the sequence number
it expects appears, then acknowledges. On x86 (total store order) the two stores are seen
in that order; that is the machine this is used on.

Readers wait by polling with a growing back-off (no spinning once idle for a while: the
cores belong to the model). The creator removes the file when closed.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from typing import Callable

_LINE = 64
_HEADER = struct.Struct("<qqq")  # sequence, payload bytes, more chunks follow
_ACK = struct.Struct("<q")


def _backoff(waited: int) -> None:
    """Wait a little longer each time: spin briefly, then yield, then sleep up to 0.5 ms."""
    if waited < 64:
        return
    if waited < 256:
        time.sleep(0)
    else:
        time.sleep(min(5e-4, 1e-5 * (waited - 255)))


class ShmBroadcast:
    """A ring of `num_slots` slots of `slot_bytes` each, for `num_readers` readers."""

    def __init__(self, path: str, num_readers: int, num_slots: int, slot_bytes: int,
                 reader: int | None, create: bool) -> None:
        self.path, self.num_readers = path, num_readers
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.reader = reader
        size = self._slots_offset + num_slots * (_LINE + slot_bytes)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._mem = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._owner = create
        self._next = 1
        """The next sequence number to write (writer) or to read (reader)."""

    @property
    def _slots_offset(self) -> int:
        return self.num_readers * _LINE

    @classmethod
    def create(cls, num_readers: int, num_slots: int = 8,
               slot_bytes: int = 1 << 20) -> "ShmBroadcast":
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        path = os.path.join(directory, f"treadle-{os.getpid()}-{os.urandom(6).hex()}")
        return cls(path, num_readers, num_slots, slot_bytes, None, True)

    @classmethod
    def attach(cls, spec: str, reader: int) -> "ShmBroadcast":
        """Open the broadcast described by `spec` (from `describe`) as reader `reader`."""
        path, num_readers, num_slots, slot_bytes = spec.rsplit(":", 3)
        return cls(path, int(num_readers), int(num_slots), int(slot_bytes), reader, False)

    def describe(self) -> str:
        return f"{self.path}:{self.num_readers}:{self.num_slots}:{self.slot_bytes}"

    def _slot(self, seq: int) -> int:
        return self._slots_offset + ((seq - 1) % self.num_slots) * (_LINE + self.slot_bytes)

    def _min_ack(self) -> int:
        return min(_ACK.unpack_from(self._mem, r * _LINE)[0] for r in range(self.num_readers))

    def write(self, payload: bytes, check: Callable[[], None] = lambda: None) -> None:
        """Broadcast one message. `check` runs while waiting for a slot to free (it raises
        when a reader is gone)."""
        view = memoryview(payload)
        first = True
        while first or view:
            first = False
            chunk, view = view[:self.slot_bytes], view[self.slot_bytes:]
            seq = self._next
            waited = 0
            while self._min_ack() < seq - self.num_slots:
                waited += 1
                if waited % 1024 == 0:
                    check()
                _backoff(waited)
            offset = self._slot(seq)
            self._mem[offset + _LINE:offset + _LINE + len(chunk)] = chunk
            struct.pack_into("<qq", self._mem, offset + 8, len(chunk), int(bool(view)))
            _ACK.pack_into(self._mem, offset, seq)  # published last
            self._next += 1

    def read(self, check: Callable[[], None] = lambda: None) -> bytes:
        """The next message. `check` runs now and then while waiting (it raises to stop)."""
        parts = []
        while True:
            seq = self._next
            offset = self._slot(seq)
            waited = 0
            while _ACK.unpack_from(self._mem, offset)[0] != seq:
                waited += 1
                if waited % 1024 == 0:
                    check()
                _backoff(waited)
            _, nbytes, more = _HEADER.unpack_from(self._mem, offset)
            parts.append(self._mem[offset + _LINE:offset + _LINE + nbytes])
            _ACK.pack_into(self._mem, self.reader * _LINE, seq)
            self._next += 1
            if not more:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        try:
            self._mem.close()
        except (BufferError, ValueError):
            pass
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
