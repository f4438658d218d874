"""Data-parallel serving: SpaceServe engine replicas on Ray Serve behind one endpoint.

deploy.py (`DataParallelServer`, the Python entry point, and the ``spaceserve serve
--data-parallel-size N`` command), replica.py (`EngineReplica`: one engine as a Ray Serve
replica), router.py (`SpaceServeRequestRouter`: Ray Serve's request router running
`spaceserve.runtime.routing.router`), state.py (the routing trackers, by name), client.py
(`ReplicaClient`: the engine client `create_app` serves, with retry on replica failure),
metrics.py (totals plus per-replica series), args.py (the command's flags). Importing this
package imports nothing of Ray; the ``ray`` extra is needed only to start replicas.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataParallelServer"]


def __getattr__(name: str) -> Any:
    if name == "DataParallelServer":
        from spaceserve.server.replicas.deploy import DataParallelServer

        return DataParallelServer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
