"""`spaceserve serve`: one engine in this process (app.py), or, with ``--data-parallel-size N``
(or ``--ray-address``), N replicas on Ray Serve behind the same app (replicas/deploy.py)."""

from __future__ import annotations

from spaceserve.server.flags import build_parser
from spaceserve.server.replicas.args import wants_replicas

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if wants_replicas(args):
        from spaceserve.server.replicas.deploy import main as serve_replicas

        return serve_replicas(args)
    from spaceserve.server.app import main as serve_one

    return serve_one(argv)
