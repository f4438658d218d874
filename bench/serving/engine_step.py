"""Host time of one engine step around the model, and of streaming detokenisation per token.

Step: a batch of decoding requests runs against `NullModelRunner(check=False)`, whose "forward"
is a handful of tiny tensor ops; their time is measured and subtracted, and so is the sampler's
random-noise generation (device work on a GPU, reported apart), so what is left is the host's
work per step: scheduling, planning, the sampler's bookkeeping and its op dispatches,
accounting. The vocabulary is small (``--vocab``, default 32) so that a tensor op costs what
dispatching it costs, as on a GPU, not CPU arithmetic over the vocabulary. Times are per-thread
CPU time (robust to other processes on a shared machine); wall time and the load average are
printed beside. Goal (batch 64): <= 0.3 ms greedy, and with random sampling + penalties.

Detokenisation: a streaming request's output path (`OutputProcessor.make` per token: the
incremental detokeniser, stop-string hold-back, the output object) over outputs of 16 to 4096
tokens of the tiny byte-level BPE; the host time per token must stay flat (4096 / 16 <= 1.5).
``re-decode`` is the path it replaced (decoding the whole output at every token).

    PYTHONPATH=. python -m bench.serving.engine_step [--batch 64] [--steps 2000] [--vocab 32]
        [--waiting 64 --fair-share both]   # the fair share's host cost with a queue
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from spaceserve.runtime.core.request import SamplingParams
from spaceserve.runtime.engine.engine import Engine, EngineConfig
from spaceserve.runtime.worker.null import NullModelRunner

GOAL_MS = 0.3
FLAT = 1.5
MODES = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=0.8, seed=1),
    "random+penalties": dict(temperature=0.8, seed=1, presence_penalty=0.5,
                             frequency_penalty=0.3, repetition_penalty=1.1),
    "all controls": dict(temperature=0.8, seed=1, presence_penalty=0.5, frequency_penalty=0.3,
                         repetition_penalty=1.1, top_k=20, top_p=0.9, min_p=0.05,
                         logit_bias={5: 1.0}, logprobs=5),
}


class Clock:
    """Per-thread CPU time accumulated by named sections."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}

    def wrap(self, obj: object, name: str, key: str) -> None:
        fn = getattr(obj, name)
        t = self.t

        def timed(*a, **k):
            t0 = time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                t[key] = t.get(key, 0.0) + time.thread_time() - t0

        setattr(obj, name, timed)


def measure(mode: str, batch: int = 64, steps: int = 2000, vocab: int = 32, prompt: int = 128,
            block_size: int = 16, repeats: int = 5, *, waiting: int = 0,
            fair_share: bool = True) -> dict[str, float]:
    """Per-step times in ms (medians over `repeats` runs of `steps` decode steps); `waiting`
    more requests wait for a slot all along (the fair share's work is done only then)."""
    max_len = prompt + steps * (repeats + 1) + 64
    runner = NullModelRunner(vocab_size=vocab, max_model_len=max_len, check=False)
    blocks = batch * (-(-max_len // block_size)) + 8
    engine = Engine(runner, EngineConfig(block_size=block_size, num_kv_blocks=blocks,
                                         max_num_seqs=batch, max_num_batched_tokens=8192,
                                         graph_batch_sizes=(), fair_share=fair_share))
    params = SamplingParams(max_tokens=max_len - prompt - 8, ignore_eos=True, **MODES[mode])
    for i in range(batch + waiting):
        engine.add_request({"prompt_token_ids": [(7 * i + j) % (vocab - 4) + 4
                                                 for j in range(prompt)]}, params)
    clock = Clock()
    clock.wrap(runner, "execute", "execute")
    clock.wrap(runner.planner, "plan", "planner")
    clock.wrap(engine.sampler, "noise", "noise")
    clock.wrap(engine.sampler, "prepare", "sampler")
    clock.wrap(engine.sampler, "sample", "sampler")
    engine.step()  # every prefill in one step
    for _ in range(steps // 10):  # warm up
        engine.step()
    rows: dict[str, list[float]] = {}
    for _ in range(repeats):
        clock.t.clear()
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - w0) / steps * 1e3
        cpu = (time.thread_time() - c0) / steps * 1e3
        t = {k: v / steps * 1e3 for k, v in clock.t.items()}
        model = t["execute"] - t["planner"]
        noise = t.get("noise", 0.0)
        for k, v in (("wall", wall), ("cpu", cpu), ("model", model), ("noise", noise),
                     ("planner", t["planner"]), ("sampler", t["sampler"] - noise),
                     ("host", cpu - model - noise)):
            rows.setdefault(k, []).append(v)
    assert len(engine.scheduler.running) == batch, "the batch shrank: the run measured less"
    assert len(engine.scheduler.waiting) == waiting, "the queue changed: the run measured less"
    return {k: statistics.median(v) for k, v in rows.items()}


def device_work(batch: int = 64, vocab: int = 32768, repeats: int = 20) -> dict[str, float]:
    """CPU time (ms) of the sampler's tensor work on [batch, vocab] logits per mode: device
    work on a GPU, shown for scale (noise generation apart)."""
    from spaceserve.runtime.core.request import Request
    from spaceserve.runtime.sample.sampler import Sampler

    out = {}
    logits = torch.randn(batch, vocab)
    for mode, kw in MODES.items():
        sampler = Sampler("cpu", vocab, batch)
        p = SamplingParams(max_tokens=10, **kw)
        reqs = []
        for i in range(batch):
            r = Request(f"r{i}", i, list(range(i, i + 64)), p, seed=i)
            r.row, r.admit_serial, r.num_placeholders = i, i + 1, 1
            reqs.append(r)
        sb = sampler.prepare(reqs)
        sampler.sample(logits, sb).fetch()
        t0 = time.thread_time()
        for _ in range(repeats):
            sampler.sample(logits, sb).fetch()
        total = (time.thread_time() - t0) / repeats * 1e3
        noise = 0.0
        if sb.seeds is not None:
            t0 = time.thread_time()
            for _ in range(repeats):
                sampler.noise(sb)
            noise = (time.thread_time() - t0) / repeats * 1e3
        out[mode] = (total, noise)
    return out


def detok_per_token(n: int, tokenizer, *, stop: bool, redecode: bool = False,
                    seed: int = 0) -> float:
    """Host CPU time (us) per token of a streaming request's output path over `n` tokens."""
    from spaceserve.runtime.core.request import Request
    from spaceserve.runtime.engine.outputs import OutputProcessor

    rng = random.Random(seed)
    ids = [rng.randrange(260, len(tokenizer)) for _ in range(n)]
    params = SamplingParams(max_tokens=n, stop=["@never@", "zq"] if stop else ())
    outputs = OutputProcessor(tokenizer)
    req = Request("r", 0, [1, 2, 3], params, seed=0)
    req.stream = True
    t0 = time.thread_time()
    if redecode:
        for i in range(1, n + 1):
            tokenizer.decode(ids[:i], skip_special_tokens=True)
    else:
        for tok in ids:
            req.token_ids.append(tok)
            if stop:
                outputs.check_stop(req)
            outputs.make(req, False)
        outputs.make(req, True)
    return (time.thread_time() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--vocab", type=int, default=32, help="vocabulary of the null model")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default=",".join(MODES), help="sampling modes to run")
    ap.add_argument("--skip-detok", action="store_true")
    ap.add_argument("--waiting", type=int, default=0,
                    help="requests kept waiting for a slot beside the batch (fair share at work)")
    ap.add_argument("--fair-share", choices=("on", "off", "both"), default="on",
                    help="the scheduler's fair share (both: each mode with and without)")
    ap.add_argument("--device-work", action="store_true",
                    help="also time the sampler's tensor work at a real vocabulary (CPU)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.2f}; batch {args.batch}, vocab {args.vocab}, "
          f"{args.waiting} waiting; ms per step (CPU time unless wall; -fs: no fair share)")
    print(f"{'sampling':>17} {'wall':>7} {'cpu':>7} {'model':>7} {'noise':>7} {'planner':>8} "
          f"{'sampler':>8} {'host':>7}  goal <= {GOAL_MS}")
    shares = {"on": (True,), "off": (False,), "both": (True, False)}[args.fair_share]
    for mode, share in [(m.strip(), s) for m in args.modes.split(",") if m.strip()
                        for s in shares]:
        r = measure(mode, args.batch, args.steps, args.vocab, repeats=args.repeats,
                    waiting=args.waiting, fair_share=share)
        label = mode if args.fair_share == "on" else f"{mode}{'' if share else ' -fs'}"
        print(f"{label:>17} {r['wall']:>7.3f} {r['cpu']:>7.3f} {r['model']:>7.3f} "
              f"{r['noise']:>7.3f} {r['planner']:>8.3f} {r['sampler']:>8.3f} "
              f"{r['host']:>7.3f}  {'ok' if r['host'] <= GOAL_MS else 'over'}", flush=True)
    print("host = cpu - model - noise (noise: random-noise generation, device work on a GPU); "
          "planner and sampler are included in host")
    if args.device_work:
        print(f"\nsampler tensor work at [{args.batch}, 32768] on this CPU (device work on a "
              "GPU), ms per step: total / of which noise")
        for mode, (total, noise) in device_work(args.batch).items():
            print(f"{mode:>17} {total:>8.2f} / {noise:.2f}")
    if args.skip_detok:
        return
    from spaceserve.models.tiny import _build_tokenizer

    tok = _build_tokenizer(512)
    print("\nstreaming output path, host CPU us per token (tiny byte-level BPE)")
    lengths = (16, 64, 256, 1024, 4096)
    print(f"{'output tokens':>22} " + " ".join(f"{n:>7}" for n in lengths) + "   4096/16")
    for name, kw in (("incremental", dict(stop=False)), ("+ 2 stop strings", dict(stop=True)),
                     ("re-decode (before)", dict(stop=False, redecode=True))):
        per = [statistics.median(detok_per_token(n, tok, seed=s, **kw) for s in range(3))
               for n in lengths]
        ratio = per[-1] / per[0]
        verdict = "" if "before" in name else ("  ok" if ratio <= FLAT else "  over")
        print(f"{name:>22} " + " ".join(f"{x:>7.1f}" for x in per) + f"   {ratio:>6.2f}"
              + verdict, flush=True)


if __name__ == "__main__":
    main()
