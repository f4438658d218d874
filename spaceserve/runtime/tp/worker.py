"""A tensor-parallel worker: one process per rank > 0, started by rank 0 (spawn).

`worker_main` joins the group, loads the rank's shard, says ready, then runs every command
rank 0 sends (`protocol.py`), in order, through `WorkerState`, until `Stop` or until rank 0 is
gone (its pipe closes, or the worker's parent process changes: checked every second, so a
worker never outlives its engine). Any other exception is reported to rank 0 and ends the
process: rank 0 then fails the engine with that message.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import traceback
from typing import Any

import numpy as np
import torch

from spaceserve.runtime.tp import protocol as P

NO_REPLY = object()


def rank_device(device: str, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or GPU `rank` of the visible ones."""
    dev = torch.device(device)
    return torch.device("cuda", rank) if dev.type == "cuda" else dev


def build_runner(source: P.ModelSource, rank: int, size: int, comm: Any,
                 device: torch.device) -> Any:
    """Rank `rank`'s shard of the model as a `Qwen2VLRunner`."""
    from spaceserve.models import from_config, from_pretrained
    from spaceserve.models.parallel import TensorParallel
    from spaceserve.runtime.worker.qwen2_vl import Qwen2VLRunner

    tp = TensorParallel(rank, size)
    if source.path is not None:
        model = from_pretrained(source.path, attention_backend=source.attention_backend,
                                dtype=source.dtype, device=device, tp=tp, comm=comm)
        return Qwen2VLRunner(model, path=source.path)
    model = from_config(source.config, attention_backend=source.attention_backend,
                        dtype=source.dtype, device=device, seed=source.seed, tp=tp, comm=comm)
    return Qwen2VLRunner(model, eos_token_ids=())


class WorkerState:
    """Runs rank 0's commands on this rank's runner (see `protocol.py` for what each means).
    `comms` are the stage communicators; `partitions` the co-located modes' partition set
    (None in temporal mode); `progress` and `notices` the group's shared progress counters and
    failure queue (data-parallel encoding), `rank` this worker's rank."""

    def __init__(self, runner: Any, comms: dict[str, Any], partitions: Any = None, *,
                 rank: int = 1, progress: Any = None, notices: Any = None) -> None:
        self.runner, self.comms, self.pset = runner, comms, partitions
        self.rank, self.progress, self.notices = rank, progress, notices
        self.jobs: dict[int, Any] = {}
        self.embeds: dict[int, torch.Tensor] = {}
        self.ready: dict[int, Any] = {}  # CUDA event after which embeds[key] may be read
        self.by_budgets = {} if partitions is None else {
            (p.encoder_sms, p.decoder_sms): p for p in partitions.partitions()}
        self.num_steps = 0
        self.num_encoded = 0  # images this rank encoded (data-parallel: its share)
        self._recorder: Any = None  # record_launches() context while recording
        self._launches: list[Any] = []
        self._finished: queue.Queue | None = None  # (CUDA event, seq) for the progress thread

    # -- partitions and budgets ----------------------------------------------------------
    def _partition(self, kind: str, budgets: P.Budgets | None, num_sms: int | None) -> Any:
        """The partition of rank 0's `budgets` (a step's, a capture's), else of a command with
        one stage's budget `num_sms`: the current partition when that stage's budget matches,
        else one whose stage has it (see `protocol`'s module docstring)."""
        if budgets is not None:
            part = self.by_budgets.get(tuple(budgets))
            if part is None:
                raise RuntimeError(f"no partition with budgets {budgets}; this rank has "
                                   f"{sorted(self.by_budgets)}")
            return part
        stage = 0 if kind == "encoder" else 1
        if self.pset.current.budgets[stage] == num_sms:
            return self.pset.current
        found = [p for b, p in self.by_budgets.items() if b[stage] == num_sms]
        if not found:
            raise RuntimeError(f"no partition with a {kind} budget of {num_sms} SMs; this rank "
                               f"has {sorted(self.by_budgets)}")
        return found[0]

    def _scope(self, kind: str, budgets: P.Budgets | None = None, num_sms: int | None = None
               ) -> contextlib.AbstractContextManager:
        """Enter the `kind` ("encoder", "decoder" or "capture") scope of the partition rank 0
        ran the command on (`_partition`), switching to it first unless capturing."""
        if self.pset is None:
            return contextlib.nullcontext()
        part = self._partition(kind, budgets, num_sms)
        if kind == "capture":
            return self.pset.capture_scope(part)
        if part is not self.pset.current:
            self.pset.switch(part)
        return part.encoder_scope() if kind == "encoder" else part.decoder_scope()

    def _done_encoding(self, key: int, emb: torch.Tensor) -> None:
        self.embeds[key] = emb
        if emb.is_cuda:  # the hand-off to the decoder stream, as the spatial stage's
            event = torch.cuda.Event()
            event.record()
            self.ready[key] = event

    def embeds_of(self, key: int) -> torch.Tensor:
        emb = self.embeds.get(key)
        if emb is None:
            raise RuntimeError(f"no image embeddings under key {key} on this rank (its "
                               "encoding failed here but not on rank 0)")
        event = self.ready.pop(key, None)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            emb.record_stream(torch.cuda.current_stream())
        return emb

    def _progress(self, seq: int | None) -> None:
        """Publish that the data-parallel command `seq` is done: at once on a CPU, once the
        device has run it on a GPU (a thread waits on an event recorded here)."""
        if seq is None or self.progress is None:
            return
        if not self.runner.device.type == "cuda":
            self.progress[self.rank] = seq
            return
        if self._finished is None:
            self._finished = queue.Queue()
            threading.Thread(target=self._publish, name="spaceserve-tp-progress",
                             daemon=True).start()
        event = torch.cuda.Event()
        event.record()
        self._finished.put((event, seq))

    def _publish(self) -> None:
        torch.cuda.set_device(self.runner.device)
        while True:
            event, seq = self._finished.get()
            event.synchronize()
            self.progress[self.rank] = seq

    def _share(self, cmd: Any) -> None:
        """Take part in the owners' broadcasts of finished embeddings (decoder stream)."""
        model = self.runner.model
        comm = self.comms["decoder"]
        with self._scope("decoder", num_sms=cmd.num_sms):
            for key, src, tokens in cmd.items:
                if src == self.rank:
                    buf = self.embeds_of(key).contiguous()
                else:
                    buf = torch.empty((tokens, model.language.embed_width), dtype=model.dtype,
                                      device=self.runner.device)
                comm.broadcast(buf, src, num_sms=cmd.num_sms)
                self._done_encoding(key, buf)

    # -- commands ------------------------------------------------------------------------
    def handle(self, cmd: Any) -> Any:
        """Run one command; returns its reply, or `NO_REPLY`."""
        r = self.runner
        if isinstance(cmd, P.Step):
            from spaceserve.runtime.worker.qwen2_vl import PreparedStep

            with self._scope("encoder" if cmd.stage == "encoder" else "decoder", cmd.budgets):
                step = PreparedStep(cmd.stage, cmd.budget, cmd.graph, cmd.inputs, cmd.pieces,
                                    cmd.budgets)
                r.run_step(step, embeds_of=self.embeds_of, apply_sync=True,
                           comm=self.comms.get(cmd.stage, self.comms["decoder"]))
            self.num_steps += 1
            return NO_REPLY
        if isinstance(cmd, (P.StartEncode, P.AdvanceEncode, P.FinishEncode, P.Encode)):
            self._encoder(cmd)
            return NO_REPLY
        if isinstance(cmd, P.Share):
            self._share(cmd)
            return NO_REPLY
        if isinstance(cmd, P.Embeds):
            self.embeds[cmd.key] = cmd.embeds.to(r.device)
            return NO_REPLY
        if isinstance(cmd, P.Split):
            emb = self.embeds.pop(cmd.key, None)
            event = self.ready.pop(cmd.key, None)
            if emb is not None:  # None: the job failed here too (rank 0 reports it)
                for key, lo, hi in cmd.parts:
                    self.embeds[key] = emb[lo:hi]
                    if event is not None:
                        self.ready[key] = event
            return NO_REPLY
        if isinstance(cmd, P.Release):
            for key in cmd.keys:
                self.jobs.pop(key, None)
                self.embeds.pop(key, None)
                self.ready.pop(key, None)
            return NO_REPLY
        if isinstance(cmd, P.Capture):
            with self._scope("capture", cmd.budgets):
                return r.capture_decode_graphs(cmd.sizes, partition=cmd.budgets)
        if isinstance(cmd, P.Allocate):
            r.allocate_kv_cache(cmd.num_blocks, cmd.limits)
            return NO_REPLY
        if isinstance(cmd, P.Stats):
            return self._stats(cmd.record)
        if isinstance(cmd, P.Profile):
            peak = r.profile_peak_bytes(cmd.limits, cmd.max_encoder_tokens)
            free = torch.cuda.mem_get_info(r.device)[0] if r.device.type == "cuda" else 0
            return peak, free
        raise RuntimeError(f"unknown tensor-parallel command {type(cmd).__name__}")

    def _encoder(self, cmd: Any) -> None:
        """Encoder commands. Replicated, their failures are rank 0's too (same inputs, same
        code): it reports them on the request; here the key is just dropped. A data-parallel
        owner's failure (rank 0 validated the input, so a device error or out of memory) is
        reported on the notice queue, before the progress counter moves."""
        try:
            self._run_encoder(cmd)
        except (ValueError, KeyError, RuntimeError) as exc:
            key = getattr(cmd, "key", None)
            keys = [key] if key is not None else list(getattr(cmd, "keys", []))
            for k in keys:
                self.jobs.pop(k, None)
                self.embeds.pop(k, None)
            if cmd.seq is not None and self.notices is not None:
                traceback.print_exc()
                for k in keys:
                    self.notices.put((self.rank, k, f"{type(exc).__name__}: {exc}"))
        finally:
            self._progress(cmd.seq)

    def _run_encoder(self, cmd: Any) -> None:
        r = self.runner
        if isinstance(cmd, P.StartEncode):
            from spaceserve.runtime.core.request import MultiModalData

            mm = MultiModalData(cmd.pixel_values, cmd.image_grid_thw, np.zeros(0, np.int64))
            if self.pset is not None and self.pset.cuda:
                with self.pset.staged() as done:
                    pv = cmd.pixel_values.pin_memory().to(r.device, non_blocking=True)
                    self.jobs[cmd.key] = done(r.start_encode(mm, pixel_values=pv))
            else:
                self.jobs[cmd.key] = r.start_encode(mm)
        elif isinstance(cmd, P.AdvanceEncode):
            with self._scope("encoder", num_sms=cmd.num_sms):
                r.advance_encode(self.jobs[cmd.key], cmd.layers, num_sms=cmd.num_sms)
        elif isinstance(cmd, P.FinishEncode):
            with self._scope("encoder", num_sms=cmd.num_sms):
                job = self.jobs.pop(cmd.key)
                self._done_encoding(cmd.key, r.finish_encode(job, num_sms=cmd.num_sms))
                self.num_encoded += 1
        else:
            from spaceserve.runtime.core.request import MultiModalData

            mms = [MultiModalData(pv, grid, np.zeros(0, np.int64)) for pv, grid in cmd.images]
            with self._scope("encoder", num_sms=cmd.num_sms):
                for key, emb in zip(cmd.keys, r.encode(mms, num_sms=cmd.num_sms), strict=True):
                    self._done_encoding(key, emb)
                    self.num_encoded += 1

    def _stats(self, record: bool | None) -> dict[str, Any]:
        from spaceserve.kernels import record_launches

        launches = list(self._launches)
        self._launches.clear()
        if record is not None and (self._recorder is not None) != record:
            if record:
                self._recorder = record_launches()
                self._launches = self._recorder.__enter__()
            else:
                self._recorder.__exit__(None, None, None)
                self._recorder, self._launches = None, []
        splits = None if self.pset is None else tuple(sorted(self.pset.splits))
        return {"steps": self.num_steps, "embeds": len(self.embeds), "jobs": len(self.jobs),
                "encoded": self.num_encoded, "launches": launches, "splits": splits}

    def close(self) -> None:
        if self.pset is not None:
            self.pset.close()


def _watch_parent(parent: int) -> None:
    """End this process once its parent (rank 0) is gone, wherever the main thread is
    blocked (a collective, a pipe): no worker outlives its engine."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="spaceserve-tp-parent", daemon=True).start()


def worker_main(rank: int, spec: P.GroupSpec, source: P.ModelSource, conn: Any,
                parent: int) -> None:
    """The worker process (module docstring)."""
    os.environ.update(spec.env)
    _watch_parent(parent)
    state = None
    try:
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        conn.send(("hello", rank, os.getpid()))
        device = rank_device(source.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        from spaceserve.runtime.tp.comm import connect

        comms = connect(rank, spec.size, spec.rendezvous, device, spec.stages, spec.timeout_s)
        runner = build_runner(source, rank, spec.size, comms["decoder"], device)
        pset = None
        if spec.partitions is not None:
            from spaceserve.runtime.spatial.split_set import make_partitions

            pset, _ = make_partitions(spec.partitions, device)
        state = WorkerState(runner, comms, pset, rank=rank, progress=spec.progress,
                            notices=spec.notices)
        conn.send(("ready", rank))
        while True:
            try:
                cmd = P.loads(conn.recv_bytes())
            except (EOFError, OSError):  # rank 0 is gone
                break
            if isinstance(cmd, P.Stop):
                break
            reply = state.handle(cmd)
            if reply is not NO_REPLY:
                conn.send(("reply", reply))
    except BaseException:
        text = traceback.format_exc()
        with contextlib.suppress(Exception):
            conn.send(("error", rank, text))
        os._exit(1)
    with contextlib.suppress(Exception):
        if state is not None:
            state.close()
    os._exit(0)
