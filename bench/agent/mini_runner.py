"""Run mini-swe-agent on one task workspace: its classic text-based config (one bash block
per reply, `mini_textbased.yaml`) or its tool-calling config (`mini.yaml`).

Executed by bench/agent/run.py with mini-swe-agent's own interpreter. The model is the same
local model behind `codeplane serve`'s OpenAI endpoint (via litellm's `openai/` provider); the
environment is mini-swe-agent's bubblewrap environment, given the workspace, the Python install
and no network - the same isolation codeplane's agent gets. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# offline: litellm must not fetch its price list; a dead server should fail fast, not retry 10x
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT", "2")
os.environ.setdefault("LITELLM_LOG", "ERROR")

import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments.extra.bubblewrap import (
    BubblewrapEnvironment,
    BubblewrapEnvironmentConfig,
)
from minisweagent.models.litellm_model import LitellmModel
from minisweagent.models.litellm_textbased_model import LitellmTextbasedModel


def forced_call(config: str) -> dict:
    """mini.yaml demands a bash call in every reply, which is what `tool_choice: required`
    asks the server to enforce; without it the small models describe the call in prose and the
    run ends in RepeatedFormatError before any command runs (measured on code-medium)."""
    return {"tool_choice": "required"} if config == "toolcall" else {}


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--task", "--cwd", "--model", "--base-url", "--out"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--step-limit", type=int, default=12)
    ap.add_argument("--config", choices=("textbased", "toolcall"), default="textbased")
    args = ap.parse_args()
    name = "mini_textbased.yaml" if args.config == "textbased" else "mini.yaml"
    config = yaml.safe_load((builtin_config_dir / name).read_text())
    model_class = LitellmTextbasedModel if args.config == "textbased" else LitellmModel
    agent_cfg = {**config["agent"], "step_limit": args.step_limit, "cost_limit": 0,
                 "output_path": Path(args.out)}
    agent_cfg.pop("mode", None)
    model = model_class(model_name=f"openai/{args.model}", cost_tracking="ignore_errors",
                         model_kwargs={"api_base": args.base_url, "api_key": "unused",
                                       "temperature": 0.0, "max_tokens": 512,
                                       **forced_call(args.config)},
                         **{k: v for k, v in config["model"].items()
                            if k not in ("model_name", "model_kwargs")})
    prefix = str(Path(sys.base_prefix).resolve())  # pytest lives in the host's Python
    wrapper = BubblewrapEnvironmentConfig().wrapper_args + [
        "--unshare-net", "--unshare-pid", "--die-with-parent", "--ro-bind", prefix, prefix,
        "--setenv", "PATH", f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin"]
    env = BubblewrapEnvironment(cwd=args.cwd, env=config["environment"]["env"],
                                wrapper_args=wrapper, timeout=120)
    agent = DefaultAgent(model, env, **agent_cfg)
    start = time.monotonic()
    try:
        info = agent.run(args.task)
        status = info.get("exit_status", "unknown")
    except Exception as exc:  # noqa: BLE001 - report, do not crash the suite
        status = f"error: {type(exc).__name__}: {exc}"[:300]
    steps = sum(1 for m in agent.messages if m.get("role") == "assistant")
    print(json.dumps({"status": status, "steps": steps,
                      "seconds": round(time.monotonic() - start, 1)}))


if __name__ == "__main__":
    main()
