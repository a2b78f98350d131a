"""The shared-memory broadcast: every reader gets every message, whole and in order,
including messages larger than a slot and more messages than slots, and a writer waits
for the slowest reader."""

from __future__ import annotations

import os
import random
import threading

import pytest

from treadle.executor.shm_broadcast import ShmBroadcast


@pytest.mark.parametrize("num_readers", [1, 3])
def test_every_reader_gets_every_message_in_order(num_readers):
    writer = ShmBroadcast.create(num_readers, num_slots=3, slot_bytes=100)
    rng = random.Random(num_readers)
    messages = [os.urandom(rng.choice([0, 1, 99, 100, 101, 250, 1000])) for _ in range(40)]
    got: dict[int, list[bytes]] = {}

    def read(index: int) -> None:
        reader = ShmBroadcast.attach(writer.describe(), index)
        got[index] = [reader.read() for _ in messages]
        reader.close()

    threads = [threading.Thread(target=read, args=(i,)) for i in range(num_readers)]
    for t in threads:
        t.start()
    for m in messages:
        writer.write(m)
    for t in threads:
        t.join(30)
    assert all(got[i] == messages for i in range(num_readers))
    writer.close()
    assert not os.path.exists(writer.path)


def test_writer_waits_for_readers_and_check_can_stop_it():
    writer = ShmBroadcast.create(1, num_slots=2, slot_bytes=16)
    writer.write(b"a")
    writer.write(b"b")

    class Gone(Exception):
        pass

    def check():
        raise Gone

    with pytest.raises(Gone):  # the ring is full and the reader never reads
        writer.write(b"c", check)
    reader = ShmBroadcast.attach(writer.describe(), 0)
    assert [reader.read(), reader.read()] == [b"a", b"b"]
    writer.write(b"c")
    assert reader.read() == b"c"
    writer.close()
