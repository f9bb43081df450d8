"""Accept/reject feedback for shown Tab suggestions, joined on the server to what was shown.

Only the editor knows whether a suggestion was taken, so the client reports it with the id the
server gave the suggestion (`POST /v1/tab/feedback`). The server keeps the shown suggestion's
labels (model, latency, length, confidence, source, language - never code) for a while, per
tenant, so that the accepted/rejected event in the lake carries the same fields as the shown
one, a tenant can only report on suggestions it was shown, and each is reported once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Literal

from pydantic import BaseModel, Field

KEPT = 10_000  # shown suggestions remembered for feedback (in memory; the oldest go first)


class Feedback(BaseModel):
    """Body of `POST /v1/tab/feedback`."""

    model_config = {"extra": "forbid"}
    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$",
                    description="the `id` of a /v1/tab answer that showed something")
    outcome: Literal["accepted", "rejected"]
    shown_ms: float = Field(ge=0, le=86_400_000, description="how long it was on screen")


class ShownLog:
    """Recently shown suggestions by (tenant, id), bounded; `take` hands each out once."""

    def __init__(self, size: int = KEPT) -> None:
        self.size = size
        self._items: OrderedDict[tuple[str, str], tuple[str, dict]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, tenant: str, suggestion_id: str, fields: dict, kind: str = "tab"
                 ) -> None:
        """Keep a shown event's fields; `kind` names its outcome events (`KIND_accepted`):
        "tab" for FIM, "tab_next" for next edits."""
        with self._lock:
            self._items[(tenant, suggestion_id)] = (kind, fields)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def take(self, tenant: str, suggestion_id: str) -> tuple[str, dict] | None:
        """The shown event's kind and fields, or None: unknown, expired, already reported,
        or shown to another tenant (indistinguishable on purpose)."""
        with self._lock:
            return self._items.pop((tenant, suggestion_id), None)
