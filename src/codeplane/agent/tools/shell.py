"""Running commands: run_terminal_cmd, in the workspace's sandbox under the run's limits."""

from __future__ import annotations

from codeplane.agent.env import Environment, ToolError
from codeplane.agent.toolset import ToolContext, tool


@tool("run_terminal_cmd", "Run a shell command in the workspace (sandboxed: no network, "
      "writes only inside the workspace). Use it to run tests and scripts. Output is capped.",
      {"command": {"type": "string"},
       "timeout": {"type": "integer", "description": "seconds (default 120)"}},
      ("command",), "exec", "redirect output to a file and grep or read_file it")
def run_terminal_cmd(env: Environment, args: dict, ctx: ToolContext) -> tuple[str, dict]:
    command = args["command"].strip()
    if not command:
        raise ToolError("command is empty")
    res = env.run(command, args.get("timeout"), ctx.cancel)
    ctx.checked = True
    status = (f"killed: {res.killed}" + (f" after {res.seconds:.0f}s" if res.killed == "timeout"
                                         else "")) if res.killed else f"exit code {res.exit_code}"
    text = f"$ {command}\n{res.output.rstrip()}\n[{status}]"
    return text, {"exit_code": res.exit_code, "killed": res.killed, "seconds": res.seconds,
                  "sandboxed": res.sandboxed}
