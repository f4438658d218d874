"""Rank 0's side of the worker processes: start them, talk to them, watch them, stop them.

`WorkerGroup` spawns one process per rank > 0 (``multiprocessing`` spawn context, daemonic:
they die with the interpreter at the latest), with a duplex pipe each and a rendezvous file in
a fresh temporary directory. A monitor thread waits on the processes' sentinels; when a worker
exits while the group is open, `failure` names it (rank, pid, exit code or signal, and the
traceback it sent), NCCL groups are aborted so a collective blocked on the dead peer returns
(a gloo collective fails by itself as soon as the peer's sockets close), and every later call
raises `TensorParallelError`. Death is noticed in well under a second; the collectives'
timeout only bounds a peer that hangs alive.

Besides the pipes, the group shares with its workers a progress counter per rank (the last
data-parallel encoder command each finished: `RemoteEvent` reads it) and a queue on which a
worker reports an encoding that failed on it (`encoder_failures`).

`close` sends `Stop`, waits briefly, then terminates and kills what is left, and removes the
rendezvous directory; it runs at garbage collection and interpreter exit too.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from spaceserve.runtime.tp import protocol as P

STARTUP_TIMEOUT_S = 900.0  # imports and loading a shard (a 72B checkpoint takes minutes)
DEATH_GRACE_S = 5.0  # how long a failed collective waits for the monitor to name a dead worker


class TensorParallelError(RuntimeError):
    """The tensor-parallel group cannot go on (a worker died or a collective failed): the
    engine must be closed and rebuilt."""


class RemoteEvent:
    """Like a CUDA event, for encoder work sent to a worker: complete once that worker's
    progress counter has reached `seq` (after the command ran; on a GPU after the device ran
    it). `synchronize` raises `TensorParallelError` if the group fails meanwhile."""

    def __init__(self, group: WorkerGroup, rank: int, seq: int) -> None:
        self.group, self.rank, self.seq = group, rank, seq

    def query(self) -> bool:
        return self.group.progress[self.rank] >= self.seq

    def synchronize(self) -> None:
        while not self.query():
            self.group.check()
            if not self.group.procs[self.rank - 1].is_alive():
                self.group.raise_failure()
            time.sleep(0.0005)


def _describe_exit(proc: Any) -> str:
    code = proc.exitcode
    if code is None:
        return "is unresponsive"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"was killed by signal {name}"
    return f"exited with code {code}"


def _stop_processes(procs: list[Any], conns: list[Any], directory: str | None,
                    grace_s: float) -> None:
    """Ask workers to stop, then terminate and kill what is left; close pipes; remove the
    rendezvous directory. Safe to call twice (also as a finalizer)."""
    stop = P.dumps(P.Stop())
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.send_bytes(stop)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.close()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class WorkerGroup:
    """The worker processes of ranks 1..size-1 (module docstring). `target(rank, spec,
    source, conn, parent_pid)` is the worker entry point (`worker.worker_main`,
    passed by the runner so the group does not depend on the model code the workers run)."""

    def __init__(self, size: int, source: P.ModelSource, *, timeout_s: float,
                 stages: tuple[str, ...], partitions: P.PartitionSpec | None,
                 num_threads: int | None, env: dict[str, str] | None = None,
                 target: Callable[..., None]) -> None:
        self.size = size
        self.dir = tempfile.mkdtemp(prefix="spaceserve-tp-")
        ctx = mp.get_context("spawn")
        self.progress = ctx.Array("q", size, lock=False)
        self.notices = ctx.SimpleQueue()
        self._failed: dict[int, str] = {}
        self.spec = P.GroupSpec(size, os.path.join(self.dir, "rendezvous"), timeout_s, stages,
                                partitions, num_threads, dict(env or {}), self.progress,
                                self.notices)
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.pids: list[int] = []
        self._failure: str | None = None
        self._primary: int | None = None
        self._closing = False
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._errors: dict[int, str] = {}
        self.on_failure: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(self, _stop_processes, self.procs, self.conns,
                                           self.dir, 5.0)
        for rank in range(1, size):
            here, there = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=target, args=(rank, self.spec, source, there, os.getpid()),
                               name=f"spaceserve-tp-rank{rank}", daemon=True)
            proc.start()
            there.close()
            self.procs.append(proc)
            self.conns.append(here)
        self._wake_r, self._wake_w = os.pipe()
        self._monitor = threading.Thread(target=self._watch, name="spaceserve-tp-monitor",
                                         daemon=True)
        self._monitor.start()

    # -- startup ---------------------------------------------------------------------------
    def expect(self, kind: str, timeout_s: float = STARTUP_TIMEOUT_S) -> list[tuple]:
        """Wait for message `kind` from every worker (startup: "hello", "ready"), raising
        `TensorParallelError` as soon as one dies or reports an error."""
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(self.conns):
            waiting = [c for i, c in enumerate(self.conns) if i not in got]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TensorParallelError(f"tensor-parallel workers did not say {kind!r} within "
                                          f"{timeout_s:.0f} s")
            ready = mpc.wait(waiting + [p.sentinel for p in self.procs], min(left, 1.0))
            for conn in [c for c in ready if c in waiting]:
                i = self.conns.index(conn)
                msg = self._recv(i)
                if msg is None or msg[0] == "error":
                    self.raise_failure()
                if msg[0] != kind:
                    raise TensorParallelError(f"rank {i + 1} said {msg[0]!r}, expected {kind!r}")
                got[i] = msg
            if any(p.sentinel in ready for p in self.procs):
                self.raise_failure()
        if kind == "hello":
            self.pids = [int(got[i][2]) for i in range(len(self.conns))]
        return [got[i] for i in range(len(self.conns))]

    def watched(self, fn: Callable[[], Any], timeout_s: float = STARTUP_TIMEOUT_S) -> Any:
        """``fn()`` (rank 0 joining the group, which blocks until every rank has) on a helper
        thread, given up with `TensorParallelError` as soon as a worker exits (a worker that
        fails reports its error, then exits) instead of after the rendezvous timeout."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:
                box["error"] = exc

        thread = threading.Thread(target=run, name="spaceserve-tp-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            if time.monotonic() > deadline:
                raise TensorParallelError(f"rank 0 could not join its group within "
                                          f"{timeout_s:.0f} s")
            if mpc.wait([p.sentinel for p in self.procs], 0.2):  # a worker exited
                self.raise_failure()
        if "error" in box:
            raise box["error"]
        return box.get("value")

    # -- talking ---------------------------------------------------------------------------
    def broadcast(self, cmd: Any) -> None:
        """Send `cmd` to every worker (pickled once)."""
        self.check()
        payload = P.dumps(cmd)
        with self._send_lock:
            try:
                for conn in self.conns:
                    conn.send_bytes(payload)
            except (OSError, ValueError) as exc:
                self.raise_failure(exc)

    def send_to(self, rank: int, cmd: Any) -> None:
        """Send `cmd` to the worker of `rank` alone (a data-parallel owner's encoder work)."""
        self.check()
        payload = P.dumps(cmd)
        with self._send_lock:
            try:
                self.conns[rank - 1].send_bytes(payload)
            except (OSError, ValueError) as exc:
                self.raise_failure(exc)

    def encoder_failures(self) -> dict[int, str]:
        """Keys whose encoding failed on their owner (reported before its progress counter
        moved past the command), with the owner's message; read from the notice queue."""
        with contextlib.suppress(OSError, EOFError):
            while not self.notices.empty():
                rank, key, text = self.notices.get()
                self._failed[key] = f"rank {rank}: {text}"
        return self._failed

    def replies(self) -> list[Any]:
        """The reply of every worker to the last command that has one."""
        out = []
        for i, conn in enumerate(self.conns):
            while True:
                ready = mpc.wait([conn, self.procs[i].sentinel], 1.0)
                if conn in ready:
                    msg = self._recv(i)
                    if msg is None or msg[0] == "error":
                        self.raise_failure()
                    out.append(msg[1])
                    break
                if ready or self._failure is not None:
                    self.raise_failure()
        return out

    def _recv(self, i: int) -> tuple | None:
        """One message from worker `i` (None at end of file); errors are remembered."""
        with self._recv_lock:
            try:
                msg = self.conns[i].recv()
            except (EOFError, OSError):
                return None
        if msg[0] == "error":
            self._errors[i] = msg[2]
        return msg

    # -- failures --------------------------------------------------------------------------
    def _watch(self) -> None:
        sentinels = {p.sentinel: i for i, p in enumerate(self.procs)}
        while sentinels:
            ready = mpc.wait(list(sentinels) + [self._wake_r])
            if self._wake_r in ready:
                return
            for s in ready:
                sentinels.pop(s, None)
            if not self._closing:
                self._fail()

    def _fail(self) -> None:
        """Record the failure (once): of the workers dead by now, the one that died first in
        all likelihood - killed by a signal, else exited without reporting an error, else the
        first to report one (the others' collectives then failed on its account)."""
        dead = [i for i, p in enumerate(self.procs) if not p.is_alive()]
        if self._failure is None and dead:
            for i in dead:
                self.procs[i].join(0.1)
                self._drain(i)

            def rank(i: int) -> tuple[int, int]:
                code = self.procs[i].exitcode
                return (0 if code is not None and code < 0 else 1 if i not in self._errors
                        else 2, i)

            i = min(dead, key=rank)
            proc = self.procs[i]
            self._failure = (f"tensor-parallel worker rank {i + 1} (pid {proc.pid}) "
                             f"{_describe_exit(proc)}")
            self._primary = i
        for hook in list(self.on_failure):
            with contextlib.suppress(Exception):
                hook()

    def _drain(self, i: int) -> None:
        """Read what a dead worker left in its pipe (its error report)."""
        if i in self._errors:
            return
        with contextlib.suppress(Exception):
            while self.conns[i].poll():
                if self._recv(i) is None:
                    break

    def failure(self) -> str | None:
        """What went wrong, or None: the worker that died first (with its error's last line),
        then the others that have exited since."""
        if self._failure is None:
            return None
        primary = self._primary
        if primary is None:
            return self._failure
        self._drain(primary)
        text = self._failure
        if primary in self._errors:
            text += f" ({self._errors[primary].strip().splitlines()[-1]})"
        others = [f"rank {i + 1} {_describe_exit(p)}" for i, p in enumerate(self.procs)
                  if i != primary and not p.is_alive()]
        if others:
            text += "; then " + ", ".join(others)
        return text

    def check(self) -> None:
        if self._failure is not None:
            self.raise_failure()

    def raise_failure(self, cause: BaseException | None = None) -> None:
        """Raise `TensorParallelError` naming the dead worker; after a failed collective
        (`cause`), first give the monitor `DEATH_GRACE_S` to notice which one."""
        if self._closing and self._failure is None:
            raise TensorParallelError("the tensor-parallel group is closed (the engine was "
                                      "closed)") from cause
        deadline = time.monotonic() + DEATH_GRACE_S
        while self._failure is None and time.monotonic() < deadline:
            if any(not p.is_alive() for p in self.procs):
                self._fail()
            else:
                time.sleep(0.05)
        why = self.failure()
        if why is None:
            if cause is None:
                why = ("the tensor-parallel group is stopped (closed, or interrupted inside a "
                       "step)")
            else:
                why = f"a tensor-parallel collective failed: {type(cause).__name__}: {cause}"
            self._failure = why
        raise TensorParallelError(f"{why}; the engine cannot continue (close it and start a "
                                  "new one)") from cause

    # -- shutdown --------------------------------------------------------------------------
    def alive(self) -> list[int]:
        """Pids of the workers still running."""
        return [p.pid for p in self.procs if p.is_alive()]

    def close(self, grace_s: float = 5.0) -> None:
        """Stop every worker (Stop, then terminate, then kill) and clean up; idempotent."""
        self._closing = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        with self._send_lock:
            self._finalizer.detach()
            _stop_processes(self.procs, self.conns, self.dir, grace_s)
        self._monitor.join(2.0)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1
