"""P/D's KV transfer between two Ray actors: the object store against a direct channel
(`python benchmarks/pd_transfer.py`).

One prompt's KV in the demo model's shape (30 layers x K/V x 3 heads x 64, bf16, 16-token
blocks: 368 KiB a block) for several block counts, moved from a sender actor to a
receiver actor on this machine, the two ways alternating, each timed on the receiver
from asking to holding the array: `object store` — what P/D does: an actor call whose
result is the numpy array (Ray puts it in the node's shared-memory object store; the
receiver maps it in place); `socket` — a TCP connection between the actors on 127.0.0.1
kept open, the receiver asking with 8 bytes and reading the whole array into a buffer.
Medians, min and max over the repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import numpy as np

BLOCK_SHAPE = (30, 2, 3, 16, 64)  # layers, K/V, KV heads, tokens, head dim (bf16 as int16)


class Sender:
    def __init__(self) -> None:
        self.arrays: dict[int, np.ndarray] = {}
        self.port = None

    def make(self, num_blocks: int) -> int:
        rng = np.random.default_rng(num_blocks)
        shape = BLOCK_SHAPE[:3] + (num_blocks,) + BLOCK_SHAPE[3:]
        self.arrays[num_blocks] = rng.integers(-2**15, 2**15, size=shape, dtype=np.int16)
        return self.arrays[num_blocks].nbytes

    def get(self, num_blocks: int) -> np.ndarray:
        return self.arrays[num_blocks]

    async def serve(self) -> int:
        async def handle(reader, writer):
            while True:
                try:
                    head = await reader.readexactly(8)
                except asyncio.IncompleteReadError:
                    return
                array = self.arrays[int.from_bytes(head, "little")]
                writer.write(memoryview(array).cast("B"))
                await writer.drain()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self._server = server
        return server.sockets[0].getsockname()[1]


class Receiver:
    def __init__(self, sender) -> None:
        self.sender = sender
        self.reader = self.writer = None

    async def connect(self, port: int) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", port)

    async def via_object_store(self, num_blocks: int) -> float:
        t0 = time.perf_counter()
        array = await self.sender.get.remote(num_blocks)
        assert array.shape[3] == num_blocks
        return time.perf_counter() - t0

    async def via_socket(self, num_blocks: int, nbytes: int) -> float:
        t0 = time.perf_counter()
        self.writer.write(num_blocks.to_bytes(8, "little"))
        await self.writer.drain()
        buf = await self.reader.readexactly(nbytes)
        array = np.frombuffer(buf, dtype=np.int16)
        assert array.nbytes == nbytes
        return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    import ray

    parser = argparse.ArgumentParser(prog="python benchmarks/pd_transfer.py")
    parser.add_argument("--blocks", default="1,8,32,96")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        sender = ray.remote(Sender).options(num_cpus=0.5).remote()
        receiver = ray.remote(Receiver).options(num_cpus=0.5).remote(sender)
        port = ray.get(sender.serve.remote())
        ray.get(receiver.connect.remote(port))
        rows = []
        for n in (int(b) for b in args.blocks.split(",")):
            nbytes = ray.get(sender.make.remote(n))
            times = {"object store": [], "socket": []}
            for _ in range(2):  # warm-up
                ray.get(receiver.via_object_store.remote(n))
                ray.get(receiver.via_socket.remote(n, nbytes))
            for i in range(args.repeats):
                order = ["object store", "socket"] if i % 2 == 0 else ["socket", "object store"]
                for way in order:
                    call = (receiver.via_object_store.remote(n) if way == "object store"
                            else receiver.via_socket.remote(n, nbytes))
                    times[way].append(ray.get(call))
            row = {"blocks": n, "MiB": nbytes / 2**20}
            for way, values in times.items():
                ms = [v * 1000 for v in values]
                row[way] = {"median_ms": statistics.median(ms), "min_ms": min(ms),
                            "max_ms": max(ms),
                            "GB_per_s": nbytes / statistics.median(values) / 1e9}
            rows.append(row)
            print(f"{n:4d} blocks {row['MiB']:7.2f} MiB: object store "
                  f"{row['object store']['median_ms']:.2f} ms "
                  f"({row['object store']['min_ms']:.2f}-{row['object store']['max_ms']:.2f}), "
                  f"socket {row['socket']['median_ms']:.2f} ms "
                  f"({row['socket']['min_ms']:.2f}-{row['socket']['max_ms']:.2f})",
                  file=sys.stderr, flush=True)
        print(json.dumps(rows, indent=1))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
