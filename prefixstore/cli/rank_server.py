"""Serve one tensor-parallel rank's directory to a coordinator, as its own process.

The coordinator (the process running the Engine) hosts a TCPStore; start one rank
server per remote rank, on its host, with its own data directory:

    prefixstore rank-server --rank 1 --dir /data/pfx/rank1 --init-method tcp://coord:29500

The server applies the coordinator's file effects (shard writes, reads, unlinks,
directory syncs) in that directory and answers over a gloo pair group. It exits 0
when the coordinator shuts it down and 1 when the coordinator is gone (run it under a
supervisor that restarts it; a restarted rank process is reconnected on the
coordinator's next call). See prefixstore.gpu.distributed for the protocol, the
failure detection and the environment variables.
"""

from __future__ import annotations

from prefixstore.gpu import rank_server

NAME = "rank-server"
HELP = "serve one rank's directory to a coordinator over torch.distributed (gloo)"


def add_arguments(p) -> None:
    rank_server.add_arguments(p)


def run(args) -> int:
    rank_server.exit_now(rank_server.run(args))
    return 0  # not reached
