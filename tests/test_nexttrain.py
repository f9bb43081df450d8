"""Training next-edit Tab's adapter (`codeplane rl train-next-edit`, `rl/nextedit.py`): the
examples are the serve-time prompt and the answer the parser turns into the commit's next
state; the command trains with RL's trainer on the real code-small torch weights, resumes,
and writes an adapter the engine loads and serves `/v1/tab/next` with; benchmark
repositories are refused."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
from conftest import WEIGHTS_HOME
from typer.testing import CliRunner
from upstreams.scripted import caller, run_server

from codeplane.cli import app
from codeplane.models.registry import BUILTIN
from codeplane.tab.nextedit import parse, prompt_parts, rewrite_of
from codeplane.tab.replay import cases_of, file_cases

BASE = "code-small"
GGUF = next(spec for spec in BUILTIN if spec.name == BASE).filename
TORCH_COPY = WEIGHTS_HOME / "models" / "torch" / Path(GGUF).stem
OLD = "".join(f"value_{n} = compute({n})\n" if n % 9 == 3 else f"other_{n} = {n}\n"
              for n in range(40))


def history(root: Path) -> Path:
    """A repository whose second commit renames `compute` at each of its call sites (four
    hunks; the cutter keeps two cases of a file)."""
    root.mkdir(parents=True)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", "-C", str(root)]
    subprocess.run([*git, "init", "-q"], check=True)
    for text in (OLD, OLD.replace("compute(", "evaluate(")):
        (root / "calc.py").write_text(text)
        subprocess.run([*git, "add", "calc.py"], check=True)
        subprocess.run([*git, "commit", "-qm", "step"], check=True)
    return root / ".git"


def cli(home: Path, *args: str):
    return CliRunner().invoke(app, list(args), env={"CODEPLANE_HOME": str(home)})


def own_home(root: Path) -> Path:
    """A CODEPLANE_HOME with its own models/ (registry.json stays in the test) linking the
    shared GGUF weights and their torch copy."""
    models = root / "models"
    models.mkdir(parents=True)
    for weights in (WEIGHTS_HOME / "models").glob("*.gguf*"):
        (models / weights.name).symlink_to(weights)
    (models / "torch").mkdir()
    (models / "torch" / TORCH_COPY.name).symlink_to(TORCH_COPY, target_is_directory=True)
    return root


def needs_torch_copy() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    if not (TORCH_COPY / "model.safetensors").is_file():
        pytest.skip(f"no torch copy of {BASE} at {TORCH_COPY} (an RL run builds it)")


def test_benchmark_repositories_and_no_repository_are_refused(tmp_path):
    git = history(tmp_path / "pallets+click")
    refused = cli(tmp_path / "home", "rl", "train-next-edit", "--out", str(tmp_path / "a.gguf"),
                  "--git", str(git.parent))
    assert refused.exit_code == 2 and "benchmark" in refused.output
    named = cli(tmp_path / "home", "rl", "train-next-edit", "--out", str(tmp_path / "a.gguf"),
                "--repo", "pallets/click")  # refused before any clone
    assert named.exit_code == 2 and "benchmark" in named.output
    empty = cli(tmp_path / "home", "rl", "train-next-edit", "--out", str(tmp_path / "a.gguf"))
    assert empty.exit_code == 2 and "--git" in empty.output
    assert not (tmp_path / "a.gguf").exists()


@pytest.mark.parametrize("fmt", ["window", "cursor"])
def test_each_formats_answers_parse_into_the_commits_next_state(fmt, monkeypatch):
    """The trainer's answer for a case is `tab.nextedit.target` of the format it trains:
    read back by the product's parser it gives the commit's next state (no suggestion when
    the next edit is outside the window). `cursor` answers start at the cursor's line and
    stop JOIN_LINES lines after the change - nothing at all for no change."""
    from codeplane.rl import nextedit as train

    monkeypatch.setattr(train, "FORMAT", fmt)
    far = OLD.replace("other_4 = 4", "other_4 = 44").replace("other_36 = 36", "other_36 = 6")
    cases = [*file_cases("calc.py", OLD, OLD.replace("compute(", "evaluate(")),
             *file_cases("calc.py", OLD, far)]
    answers = []
    for case in cases:
        rest, changed = train.answer_of(case)
        req = train.request_of(case)
        got = parse(rewrite_of(req, rest), fmt, req)
        assert (got.apply(case["state"]) if got else case["state"]) == case["target"] \
            or not changed
        answers.append((rest, changed))
    assert [changed for _, changed in answers] == [True, True, True, True, False]
    if fmt == "cursor":  # from the cursor's line (the edit just made) to the window's end
        assert answers[0][0] == "value_3 = evaluate(3)\n" + "".join(
            f"other_{n} = {n}\n" for n in range(4, 12)) + "value_12 = evaluate(12)\n" \
            "other_13 = 13\n"
        assert answers[-1][0] == ""  # the next edit is 32 lines below: "no change"


@pytest.mark.model
def test_examples_are_the_served_prompt_and_an_answer_parsed_into_the_next_state(tmp_path):
    needs_torch_copy()
    from llama_cpp import Llama
    from transformers import AutoTokenizer

    from codeplane.rl.nextedit import FORMAT, Tokens, request_of

    tokens = Tokens(AutoTokenizer.from_pretrained(TORCH_COPY))
    vocab = Llama(str(WEIGHTS_HOME / "models" / GGUF), vocab_only=True, verbose=False)
    cases = cases_of(history(tmp_path / "calc"), 10)
    assert len(cases) == 2  # tab.replay.PER_FILE
    for case in cases:
        example = tokens.example(case, "calc", 4096)
        assert example is not None and example.changed
        parts, _, _ = prompt_parts(request_of(case), FORMAT)
        served = [t for text, control in parts
                  for t in vocab.tokenize(text.encode(), add_bos=False, special=control)]
        assert example.prompt_ids == served  # the engine's own tokenization of Tab's prompt
        assert example.completion_ids[-1] == tokens.stop
        answer = tokens.tokenizer.decode(example.completion_ids[:-1])
        got = parse(rewrite_of(request_of(case), answer), FORMAT, request_of(case))
        assert got is not None and got.apply(case["state"]) == case["target"]
    assert tokens.example(cases[0], "calc", 64) is None  # longer than allowed


@pytest.mark.model
def test_the_command_trains_resumes_and_its_adapter_serves_tab_next(tmp_path):
    needs_torch_copy()
    home = own_home(tmp_path / "home")
    git = history(tmp_path / "calc")
    out, run = tmp_path / "next.gguf", tmp_path / "run"
    train = ["rl", "train-next-edit", "--git", str(git), "--out", str(out), "--run", str(run),
             "--batch", "2", "--rank", "4", "--lr", "1e-3"]
    first = cli(home, *train, "--steps", "1")
    assert first.exit_code == 0, first.output
    assert f"codeplane model add NAME --adapter {out} --base {BASE}" in first.output
    second = cli(home, *train, "--steps", "2", "--json")  # resumes at step 2
    assert second.exit_code == 0, second.output
    steps = [json.loads(line)["step"] for line in (run / "steps.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
    assert 0 < out.stat().st_size <= 25 * 2**20

    added = cli(home, "model", "add", "next", "--adapter", str(out), "--base", BASE)
    assert added.exit_code == 0, added.output
    server = run_server(home, None, gateway={"auth": "on"})
    try:
        case = cases_of(git, 1)[0]
        body = {"path": case["path"], "text": case["state"], "model": "next",
                "cursor": {"line": case["line"], "character": 0}, "edits": case["edits"]}
        reply = httpx.post(f"{server.url}/v1/tab/next", json=body,
                           headers=caller(server, "alice"), timeout=300)
        assert reply.status_code == 200, reply.text
        assert reply.json()["source"] in ("model", "repeat", "none")
        assert reply.json()["completion_tokens"] > 0  # the adapter model decoded
    finally:
        server.stop()
