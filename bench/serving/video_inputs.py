"""CPU cost of a video input: decode (PyAV), sample, resize, patch, hash, per clip size.

    python -m bench.serving.video_inputs [--seconds 10] [--fps 30] [--sizes 640x360,1280x720]

Encodes a synthetic clip (moving gradients, mpeg4 in mp4) per size, then times
`decode_video` + `video_patches` with Qwen2-VL's default sampling (2 frames per second, 128 to
768 tokens per frame) and prints one row per size: encoded bytes, sampled frames, grid, video
tokens, milliseconds (median of --repeat runs, torch imported beforehand). Numbers are CPU wall
time on this machine.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time

import numpy as np


def synthetic_clip(seconds: float, fps: int, width: int, height: int) -> bytes:
    import av

    buf = io.BytesIO()
    yy, xx = np.mgrid[0:height, 0:width]
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(int(seconds * fps)):
            img = np.stack([(xx + 3 * i) % 256, (yy + 2 * i) % 256,
                            np.full_like(xx, (5 * i) % 256)], axis=-1).astype(np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--fps", type=int, default=30)
    p.add_argument("--sizes", default="640x360,1280x720,1920x1080")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)

    import torch  # noqa: F401  (imported before timing: video_patches uses it)

    from spaceserve.runtime.inputs import VideoLimits, VideoSampling, decode_video
    from spaceserve.runtime.inputs.media.video import video_patches

    sampling = VideoSampling()
    print(f"{'size':>10} {'MB':>6} {'frames':>6} {'grid':>12} {'tokens':>6} {'ms':>8}")
    for size in args.sizes.split(","):
        w, h = (int(v) for v in size.split("x"))
        raw = synthetic_clip(args.seconds, args.fps, w, h)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            video = decode_video(raw, VideoLimits(), sampling)
            pv, grid = video_patches(video, sampling)
            times.append((time.perf_counter() - t0) * 1e3)
        tokens = grid[0] * grid[1] * grid[2] // sampling.merge_size ** 2
        print(f"{size:>10} {len(raw) / 1e6:6.2f} {video.num_frames:6d} {str(grid):>12} "
              f"{tokens:6d} {statistics.median(times):8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
