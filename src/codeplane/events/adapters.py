"""Adapters from compartments' existing event hooks to the event lake.

The agent loop already publishes every step to `Agent.listeners`; `agent_listener` turns the
two kinds that matter for the lake into `agent_step` rows. It copies only counters, names and
timings: the loop's events also carry messages and tool output (code), which never pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from codeplane.events.log import EventLog


def agent_listener(log: EventLog, tenant: str, model: str | None) -> Callable[[dict], None]:
    """`agent.listeners.append(agent_listener(events, principal.tenant, model))`."""

    def listen(event: dict[str, Any]) -> None:
        base = {"run_id": event.get("run_id"), "step": event.get("step"), "model": model}
        if event.get("type") == "model_turn":
            usage = event.get("usage") or {}
            log.emit("agent_step", tenant, {
                **base, "outcome": "model_turn", "latency_ms": _ms(event.get("seconds")),
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "adapter": usage.get("adapter")})  # a local adapter model's version
        elif event.get("type") == "tool_result":
            log.emit("agent_step", tenant, {
                **base, "tool": event.get("name"), "outcome": "ok" if event.get("ok") else "error",
                "latency_ms": _ms(event.get("seconds"))})

    return listen


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)
