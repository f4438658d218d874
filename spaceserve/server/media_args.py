"""`spaceserve serve` flags for media beyond images: video limits and remote media URLs.

Remote (http/https) media URLs are off unless ``--allowed-media-domains`` lists the host names
(as vLLM names the flag) the server may fetch from; see `spaceserve.runtime.inputs.media.remote` for
what is refused. Nothing heavy is imported here (``--help`` answers at once).
"""

from __future__ import annotations

import argparse

from spaceserve.runtime.inputs import RemotePolicy, VideoLimits

_REMOTE = RemotePolicy.__dataclass_fields__


def add_media_args(p: argparse.ArgumentParser) -> None:
    """Add the video and remote-media flags to the serve parser."""
    v = VideoLimits
    p.add_argument("--max-video-bytes", type=int, default=v.max_video_bytes,
                   help="encoded size limit of one video")
    p.add_argument("--max-video-pixels", type=int, default=v.max_video_pixels,
                   help="pixel limit of one video frame (checked before decoding)")
    p.add_argument("--max-video-frames", type=int, default=v.max_video_frames,
                   help="frames one video's stream may hold (checked before decoding; sampling "
                        "keeps at most the checkpoint's max_frames of them)")
    p.add_argument("--max-videos-per-request", type=int, default=v.max_videos_per_request,
                   help="videos per request at most")
    p.add_argument("--allowed-media-domains", nargs="+", metavar="DOMAIN",
                   help="host names whose http(s) image and video URLs the server may fetch "
                        "(exact names; names resolving to loopback, private or link-local "
                        "addresses are refused) (default: none, remote URLs are refused)")
    p.add_argument("--media-connect-timeout", type=float,
                   default=_REMOTE["connect_timeout"].default,
                   help="seconds to connect to a media host")
    p.add_argument("--media-read-timeout", type=float, default=_REMOTE["read_timeout"].default,
                   help="seconds a media host may stay silent while sending")
    p.add_argument("--media-fetch-timeout", type=float, default=_REMOTE["total_timeout"].default,
                   help="seconds one remote media fetch may take in all, redirects included")
    p.add_argument("--max-media-redirects", type=int, default=_REMOTE["max_redirects"].default,
                   help="redirects followed per media URL (each inside the allowed domains)")
    p.add_argument("--max-concurrent-media-fetches", type=int,
                   default=_REMOTE["max_concurrent"].default,
                   help="remote media fetches in flight per server at most")


def media_limits(args: argparse.Namespace) -> tuple[VideoLimits, RemotePolicy | None]:
    """(video limits, remote policy or None when remote URLs stay off) from parsed flags;
    ValueError names a bad value."""
    videos = VideoLimits(args.max_video_bytes, args.max_video_pixels, args.max_video_frames,
                         args.max_videos_per_request)
    domains = [d for item in args.allowed_media_domains or () for d in item.split(",")
               if d.strip()]
    if not domains:
        return videos, None
    return videos, RemotePolicy(tuple(domains), connect_timeout=args.media_connect_timeout,
                                read_timeout=args.media_read_timeout,
                                total_timeout=args.media_fetch_timeout,
                                max_redirects=args.max_media_redirects,
                                max_concurrent=args.max_concurrent_media_fetches)
