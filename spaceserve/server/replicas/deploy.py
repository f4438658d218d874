"""SpaceServe replicas on Ray Serve behind one OpenAI-compatible endpoint.

`DataParallelServer` (the Python entry point; ``spaceserve serve --data-parallel-size N`` runs
it) joins a Ray cluster or starts a local one, deploys N `EngineReplica`s as one Ray Serve
deployment (Ray places, health-checks and restarts them; SpaceServe's request router picks one
per request), and builds the single server's FastAPI app (`create_app`) over a `ReplicaClient`
whose requests go to the replicas through a Ray Serve deployment handle. HTTP is served by that
FastAPI ingress, in this process (uvicorn), not by Ray's HTTP proxy (Serve runs with its proxy
disabled): the API, errors, /health and /metrics are the single server's, and the router lives
beside the client that reports first tokens to it. The ingress preprocesses requests (chat
template, media fetching and decoding) under the single server's bounds: the same admission
middleware, preprocessing lanes, pixel budgets and deadlines; replicas get prepared prompts.

    with DataParallelServer("tiny", data_parallel_size=2) as dp:   # replicas up, app built
        dp.serve(port=8000)   # draining on SIGTERM; or ServerThread(dp.app, client=dp.client)

``spaceserve serve --data-parallel-size N`` serves like the single server: the same flags
(`settings.ServeSettings`), connection cap and read timeouts, and the same graceful shutdown
(`shutdown.DrainingServer`: the first SIGTERM / SIGINT drains within
``--graceful-shutdown-timeout``, a second ends the requests at once); then the replicas and
the cluster stop. Closing deletes the Serve application, and stops Serve and the Ray cluster
when this process started them.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

from spaceserve.runtime.routing.router import POLICIES, RouterConfig, WorkModel
from spaceserve.server.replicas import state

if TYPE_CHECKING:
    import argparse

    from spaceserve.server.settings import ServerLimits
    from spaceserve.server.transport.guard import GuardLimits

ROUTER_CLASS = "spaceserve.server.replicas.router.SpaceServeRequestRouter"
DEPLOYMENT = "SpaceServeReplica"


class RayBackend:
    """A `ReplicaBackend` over a Ray Serve deployment handle (streaming calls)."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle.options(stream=True)

    async def stream(self, kwargs: dict[str, Any]):
        gen = self.handle.generate.remote(**kwargs)
        done = False
        try:
            async for item in gen:
                yield item
            done = True
        finally:
            if not done:  # the client went away or the request was retried: stop the replica
                gen.cancel()

    def is_replica_failure(self, exc: BaseException) -> bool:
        from ray import exceptions as rx
        from ray.serve.exceptions import ReplicaUnavailableError

        return isinstance(exc, (rx.RayActorError, rx.WorkerCrashedError, rx.NodeDiedError,
                                rx.LocalRayletDiedError, rx.ObjectLostError,
                                ReplicaUnavailableError))


def _import_ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"data-parallel serving needs Ray Serve ({exc}): pip install "
                          "'spaceserve[ray]'") from None
    return ray


def work_model(path: Any, curves: str | None = None) -> WorkModel:
    """The routing cost model: `curves` (a curves file) or the checkpoint's analytic curves."""
    from spaceserve.runtime.policy.curves import CurveSet

    if curves:
        return WorkModel(CurveSet.load(curves))
    from transformers import AutoConfig

    from spaceserve.runtime.policy.analytic.model import analytic_curves

    return WorkModel(analytic_curves(AutoConfig.from_pretrained(str(path))))


def image_token_id(path: Any) -> int | None:
    try:
        return json.loads((path / "config.json").read_text()).get("image_token_id")
    except (OSError, ValueError):
        return None


class DataParallelServer:
    """See the module docstring. `engine_kwargs` go to every replica's `load_engine` (mode,
    device, dtype, attention_backend, max_num_seqs, num_kv_blocks, seed, ...)."""

    def __init__(self, model: str = "tiny", *, data_parallel_size: int = 2,
                 served_model_name: str | None = None, limits: ServerLimits | None = None,
                 max_pending: int = 256, router: str = "media_aware",
                 router_config: RouterConfig | None = None, ray_address: str | None = None,
                 ray_temp_dir: str | None = None, app_name: str = "spaceserve",
                 replica_num_cpus: float = 0.5, replica_num_gpus: float | None = None,
                 route_timeout_s: float = 60.0, stats_period_s: float = 1.0,
                 health_check_period_s: float = 2.0, guard: GuardLimits | None = None,
                 max_preprocess_pixels: int | None = None, preprocess_queue: int = 256,
                 **engine_kwargs: Any) -> None:
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) \
                or data_parallel_size < 1:
            raise ValueError(f"data_parallel_size={data_parallel_size!r} must be an int >= 1")
        if router not in POLICIES:
            raise ValueError(f"router={router!r} is not one of {', '.join(POLICIES)}")
        if not replica_num_cpus >= 0 or (replica_num_gpus is not None and replica_num_gpus < 0):
            raise ValueError("replica_num_cpus and replica_num_gpus must be >= 0")
        self.model, self.size = model, data_parallel_size
        self.model_name = served_model_name or model
        self.limits, self.max_pending, self.router = limits, max_pending, router
        self.guard, self.max_preprocess_pixels = guard, max_preprocess_pixels
        self.preprocess_queue = preprocess_queue
        self.router_config = router_config or RouterConfig()
        self.ray_address, self.ray_temp_dir, self.app_name = ray_address, ray_temp_dir, app_name
        self.cpus, self.gpus = replica_num_cpus, replica_num_gpus
        self.route_timeout_s, self.stats_period_s = route_timeout_s, stats_period_s
        self.health_check_period_s = health_check_period_s
        self.engine_kwargs = engine_kwargs
        self.tracker_name = f"spaceserve:{app_name}"
        self.app: Any = None
        self.client: Any = None
        self.handle: Any = None
        self.started_ray = self.started_serve = self.connected = self.deployed = False

    def __enter__(self) -> DataParallelServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> DataParallelServer:
        """Start (or join) Ray, deploy the replicas, wait until they serve, build the app. The
        ingress's own loading (tokenizer, image processor, cost model) overlaps Ray's start."""
        from concurrent.futures import ThreadPoolExecutor

        from spaceserve.runtime.inputs import PixelBudget, PreprocessPool
        from spaceserve.server.app import create_app
        from spaceserve.server.engine_client import cap_video_tokens
        from spaceserve.server.handles import DEFAULT_PIXELS
        from spaceserve.server.replicas.client import ReplicaClient

        from ...models.tiny import resolve_model

        ray = _import_ray()
        self._check_engine_kwargs()
        path = resolve_model(self.model)  # the tiny checkpoint is built once, here
        with ThreadPoolExecutor(1, thread_name_prefix="spaceserve-ingress") as pool:
            ingress = pool.submit(self._ingress, path)
            try:
                self._connect(ray)
                handle = self.handle = self._deploy(str(path))
                pre, tracker = ingress.result()
                state.register(self.tracker_name, tracker)
                info = handle.info.remote().result(timeout_s=120)
            except BaseException:
                self.close()
                raise
        cap_video_tokens(pre, info["max_model_len"])  # as each replica's load_engine does
        self.client = ReplicaClient(
            RayBackend(handle), tracker, max_model_len=info["max_model_len"], mode=info["mode"],
            mode_note=info["mode_note"], num_replicas=self.size, device=info.get("device"),
            max_num_seqs=info.get("max_num_seqs"),
            vocab_size=info.get("vocab_size"),
            image_token_id=pre.image_token_id, merge_size=pre.merge,
            max_pending=self.max_pending * self.size, route_timeout_s=self.route_timeout_s,
            pool=PreprocessPool(max_queue=self.preprocess_queue),
            pixels=PixelBudget(self.max_preprocess_pixels or DEFAULT_PIXELS))
        self.app = create_app(self.client, pre, model_name=self.model_name, limits=self.limits,
                              root=self.model, guard=self.guard)
        return self

    def serve(self, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
              settings: Any = None) -> None:
        """Serve HTTP here until SIGTERM / SIGINT, then drain as the single server does
        (`settings`: a `settings.ServeSettings` for the connection limits and the graceful
        shutdown bound; the defaults otherwise). Call from the main thread of a started
        server."""
        from spaceserve.server.settings import ServeSettings

        if settings is None:
            from spaceserve.server.transport.connections import ConnectionLimits
            from spaceserve.server.transport.guard import GuardLimits

            settings = ServeSettings(self.limits, self.guard or GuardLimits(),
                                     ConnectionLimits())
        self.app.state.fair_share_key = settings.fair_share_key  # each request's user
        settings.server(self.app, self.client, host=host, port=port,
                        log_level=log_level).run()

    def _check_engine_kwargs(self) -> None:
        """Bad engine settings fail here, at once, not in every replica Ray keeps restarting."""
        from spaceserve.runtime.engine.config import EngineConfig
        from spaceserve.server.engine_client import resolve_mode

        kw = {k: v for k, v in self.engine_kwargs.items()
              if k not in ("mode", "device", "dtype", "attention_backend")}
        config = EngineConfig(mode=resolve_mode(self.engine_kwargs.get("mode", "temporal"))[0],
                              **kw)
        if self.ray_address is None:  # the replicas run on this machine: check its device once
            from spaceserve.runtime.engine.assemble import check_green_contexts, resolve_device

            check_green_contexts(config, resolve_device(self.engine_kwargs.get("device")))

    def _admission(self) -> Any:
        """The router's SLO-aware admission (`routing.admission`), as the replicas run it."""
        from spaceserve.runtime.policy.admission import AdmissionPolicy

        kw = self.engine_kwargs
        return AdmissionPolicy(kw.get("slo"), mode=kw.get("admission", "queue"), order="fifo")

    def _ingress(self, path: Any) -> tuple[Any, Any]:
        """(chat preprocessor, routing tracker) of the checkpoint at `path`."""
        from spaceserve.runtime.inputs import ChatPreprocessor
        from spaceserve.runtime.routing.tracker import ReplicaTracker

        pre = ChatPreprocessor.from_pretrained(path, image_token_id=image_token_id(path))
        tracker = ReplicaTracker(work_model(path, self.engine_kwargs.get("curves")),
                                 self.router_config, policy=self.router,
                                 admission=self._admission())
        return pre, tracker

    def _connect(self, ray: Any) -> None:
        if ray.is_initialized():
            return
        try:
            from ray._private.services import canonicalize_bootstrap_address

            self.started_ray = canonicalize_bootstrap_address(self.ray_address,
                                                              self.ray_temp_dir) is None
        except Exception:  # an API change: assume a cluster we must not stop
            self.started_ray = False
        ray.init(address=self.ray_address, include_dashboard=False,
                 _temp_dir=self.ray_temp_dir if self.started_ray else None,
                 logging_level="WARNING")
        self.connected = True

    def _deploy(self, path: str) -> Any:
        import ray
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        from spaceserve.server.replicas.replica import EngineReplica

        self.started_serve = not self._serve_running()
        serve.start(proxy_location="Disabled", logging_config={"enable_access_log": False,
                                                               "log_level": "WARNING"})
        gpus = self.gpus
        if gpus is None:  # a GPU, or a TP group's GPUs, per replica where the cluster has them
            group = float(self.engine_kwargs.get("tensor_parallel_size") or 1)
            gpus = group if ray.cluster_resources().get("GPU", 0) >= group and \
                self.engine_kwargs.get("device") in (None, "cuda") else 0.0
        kwargs = dict(self.engine_kwargs)
        if not gpus and not kwargs.get("device"):
            kwargs["device"] = "cpu"
        router = RequestRouterConfig(
            request_router_class=ROUTER_CLASS,
            request_router_kwargs={"tracker": self.tracker_name},
            request_routing_stats_period_s=self.stats_period_s,
            request_routing_stats_timeout_s=max(10.0, 5 * self.stats_period_s))
        dep = serve.deployment(EngineReplica, name=DEPLOYMENT).options(
            num_replicas=self.size, max_ongoing_requests=self.max_pending,
            ray_actor_options={"num_cpus": self.cpus, "num_gpus": gpus},
            request_router_config=router, health_check_period_s=self.health_check_period_s,
            health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0,
            graceful_shutdown_wait_loop_s=0.5,
            logging_config={"enable_access_log": False, "log_level": "WARNING"})
        threads = max(1, int(self.cpus)) if not gpus else None
        app = dep.bind(model=path, engine_kwargs=kwargs, max_pending=self.max_pending,
                       num_threads=threads)
        self.deployed = True
        return serve.run(app, name=self.app_name, route_prefix=None)

    @staticmethod
    def _serve_running() -> bool:
        """Whether the cluster already runs Serve (then it is not ours to shut down)."""
        try:
            from ray.serve.context import _get_global_client

            return _get_global_client(raise_if_no_controller_running=False) is not None
        except Exception:  # an API change: assume it runs
            return True

    def close(self) -> None:
        """Stop serving: in a cluster this process started, stopping Ray stops everything in it
        (replicas included); in a joined one, the app is deleted and Serve shut down if this
        process started it."""
        if self.client is not None:
            self.client.close()
        fetcher = getattr(getattr(self.app, "state", None), "fetcher", None)
        if fetcher is not None:
            fetcher.close()
        try:
            if self.deployed and not self.started_ray:  # a cluster we leave running
                from ray import serve

                self.deployed = False
                if self.started_serve:
                    serve.shutdown()
                else:
                    serve.delete(self.app_name)
        finally:
            state.unregister(self.tracker_name)
            if self.connected:
                import ray

                ray.shutdown()
                self.connected = False


def main(args: argparse.Namespace) -> int:
    """``spaceserve serve`` with replicas: start them, serve HTTP until SIGINT/SIGTERM, drain
    as the single server does (``--graceful-shutdown-timeout``), stop."""
    from spaceserve.server.flags import engine_args
    from spaceserve.server.settings import ServeSettings

    serving = False

    def on_term(signum: int, frame: Any) -> None:
        if not serving:  # starting up: unwind through close()
            raise SystemExit(128 + signum)
        # serving: the draining server handles signals; stopping Ray comes after it

    signal.signal(signal.SIGTERM, on_term)
    try:
        settings = ServeSettings.from_args(args)
        server = DataParallelServer(
            args.model, data_parallel_size=args.data_parallel_size,
            served_model_name=args.served_model_name, limits=settings.limits,
            max_pending=settings.max_pending, router=args.router, ray_address=args.ray_address,
            ray_temp_dir=args.ray_temp_dir, app_name=args.ray_app_name,
            replica_num_cpus=args.replica_num_cpus, replica_num_gpus=args.replica_num_gpus,
            guard=settings.guard, max_preprocess_pixels=settings.max_preprocess_pixels,
            preprocess_queue=settings.preprocess_queue,
            **engine_args(args))
    except ValueError as exc:
        print(f"spaceserve serve: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        server.start()
    except (ImportError, ValueError) as exc:
        print(f"spaceserve serve: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # Ray Serve could not bring the replicas up
        print(f"spaceserve serve: the replicas did not start: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, on_term)  # ray.init installed its own
    try:
        client = server.client
        print(f"spaceserve serve: {args.data_parallel_size} replicas of {args.model} "
              f"({client.mode}, router {args.router}) on Ray Serve in "
              f"{time.monotonic() - t0:.0f} s; http://{args.host}:{args.port}", file=sys.stderr,
              flush=True)
        if client.mode_note:
            print(f"spaceserve serve: {client.mode_note}", file=sys.stderr)
        serving = True
        server.serve(args.host, args.port, log_level=args.log_level, settings=settings)
    finally:
        t1 = time.monotonic()
        server.close()
        print(f"spaceserve serve: replicas stopped in {time.monotonic() - t1:.1f} s",
              file=sys.stderr, flush=True)
    # as the single server: the drain kept its bound, so leave without a slow interpreter
    # teardown (Ray is stopped already)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
