"""The child process of the `mp` executor: a Worker serving calls over a socket.

Run as `python -m treadle.executor.mp_worker FD LOG_LEVEL` by executor/mp.py, which owns
the other end of the socket FD. Each message is (method, args); the answer is ("ok",
result) or ("error", (exception, traceback text)). The process ends when the connection
closes.
"""

from __future__ import annotations

import logging
import sys
import traceback
from multiprocessing.connection import Connection


def serve(conn: Connection) -> None:
    worker = None
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if method == "create":
                from treadle.worker.worker import Worker

                worker = Worker(*args)
                result = None
            else:
                result = getattr(worker, method)(*args)
            conn.send(("ok", result))
        except Exception as exc:  # the parent raises it in the engine, as it was
            text = traceback.format_exc()
            try:
                conn.send(("error", (exc, text)))
            except Exception:  # an exception that does not pickle: its text only
                conn.send(("error", (None, text)))


def main() -> int:
    fd, level = int(sys.argv[1]), int(sys.argv[2])
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(Connection(fd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
