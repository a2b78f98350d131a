"""The `torchrun` executor: ranks started by an outside launcher, on one node or several.

Every rank is a process that torchrun (or any launcher setting RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT) started. Rank 0 runs the engine core and the rank-0 worker
in-process and drives: each call reaches the other ranks by torch.distributed's object
broadcast over a gloo group (the cross-node fallback of the `mp` executor's
shared-memory ring); start-up answers come back by gather, a step's answer from the
output rank by a point-to-point object send. Every other rank runs `run_worker`: the same
Worker code as under `mp`, in a loop. `treadle serve` and `treadle worker` start it on
ranks other than 0 (docs/parallelism.md has the commands).

A rank that dies breaks the collectives; the call then fails with WorkerDiedError (and
the launcher stops the rest). No torch at import time: workers import it.
"""

from __future__ import annotations

import logging
import os

from treadle.config import EngineConfig
from treadle.core.kv.config import KVCacheConfig
from treadle.core.outputs import ModelRunnerOutput, SchedulerOutput, WorkerInfo
from treadle.executor.base import (Executor, WorkerDiedError, check_rpc_method,
                                   merge_worker_infos)

logger = logging.getLogger(__name__)


def launcher_rank() -> int:
    """This process's rank as the launcher set it (RANK); 0 when unset."""
    return int(os.environ.get("RANK", "0"))


class _Channel:
    """Objects between rank 0 and the others, over a gloo group (any device)."""

    def __init__(self, world_size: int, output_rank: int) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.group = dist.new_group(backend="gloo")
        self.world_size, self.output_rank = world_size, output_rank

    def broadcast(self, message=None):
        box = [message]
        self.dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, answer):
        """Rank 0 gets every rank's answer; the others get None."""
        rank = self.dist.get_rank()
        out = [None] * self.world_size if rank == 0 else None
        self.dist.gather_object(answer, out, dst=0, group=self.group)
        return out

    def send_output(self, output) -> None:
        self.dist.send_object_list([output], dst=0, group=self.group)

    def recv_output(self):
        box = [None]
        self.dist.recv_object_list(box, src=self.output_rank, group=self.group)
        return box[0]


class TorchrunExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        from treadle.worker.worker import Worker

        super().__init__()
        if launcher_rank() != 0:
            raise RuntimeError("the torchrun executor drives from rank 0; other ranks run "
                               "`treadle worker` (or `treadle serve`, which does that for them)")
        par = config.parallel
        self._worker = Worker(config, rank=0, init_method="env://")
        self._channel = _Channel(par.world_size,
                                 (par.pipeline_parallel_size - 1) * par.tensor_parallel_size)
        self._dead: str | None = None

    def _run(self, method: str, *args, **kwargs):
        if self._dead is not None:
            raise WorkerDiedError(self._dead)
        try:
            self._channel.broadcast((method, args, kwargs))
            result = getattr(self._worker, method)(*args, **kwargs)
            if method == "execute_model":
                if self._channel.output_rank != 0:
                    result = self._channel.recv_output()
                return result
            answers = self._channel.gather(result)
        except RuntimeError as exc:  # a broken collective: some rank is gone
            self._dead = f"a torchrun rank failed during {method}: {exc}"
            raise WorkerDiedError(self._dead) from exc
        return answers

    def load(self) -> WorkerInfo:
        return merge_worker_infos(self._run("load"))

    def initialize_cache(self, kv_config: KVCacheConfig) -> None:
        self._run("initialize_cache", kv_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._run("execute_model", scheduler_output)

    def collective_rpc(self, method: str, *args, **kwargs) -> list:
        check_rpc_method(method)
        return self._run(method, *args, **kwargs)

    def shutdown(self) -> None:
        if self._dead is None:
            self._dead = "the engine shut down"
            try:
                self._channel.broadcast(("shutdown", (), {}))
            except RuntimeError:
                pass
            from treadle.worker.parallel_state import leave_parallel
            leave_parallel()


def run_worker(config: EngineConfig) -> int:
    """The loop of a rank other than 0: take each call from rank 0, answer it."""
    from treadle.worker.worker import Worker

    rank = launcher_rank()
    par = config.parallel
    worker = Worker(config, rank=rank, init_method="env://")
    channel = _Channel(par.world_size,
                       (par.pipeline_parallel_size - 1) * par.tensor_parallel_size)
    logger.info("torchrun rank %d of %d serving rank 0", rank, par.world_size)
    while True:
        method, args, kwargs = channel.broadcast()
        if method == "shutdown":
            from treadle.worker.parallel_state import leave_parallel
            leave_parallel()
            return 0
        result = getattr(worker, method)(*args, **kwargs)
        if method == "execute_model":
            if rank == channel.output_rank:
                channel.send_output(result)
        else:
            channel.gather(result)
