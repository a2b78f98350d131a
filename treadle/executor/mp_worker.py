"""A child process of the `mp` executor: one worker rank serving broadcast calls.

Run by executor/mp.py as `python -m treadle.executor.mp_worker FD LOG_LEVEL RANK BROADCAST
INIT_METHOD CORES`: FD is this rank's end of its answer socket, BROADCAST the
shared-memory ring every call arrives on (executor/shm_broadcast.py), INIT_METHOD where
the ranks' process group meets, CORES the cores to bind to ("" for none). Each call is
(method, args); this rank answers ("ok", result) — for a step only the output rank does
— or ("error", (exception, traceback text)). The process ends on "shutdown", when the
parent's end of the socket closes, or when the parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from treadle.executor.shm_broadcast import ShmBroadcast

_PR_SET_PDEATHSIG = 1


class _ParentGone(Exception):
    pass


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the closed socket still ends the process
        pass


def _send_error(conn: Connection, exc: BaseException) -> None:
    text = traceback.format_exc()
    try:
        conn.send(("error", (exc, text)))
    except Exception:  # an exception that does not pickle: its text only
        conn.send(("error", (None, text)))


def serve(conn: Connection, broadcast: ShmBroadcast, rank: int, init_method: str,
          cores: list[int]) -> None:
    def parent_alive() -> None:
        if conn.poll():  # the parent never writes here: readable means its end closed
            raise _ParentGone

    worker = None
    while True:
        try:
            method, args, kwargs = pickle.loads(broadcast.read(parent_alive))
        except _ParentGone:
            return
        if method == "shutdown":
            return
        try:
            if method == "create":
                from treadle.worker.worker import Worker

                worker = Worker(*args, rank=rank, init_method=init_method, cores=cores)
                result = None
            else:
                result = getattr(worker, method)(*args, **kwargs)
            if method != "execute_model" or worker.is_output_rank:
                conn.send(("ok", result))
        except (BrokenPipeError, ConnectionResetError):
            return  # the parent has gone: nobody to answer
        except Exception as exc:  # the parent raises it in the engine, as it was
            try:
                _send_error(conn, exc)
            except (BrokenPipeError, ConnectionResetError):
                return


def main() -> int:
    fd, level, rank = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec, init_method, cores = sys.argv[4], sys.argv[5], sys.argv[6]
    _die_with_parent()
    logging.basicConfig(level=level, format=f"%(asctime)s %(levelname)s rank{rank} "
                                            "%(name)s: %(message)s")
    broadcast = ShmBroadcast.attach(spec, rank)
    try:
        serve(Connection(fd), broadcast, rank, init_method,
              [int(c) for c in cores.split(",") if c])
    finally:
        broadcast.close()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's teardown: finalizing torch's modules and freeing
    # the KV cache took ~0.6 s of every engine shutdown, for a process that is gone next.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
