"""Short synthetic video clips encoded with PyAV, for the video input tests.

Frame ``i`` of `flat_frames` is one uniform grey level (``step * i + base``), so the mean of a
decoded frame tells which source frame it was, whatever the lossy codec did to its pixels.
"""

from __future__ import annotations

import io

import numpy as np


def flat_frames(n: int, h: int, w: int, step: int = 20, base: int = 10) -> np.ndarray:
    """uint8 ``[n, h, w, 3]``: frame i is uniformly ``base + step * i`` (mod 256)."""
    levels = (base + step * np.arange(n)) % 256
    return np.broadcast_to(levels[:, None, None, None], (n, h, w, 3)).astype(np.uint8)


def encode_clip(frames: np.ndarray, fps: int = 4, fmt: str = "mp4", codec: str = "mpeg4",
                pix_fmt: str = "yuv420p") -> bytes:
    """`frames` (uint8 ``[n, h, w, 3]``) encoded as a `fmt` container at `fps`."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = pix_fmt
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f),
                                                                   format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()
