"""SLO-aware admission in the router: the engine's predictor (`policy.admission`) over the
router's own account of each replica, so a request goes to a replica that can still meet its
TTFT bound and is shed (503 with ``Retry-After``) only when none can.

The router does not see a replica's encoder queue job by job, only the predicted encoder and
prefill seconds of the requests it sent there that have no first token yet
(`ReplicaState.queued_encoder_s`, ``queued_prefill_s``). They are one block of work ahead of
the new request (FIFO: the router cannot know where TWSRFT would put it), priced at the same
curves as the request itself (`WorkModel`, whose encoder term skips images the replica has
recently encoded), with the policy's calibration learnt from the first tokens the router sees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spaceserve.runtime.policy.admission import AdmissionPolicy, Prediction, Queued

# routing.router's RouteRequest, ReplicaState and WorkModel, not imported: the tracker imports
# this module, and the router imports the curves (the import chain stays short)
RouteRequest = ReplicaState = WorkModel = Any


def own_work(req: RouteRequest, r: ReplicaState, model: WorkModel) -> Queued:
    """`req`'s encoder and prefill seconds on replica `r` (cached images are free)."""
    hashes = req.image_hashes or ("",) * len(req.image_tokens)
    enc = sum(model.encoder_s(t) for t, h in zip(req.image_tokens, hashes, strict=True)
              if not (h and h not in req.common and h in r.images))
    return Queued(enc, model.prefill_s(req.prompt_tokens), arrival=0.0)


def predict(policy: AdmissionPolicy, req: RouteRequest, r: ReplicaState,
            model: WorkModel) -> Prediction:
    """The verdict on sending `req` to replica `r` now (not counted as a refusal)."""
    ahead = Queued(r.queued_encoder_s, r.queued_prefill_s, arrival=-1.0)
    own = own_work(req, r, model)
    wait = policy.predict_wait(own, [ahead])
    if not policy.active:
        return Prediction(wait, True)
    limit = policy.admit_factor * policy.bound_s
    return Prediction(wait, wait <= limit, max(0.0, wait - limit))


def admission_order(policy: AdmissionPolicy, req: RouteRequest,
                    states: Sequence[ReplicaState], model: WorkModel,
                    order: Sequence[int]) -> tuple[list[int], Prediction | None]:
    """`order` (indices into `states`, best first) with the replicas predicted to meet the
    bound first, in their order; and, when none is, the refusal to answer with (the replica
    that drains soonest)."""
    verdicts = {i: predict(policy, req, states[i], model) for i in order}
    fits = [i for i in order if verdicts[i].admit]
    if fits or not verdicts:
        return fits + [i for i in order if not verdicts[i].admit], None
    best = min(verdicts.values(), key=lambda p: p.retry_after_s)
    return list(order), best


__all__ = ["admission_order", "own_work", "predict"]
