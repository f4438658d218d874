"""The data-parallel flags of ``spaceserve serve`` (argparse only: ``--help`` stays instant)."""

from __future__ import annotations

import argparse

from spaceserve.runtime.routing.router import POLICIES


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "data parallel (Ray Serve)",
        "--data-parallel-size N > 1 (or --ray-address) serves N engine replicas on Ray Serve\n"
        "behind this one endpoint; needs the ray extra (pip install 'spaceserve[ray]')")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each on its own GPU (or TP group), or CPU threads")
    g.add_argument("--ray-address",
                   help="join this Ray cluster (default: RAY_ADDRESS, else the local cluster "
                        "`ray start` began, else start one here, stopped on exit)")
    g.add_argument("--ray-temp-dir",
                   help="a started cluster's sockets and logs (default: Ray's, /tmp/ray)")
    g.add_argument("--ray-app-name", default="spaceserve",
                   help="the Ray Serve application the replicas belong to")
    g.add_argument("--router", default="media_aware", choices=POLICIES,
                   help="how requests are spread over the replicas")
    g.add_argument("--replica-num-cpus", type=float, default=0.5,
                   help="CPUs Ray reserves per replica")
    g.add_argument("--replica-num-gpus", type=float,
                   help="GPUs per replica (default: 1 where the cluster has GPUs, else 0)")


def wants_replicas(args: argparse.Namespace) -> bool:
    """Whether the flags ask for replicas on Ray rather than one in-process engine."""
    return getattr(args, "data_parallel_size", 1) > 1 or bool(getattr(args, "ray_address", None))
