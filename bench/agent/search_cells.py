"""Per-task cells for the search measurements (docs/search.md, "The agent's view"): from a
`run.py --out` results file and the transcripts next to it, for each row: result, turns/tool
calls, codebase_search calls and how many had a fix file as the top hit, whether the agent
read_file'd a top-hit file after searching, the first tool called, and wall seconds.

    python bench/agent/search_cells.py /tmp/agent5/search.jsonl

A task's fix files are the `src/...` paths its reference `solution` changes."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

TASKS = Path(__file__).resolve().parent / "tasks"
_PATH = re.compile(r"src/[\w/.]+\.py")


def fix_files(task: str) -> set[str]:
    return set(_PATH.findall(json.loads((TASKS / task / "task.json").read_text())["solution"]))


def transcript(results: Path, row: dict) -> Path:
    """Where run.py wrote this row's transcript (its `one()` names it so)."""
    label = f"-{row['label']}" if row.get("label") else ""
    return results.with_suffix("") / f"{row['harness']}{label}-{row['model']}-{row['task']}.jsonl"


def calls(path: Path) -> list[tuple[str, dict, str]]:
    """(tool, arguments, output) for every tool call in a transcript, in order."""
    events = [json.loads(line) for line in path.read_text().splitlines()]
    starts = {e["call_id"]: e for e in events if e["type"] == "tool_start"}
    return [(e["name"], starts[e["call_id"]]["arguments"], e["output"])
            for e in events if e["type"] == "tool_result" and e["call_id"] in starts]


def search_facts(made: list[tuple[str, dict, str]], fixes: set[str]) -> tuple[int, int, bool]:
    """(searches, searches whose top hit is a fix file, a top-hit file read afterwards)."""
    searches = right = 0
    tops: set[str] = set()
    read_after = False
    for name, args, output in made:
        if name == "codebase_search":
            searches += 1
            top = output.split(":", 1)[0]
            right += top in fixes
            tops.add(top)
        elif name == "read_file" and args.get("path") in tops:
            read_after = True
    return searches, right, read_after


def cell(results: Path, row: dict) -> str:
    made = calls(transcript(results, row))
    searches, right, read_after = search_facts(made, fix_files(row["task"]))
    result = "**pass**" if row["resolved"] else "fail"
    search = (f", search {searches} ({right} right{', then read' if read_after else ''})"
              if searches else "")
    cut = " cut" if row.get("status") == "cancelled" else ""
    first = made[0][0] if made else "-"
    return (f"{result} {row.get('steps')}/{row.get('tool_calls')}{search}; first {first}; "
            f"{row['seconds']:.0f} s{cut}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    args = ap.parse_args()
    if not args.results.is_file():
        ap.error(f"{args.results}: no such results file (bench/agent/run.py --out writes one)")
    for line in args.results.read_text().splitlines():
        row = json.loads(line)
        print(f"{row['label'] or row['search'] or '-':14s} {row['task']:26s} "
              f"{cell(args.results, row)}")


if __name__ == "__main__":
    main()
