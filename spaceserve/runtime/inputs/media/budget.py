"""The server's budget of image and video pixels in preprocessing and waiting for the encoder.

Every request with media holds, from the moment its headers are read until its preprocessing
ends, a lease on as many pixels as its media decode to (a video: its sampled frames,
`video.OpenedVideo.pixels`); then, until its media are encoded, a lease on what its
preprocessed pixel values hold (`PixelLease.split`: values over three channels, no more than
it had). A request that would push the total over the
capacity is refused at once (InputError "busy", with the seconds after which to retry) instead
of queueing: decoding memory and the pixel values awaiting the encoder stay bounded by the
capacity, however many image requests arrive together.
"""

from __future__ import annotations

import threading

from spaceserve.checks import require_int
from spaceserve.runtime.inputs.errors import InputError


class PixelLease:
    """Pixels held by one request; `release` (idempotent) gives them back."""

    def __init__(self, budget: PixelBudget, pixels: int) -> None:
        self.budget, self.pixels = budget, pixels
        self._held = True

    def release(self) -> None:
        with self.budget._lock:
            if self._held:
                self._held = False
                self.budget._used -= self.pixels

    def split(self, pixels: int) -> PixelLease:
        """A new lease on `pixels` (at most this one's) moved out of this one, with no
        capacity check: this lease keeps the rest. For holding part of a budget longer."""
        with self.budget._lock:
            pixels = max(0, min(int(pixels), self.pixels if self._held else 0))
            self.pixels -= pixels
            return PixelLease(self.budget, pixels)

    def __enter__(self) -> PixelLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PixelBudget:
    """At most `capacity` decoded pixels in preprocessing at once (thread-safe)."""

    def __init__(self, capacity: int, *, retry_after: float = 1.0) -> None:
        require_int("capacity", capacity)
        self.capacity = capacity
        self.retry_after = retry_after
        self._used = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        return self._used

    def acquire(self, pixels: int, param: str = "messages", what: str = "images"
                ) -> PixelLease:
        """A lease on `pixels` (of `what`, as messages word it), or InputError: "over_budget"
        when they exceed the whole capacity, "busy" when other requests hold too much of it
        now."""
        if pixels > self.capacity:
            raise InputError(f"{param}: the {what} decode to {pixels} pixels; the server "
                             f"preprocesses at most {self.capacity} at once",
                             kind="over_budget", param=param)
        with self._lock:
            if self._used + pixels > self.capacity:
                raise InputError(f"{param}: the server is decoding {self._used} of its "
                                 f"{self.capacity} pixels; these {what} need {pixels} "
                                 "more; retry later", kind="busy", param=param,
                                 retry_after=self.retry_after)
            self._used += pixels
        return PixelLease(self, pixels)
