"""Tab outcome log: shown / accepted / rejected events with latency, one JSON line each.

Accepted and rejected outcomes also go to the server (`POST /v1/tab/feedback`, sent by the LSP),
where they land in the event lake next to the shown event.

The future online-learning pipeline reads this file; the show/hide threshold is tuned from
it. It lives under `$CODEPLANE_HOME/client/` and holds no source code - only sizes, timings,
confidence and where the suggestion came from. Windows follow Continue: a suggestion replaced
sooner than 250 ms was never really seen, so it is not counted as rejected.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

SEEN_AFTER_S = 0.25


class Telemetry:
    def __init__(self, path: Path | None) -> None:
        self.path = path  # None: telemetry off (nothing written, nothing reported)
        self._lock = threading.Lock()
        self._shown: dict[str, tuple[float, dict]] = {}  # id -> (shown at, fields)

    def shown(self, suggestion_id: str, *, latency_ms: float, chars: int, source: str,
              confidence: float | None, language: str | None) -> None:
        fields = {"id": suggestion_id, "latency_ms": latency_ms, "chars": chars,
                  "source": source, "confidence": confidence, "language": language}
        self._shown[suggestion_id] = (time.monotonic(), fields)
        self._write("shown", fields)

    def accepted(self, suggestion_id: str) -> dict | None:
        """The recorded event, or None if the id is not (or no longer) shown."""
        entry = self._shown.pop(suggestion_id, None)
        if entry is None:
            return None
        return self._write("accepted", {**entry[1], "after_ms": _since(entry[0])})

    def rejected(self, suggestion_id: str) -> dict | None:
        """Record that the suggestion was replaced or dismissed without being accepted; None
        when it was not on screen long enough to count (or is unknown)."""
        entry = self._shown.pop(suggestion_id, None)
        if entry is None or time.monotonic() - entry[0] < SEEN_AFTER_S:
            return None
        return self._write("rejected", {**entry[1], "after_ms": _since(entry[0])})

    def _write(self, event: str, fields: dict) -> dict:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        if self.path is None:
            return record
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
        return record


def _since(start: float) -> float:
    return round((time.monotonic() - start) * 1000, 1)


def default_path(client_dir: Path) -> Path:
    return client_dir / "tab" / "events.jsonl"
