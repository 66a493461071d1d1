"""A rank server as the fuzzer runs it: one process per rank, with a power switch.

``serve`` runs the real ``RankServer`` on its directory through a ``FaultFS`` that
injects nothing and only tracks what is durable, so that the fuzzer can take the
host's power away: SIGUSR1 (drop what was not made durable) or SIGUSR2 (garble it),
taken by a thread of its own (blocked everywhere else, so that a main thread waiting
in gloo does not hold it up), waits until no request is being applied (power goes between two requests, after the
last reply was sent), rewrites the directory to what a power loss would leave
(``FaultFS.crash``) and ends the process at once, as SIGKILL would. SIGKILL itself
is process death without power loss (what the process wrote stays in the page cache),
SIGSTOP a hung host.

``plant`` names a ``prefixstore.fuzz.plants.Plant`` whose ``server_patch`` is applied
in this process (a broken rank server the campaign must catch).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from prefixstore.fuzz import netns, plants
from prefixstore.fuzz.faultfs import FaultFS
from prefixstore.gpu import rank_server

POWER_SIGNALS = {signal.SIGUSR1: "drop", signal.SIGUSR2: "garble"}
EXIT_POWER = 137
"""The status of a process whose power was taken away (what SIGKILL gives a shell)."""


class PowerSwitch:
    """Serialises the requests a rank server applies with a power loss."""

    def __init__(self, fs: FaultFS) -> None:
        self.fs = fs
        self.lock = threading.Lock()

    def applying(self, handle: Any) -> Any:
        """``rank_server.handle`` applied under the switch's lock."""

        def locked(local: Any, req: dict[str, Any], payload: bytes) -> Any:
            with self.lock:
                return handle(local, req, payload)

        return locked

    def cut(self, mode: str) -> None:
        """Between two requests: what is not durable is lost, the process ends."""
        with self.lock:
            self.fs.crash(mode)  # type: ignore[arg-type]
            rank_server.exit_now(EXIT_POWER)

    def wait(self) -> None:
        """Wait for a power signal, then cut the power (the thread's whole life)."""
        self.cut(POWER_SIGNALS[signal.Signals(signal.sigwait(set(POWER_SIGNALS)))])


def serve(rank: int, directory: str, port: int, token: bytes | None, plant: str | None,
          connect_timeout: float, seed: int, where: tuple[str | None, str, str] = (None, "127.0.0.1", "127.0.0.1"),
          ) -> None:
    """Serve rank ``rank`` in ``directory`` to the coordinator's store at port ``port``;
    never returns (the process exits with the server's status). ``where``: the network
    namespace to join first (None: stay), this host's address, the coordinator's."""
    netns_path, host, coordinator = where
    if netns_path is not None:
        netns.join(netns_path)
    signal.pthread_sigmask(signal.SIG_BLOCK, set(POWER_SIGNALS))  # before any thread starts
    fs = FaultFS(seed=seed)
    switch = PowerSwitch(fs)
    threading.Thread(target=switch.wait, daemon=True, name="power-switch").start()
    rank_server.handle = switch.applying(rank_server.handle)
    patch = plants.get(plant).server_patch if plant else None
    if patch is not None:
        patch()
    server = rank_server.RankServer(
        rank, directory, coordinator, port, fs=fs, connect_timeout=connect_timeout,
        gloo_host=host, token=token, on_lost=lambda: rank_server.exit_now(rank_server.EXIT_LOST))
    code = rank_server.EXIT_LOST
    try:
        code = server.serve()
    finally:
        rank_server.exit_now(code)
