"""Planning: todo_write, the run's visible task list (kept in the ToolContext)."""

from __future__ import annotations

from codeplane.agent.env import Environment, ToolError
from codeplane.agent.toolset import ToolContext, tool

_STATUSES = ("pending", "in_progress", "completed", "cancelled")


@tool("todo_write", "Keep a visible task list for multi-step work. Each todo has id, content "
      "and status (pending, in_progress, completed, cancelled). merge=true updates todos by "
      "id; otherwise the list is replaced.",
      {"todos": {"type": "array", "items": {"type": "object", "properties": {
          "id": {"type": "string"}, "content": {"type": "string"},
          "status": {"type": "string", "enum": list(_STATUSES)}}}},
       "merge": {"type": "boolean"}}, ("todos",), "state", inline=True)
def todo_write(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    items = []
    for n, raw in enumerate(args["todos"], 1):
        if not isinstance(raw, dict):
            raise ToolError("each todo must be an object with id, content and status")
        status = str(raw.get("status") or "pending")
        if status not in _STATUSES:
            raise ToolError(f"todo status must be one of {', '.join(_STATUSES)}")
        items.append({"id": str(raw.get("id") or n), "content": str(raw.get("content") or ""),
                      "status": status})
    if args.get("merge"):
        merged = {t["id"]: t for t in ctx.todos}
        for item in items:
            merged[item["id"]] = {**merged.get(item["id"], {}),
                                  **{k: v for k, v in item.items() if v}}
        items = list(merged.values())
    ctx.todos[:] = items
    marks = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]", "cancelled": "[-]"}
    text = "\n".join(f"{marks[t['status']]} {t['id']}. {t['content']}" for t in items)
    return text or "(no todos)", {"todos": [dict(t) for t in items]}
