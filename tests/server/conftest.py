"""Server fixtures: the tiny checkpoint (built once per session), engines on it or on the null
model with the tiny tokenizer, apps, and live uvicorn servers on loopback. The app and the live
server need the serve extra (fastapi, uvicorn): tests that use them skip without it, the rest run
(the GPU image has no serve extra)."""

from __future__ import annotations

import io
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from spaceserve.runtime.engine.engine import Engine, EngineConfig
from spaceserve.runtime.inputs import ChatPreprocessor, ImageLimits
from spaceserve.runtime.worker.null import NullModelRunner

# The server's request models need pydantic, which comes with the serve extra: without it (the
# GPU image) these tests skip and the rest of the suite is collected.
pytest.importorskip("pydantic", reason="the serve extra is not installed")

from spaceserve.server.engine_client import AsyncEngine, load_engine  # noqa: E402

if TYPE_CHECKING:
    from spaceserve.server.app import ServerLimits

MODEL = "tiny-test"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add overhead on a shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def preprocessor(tiny_path) -> ChatPreprocessor:
    return ChatPreprocessor.from_pretrained(tiny_path)


def png(h: int, w: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


class GatedNullRunner(NullModelRunner):
    """The null model, whose steps wait for `gate` and then sleep `delay` seconds."""

    def __init__(self, delay: float = 0.0, **kw) -> None:
        super().__init__(**kw)
        self.gate = threading.Event()
        self.gate.set()
        self.delay = delay

    def execute(self, batch):
        self.gate.wait(30)
        if self.delay:
            time.sleep(self.delay)
        return super().execute(batch)


def null_engine(pre: ChatPreprocessor, *, delay: float = 0.0, max_model_len: int = 512,
                **cfg) -> Engine:
    """The null model behind the tiny tokenizer and image processor."""
    tok = pre.tokenizer
    runner = GatedNullRunner(delay, vocab_size=len(tok), max_model_len=max_model_len,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                             image_token_id=pre.image_token_id, patch_dim=1176,
                             video_token_id=pre.video_token_id)
    config = dict(num_kv_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=512)
    return Engine(runner, EngineConfig(**(config | cfg)), tokenizer=tok, processor=pre)


def make_app(engine: Engine, pre: ChatPreprocessor, *, max_pending: int = 64,
             limits: ServerLimits | None = None):
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from spaceserve.server.app import ServerLimits, create_app

    client = AsyncEngine(engine, max_pending=max_pending)
    return client, create_app(client, pre, model_name=MODEL, limits=limits or ServerLimits(
        max_body_bytes=1 << 20, images=ImageLimits(max_image_bytes=200_000,
                                                   max_image_pixels=1 << 20,
                                                   max_images_per_request=3)))


@pytest.fixture(scope="module")
def tiny_engine(tiny_path):
    engine, pre, note = load_engine(str(tiny_path), device="cpu", num_kv_blocks=128,
                                    block_size=8, max_num_seqs=8)
    assert note is None
    return engine, pre


@pytest.fixture(scope="module")
def live_tiny(tiny_engine):
    """(client, server) of the tiny model on a free loopback port."""
    pytest.importorskip("uvicorn", reason="the serve extra is not installed")
    from spaceserve.server.app import ServerThread

    engine, pre = tiny_engine
    client, app = make_app(engine, pre)
    with ServerThread(app) as server:
        yield client, server
    client.close()


def wait_until(cond, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return cond()
