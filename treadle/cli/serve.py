"""`treadle serve` and `treadle worker`: the OpenAI-compatible server (one engine, or
replicas on Ray), and the ranks other than 0 under torchrun.

This module parses arguments, runs the fail-fast checks (cli/preflight.py: the configs,
the optional packages, the model option, then the port, bound and held) before anything
heavy is imported, and hands the configs and the bound socket to treadle.server.serve
and the torchrun executor; it holds no engine or server logic.
"""

from __future__ import annotations

import argparse
import dataclasses

from treadle.batch.config import BatchConfig
from treadle.cli.options import add_config_file_argument
from treadle.config import add_config_arguments, add_dataclass_arguments, options_from_args
from treadle.server.config import ServerConfig


def _cmd_serve(args: argparse.Namespace) -> int:
    from treadle.cli import preflight
    from treadle.compat import check_serving
    from treadle.config import EngineConfig, dataclass_from_args
    from treadle.distributed.config import ReplicaConfig
    from treadle.executor.torchrun import launcher_rank

    config = EngineConfig.from_options(**options_from_args(args))
    if config.parallel.executor == "torchrun" and launcher_rank() != 0:
        return _cmd_worker(args)  # one command for every rank: only rank 0 serves
    replica_config = dataclass_from_args(ReplicaConfig, args)
    if replica_config.on_ray:  # these read one engine's steps: off unless asked for
        args.dashboard = False if args.dashboard is None else args.dashboard
        args.request_timelines = 0 if args.request_timelines is None else args.request_timelines
    server_config = dataclass_from_args(ServerConfig, args)
    batch_config = dataclass_from_args(BatchConfig, args)
    check_serving(config, server_config, replica_config)  # refused combinations first
    preflight.check_engine_options({
        **dataclasses.asdict(config.model), **dataclasses.asdict(server_config),
        **dataclasses.asdict(replica_config)})
    sock = preflight.bind_port(server_config.host, server_config.port)
    from treadle.server.serve import serve  # torch, uvicorn, the engine: after the checks

    start_replicas = None
    if replica_config.on_ray:  # on Ray Serve (ray: imported only here)
        from treadle.integrations.ray_serve.launch import start_replicas
    return serve(config, server_config, replica_config, batch_config, sock=sock,
                 start_replicas=start_replicas)


def _cmd_worker(args: argparse.Namespace) -> int:
    from treadle.config import EngineConfig
    from treadle.executor.torchrun import run_worker

    options = options_from_args(args)
    options.setdefault("distributed_executor_backend", "torchrun")
    return run_worker(EngineConfig.from_options(**options))


def add_parser(sub) -> None:
    """Register `serve` and `worker` on the top-level subparsers."""
    srv = sub.add_parser("serve", help="serve the OpenAI-compatible API "
                                       "(SmolLM2-135M-Instruct by default)")
    add_config_file_argument(srv)
    add_config_arguments(srv)
    add_dataclass_arguments(srv, ServerConfig, "server options")
    add_dataclass_arguments(srv, BatchConfig, "Batch API (docs/batch.md)")
    from treadle.distributed.config import ReplicaConfig
    add_dataclass_arguments(srv, ReplicaConfig, "replicas on Ray (docs/replicas.md)")
    srv.set_defaults(func=_cmd_serve)

    wrk = sub.add_parser("worker", help="a rank other than 0 under torchrun (RANK, "
                         "WORLD_SIZE, MASTER_ADDR, MASTER_PORT): serve rank 0's calls")
    add_config_arguments(wrk)
    wrk.set_defaults(func=_cmd_worker)
