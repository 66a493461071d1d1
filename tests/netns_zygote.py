"""Processes on namespace hosts started by a fork, not an exec (not a test module).

Run as a program (``python tests/netns_zygote.py``), it imports what its children use
once (the engine, the rank server, the tests' helpers), prints
``READY``, then for each JSON line on stdin, ``{"ns": NAME, "argv": [...], "log":
PATH}``, forks a child that enters network namespace NAME (``/run/netns/NAME``) and
runs ``argv`` as ``__main__`` (``["-m", MODULE, ...]`` or ``[SCRIPT, ...]``) with its
output appended to PATH, and answers ``{"pid": N}``. Once a child is reaped its exit
status (negative: the signal that ended it) goes to ``PATH.exit``. A rank server or
coordinator then starts in a fork instead of the seconds importing torch takes, which
is what lets a test restart four rank servers at every crash point it enumerates.

The zygote itself stays in the namespace it was started in (the test's, outside the
hosts): ``kill_host`` kills a host's processes, not the zygote, which then starts the
host's next rank server as it would a rebooted host's.

Imported by a test, ``Zygote(base)`` starts one (``ready()`` waits for its imports)
and ``start(ns, argv, log)`` returns a ``Forked`` child (``wait``, ``poll``).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CLONE_NEWNET = 0x40000000


class Forked:
    """A child of a zygote: its pid and log; its exit status once it is reaped."""

    def __init__(self, pid: int, log: str) -> None:
        self.pid, self.log = pid, log

    def poll(self) -> int | None:
        try:
            with open(self.log + ".exit") as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):
            return None

    def wait(self, timeout: float) -> int | None:
        """The exit status, waiting up to ``timeout`` s (None: still running)."""
        end = time.monotonic() + timeout
        while (code := self.poll()) is None and time.monotonic() < end:
            time.sleep(0.05)
        return code

    def output(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""


class Zygote:
    """The zygote, started by a test (see the module docstring)."""

    def __init__(self, base: str, timeout: float = 120) -> None:
        log = open(os.path.join(base, "zygote.log"), "ab")  # noqa: SIM115 - handed to the child
        try:
            env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"}
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         start_new_session=True)
        finally:
            log.close()
        self.timeout, self.is_ready = timeout, False

    def ready(self) -> Zygote:
        """Wait until it has imported what its children use."""
        if not self.is_ready:
            if self._line(self.timeout) != "READY":
                raise RuntimeError("the zygote did not start")
            self.is_ready = True
        return self

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().decode().strip() if ready else ""

    def start(self, ns: str, argv: list[str], log: str) -> Forked:
        """Fork a child running ``argv`` in namespace ``ns``, output to ``log``."""
        self.ready()
        with open(log, "ab"):
            pass
        self.proc.stdin.write((json.dumps({"ns": ns, "argv": argv, "log": log}) + "\n").encode())
        self.proc.stdin.flush()
        got = self._line(30)
        if not got:
            raise RuntimeError(f"zygote gave no pid for {argv}")
        return Forked(int(json.loads(got)["pid"]), log)

    def close(self) -> None:
        """End the zygote (its children are the namespaces' processes: ``NetnsHosts.close``)."""
        if self.alive:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ------------------------------------------------------------------------ the zygote itself


def _enter(ns: str) -> None:
    import ctypes

    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns", ns)
    finally:
        os.close(fd)


def _child(req: dict) -> None:
    import runpy
    import traceback

    out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    argv = req["argv"]
    code = 0
    try:
        _enter(req["ns"])
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reap(children: dict[int, str]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        log = children.pop(pid, None)
        if log is not None:
            with open(log + ".exit.tmp", "w") as f:
                f.write(str(os.waitstatus_to_exitcode(status)))
            os.rename(log + ".exit.tmp", log + ".exit")


def main() -> None:
    sys.path.insert(0, HERE)
    import conftest  # noqa: F401 - imported once, for the children

    import prefixstore.engine.api  # noqa: F401
    import prefixstore.gpu.distributed  # noqa: F401

    children: dict[int, str] = {}
    print("READY", flush=True)
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.05)
        _reap(children)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        children[pid] = req["log"]
        print(json.dumps({"pid": pid}), flush=True)


if __name__ == "__main__":
    main()
