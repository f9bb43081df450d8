"""Serving what was trained: a LoRA adapter registered on a base model (`codeplane model add
NAME --adapter FILE --base BASE`, or `--from-run` an RL run) is served by the base's worker
through the OpenAI-compatible API, swapped in per request without leaking into the base,
picked up by a running server without a restart, and recorded in the event lake by version.

The adapters are made here with torch, as RL writes them (`write_gguf_adapter`)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from conftest import WEIGHTS_HOME, make_settings
from gguf import GGUFReader
from typer.testing import CliRunner
from upstreams.scripted import caller, run_server, wait_end

from codeplane.agent.hooks import PRODUCT_HOOKS
from codeplane.events import query
from codeplane.models.cli import app as model_app
from codeplane.models.engine import Engine
from codeplane.models.lora import write_gguf_adapter
from codeplane.models.registry import BUILTIN, ModelRegistry
from codeplane.storage import ObjectStore

pytestmark = pytest.mark.model
BASE = "code-small"
RANK = 8
CHAT = {"messages": [{"role": "user", "content": "Name a sorting algorithm."}],
        "max_tokens": 8, "temperature": 0}
COMPLETE = {"prompt": "def fibonacci(n):\n", "max_tokens": 6, "temperature": 0, "logprobs": 1}


def own_home(root: Path) -> Path:
    """A CODEPLANE_HOME whose models/ is its own directory (its registry.json and adapter
    copies stay in the test) with links to the shared pulled weights."""
    models = root / "models"
    models.mkdir(parents=True)
    for weights in (WEIGHTS_HOME / "models").glob("*.gguf*"):
        (models / weights.name).symlink_to(weights)
    return root


def base_shapes() -> tuple[int, dict[str, list[int]]]:
    """code-small's layer count and tensor shapes, read from its GGUF. Read once per module:
    `GGUFReader` parses the whole header, the tokenizer's 151k-entry arrays included, which
    takes tens of seconds on this machine (docs/testing.md)."""
    weights = next(spec for spec in BUILTIN if spec.name == BASE).filename
    reader = GGUFReader(str(WEIGHTS_HOME / "models" / weights))
    return (int(reader.fields["qwen2.block_count"].contents()),
            {t.name: [int(n) for n in t.shape] for t in reader.tensors})


def make_adapter(path: Path, seed: int, base: tuple[int, dict[str, list[int]]]) -> Path:
    """A random LoRA on every layer's q and v projections of code-small (`base`: its layer
    count and tensor shapes), written as RL writes its policies."""
    layers, shapes = base
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for layer in range(layers):
        for module, tensor in (("q_proj", "attn_q"), ("v_proj", "attn_v")):
            width, height = shapes[f"blk.{layer}.{tensor}.weight"]  # ggml order: in, out
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            state[f"{key}.lora_A.weight"] = torch.randn(RANK, width, generator=gen) / width ** .5
            state[f"{key}.lora_B.weight"] = torch.randn(height, RANK, generator=gen) * 0.05
    return write_gguf_adapter(state, path, "qwen2", alpha=16.0)


def cli(home: Path, *args: str):
    return CliRunner().invoke(model_app, list(args), env={"CODEPLANE_HOME": str(home)})


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = base_shapes()
    return make_adapter(root / "a.gguf", 1, base), make_adapter(root / "b.gguf", 2, base)


def test_an_adapter_model_is_served_swapped_per_request_and_recorded(tmp_path, adapters):
    home = own_home(tmp_path / "home")
    roots = tmp_path / "roots"
    (roots / "ws").mkdir(parents=True)
    server = run_server(home, None, gateway={"auth": "on"}, workspace_roots=[str(roots)])
    try:
        alice = caller(server, "alice")

        def ask(model: str, kind: str = "completions") -> dict:
            body = {"model": model, **(COMPLETE if kind == "completions" else CHAT)}
            reply = httpx.post(f"{server.url}/v1/{kind}", json=body, headers=alice,
                               timeout=120)
            assert reply.status_code == 200, reply.text
            return reply.json()

        base_only = ask(BASE)
        assert base_only["usage"]["adapter"] is None
        assert "serve" not in {m["id"] for m in httpx.get(f"{server.url}/v1/models",
                                                          headers=alice).json()["data"]}
        added = cli(home, "add", "serve", "--adapter", str(adapters[0]), "--base", BASE)
        assert added.exit_code == 0, added.output
        listed = httpx.get(f"{server.url}/v1/models", headers=alice).json()["data"]
        assert "serve" in {m["id"] for m in listed}  # no restart
        version_a = ModelRegistry(server.app.state.settings).get("serve").adapter.version

        served = ask("serve")
        assert served["usage"]["adapter"] == version_a
        assert not logprobs_close(served, base_only)  # the adapter changes the model
        chat = ask("serve", "chat/completions")
        assert chat["usage"]["adapter"] == version_a and chat["choices"][0]["message"]
        # the adapter never leaks into the base: base answers exactly as in a base-only run
        assert logprobs_close(ask(BASE), base_only)
        assert logprobs_close(ask("serve"), served)
        assert logprobs_close(ask(BASE), base_only)

        again = cli(home, "add", "serve", "--adapter", str(adapters[1]), "--base", BASE)
        assert again.exit_code == 0, again.output
        renewed = ask("serve")  # the next request uses the new version
        version_b = renewed["usage"]["adapter"]
        assert version_b not in (None, version_a)
        assert not logprobs_close(renewed, served)

        run = httpx.post(f"{server.url}/v1/agent/runs", headers=alice, timeout=30, json={
            "task": "Say hello.", "path": str(roots / "ws"), "model": "serve",
            "max_steps": 1, "max_tokens": 16, "stream": False})
        assert run.status_code == 200, run.text
        wait_end(server.url, run.json()["id"], alice, timeout=300)

        # as every route: no key, no service
        anonymous = httpx.post(f"{server.url}/v1/completions",
                               json={"model": "serve", **COMPLETE})
        assert anonymous.status_code == 401
    finally:
        server.stop()  # the shutdown flushes the event log
    con = query.connect(ObjectStore.open(str(server.app.state.settings.server_dir / "objects")))
    usage = con.execute("SELECT model, adapter FROM gateway_usage WHERE tenant = 'alice'"
                        ).fetchall()
    assert {(BASE, None), ("serve", version_a), ("serve", version_b)} <= set(usage)
    steps = con.execute("SELECT model, adapter FROM agent_step WHERE tenant = 'alice' AND "
                        "outcome = 'model_turn'").fetchall()
    assert steps and set(steps) == {("serve", version_b)}


def logprobs_close(one: dict, other: dict) -> bool:
    """Same tokens with the same log-probabilities (to llama.cpp's float rounding)."""
    a, b = one["choices"][0], other["choices"][0]
    return a["text"] == b["text"] and a["logprobs"]["token_logprobs"] == pytest.approx(
        b["logprobs"]["token_logprobs"], abs=1e-4)


def test_model_add_validates_and_lists_replaces_and_removes_adapters(tmp_path, adapters):
    home = own_home(tmp_path / "home")
    registry = ModelRegistry(make_settings(home))
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    wrong = write_gguf_adapter(  # shapes no layer of code-small has
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 7),
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(7, 4)},
        tmp_path / "wrong.gguf", "qwen2", 8.0)
    for args, says in [
        (["--adapter", str(adapters[0]), "--base", "no-such-model"], "unknown model"),
        (["--adapter", str(tmp_path / "missing.gguf"), "--base", BASE], "missing.gguf"),
        (["--adapter", str(not_gguf), "--base", BASE], "not a GGUF file"),
        (["--adapter", str(wrong), "--base", BASE], "could not load the LoRA adapter"),
        (["--adapter", str(adapters[0])], "--adapter needs --base"),
        ([str(adapters[0]), "--adapter", str(adapters[0]), "--base", BASE], "exactly one"),
        (["--adapter", str(adapters[0]), "--base", BASE, "--tools"], "--tools"),
    ]:
        result = cli(home, "add", "serve", *args)
        assert result.exit_code == 2 and says in result.output, (args, result.output)
    assert [s.name for s in registry.all() if s.adapter] == []
    assert not list((home / "models" / "adapters").glob("*.gguf"))  # no copy left behind

    assert cli(home, "add", "serve", "--adapter", str(adapters[0]), "--base", BASE,
               "--scale", "0.5").exit_code == 0
    first = registry.get("serve")
    assert (first.base, first.adapter.scale) == (BASE, 0.5)
    assert first.capabilities == registry.get(BASE).capabilities
    mine = tmp_path / "mine.gguf"
    mine.write_bytes(adapters[1].read_bytes())
    assert cli(home, "add", "serve", "--adapter", str(mine), "--base", BASE).exit_code == 0
    second = registry.get("serve")
    assert second.adapter.version != first.adapter.version
    assert not first.adapter.path.exists()  # the replaced version's copy is gone
    mine.unlink()  # the registry serves its own copy, not the user's file
    assert second.adapter.path.is_file()

    info = json.loads(cli(home, "info", "serve", "--json").output)
    assert (info["base"], info["adapter"]["version"]) == (BASE, second.adapter.version)
    listed = {m["name"]: m for m in json.loads(cli(home, "list", "--json").output)}
    assert listed["serve"]["adapter"]["sha256"] == second.adapter.sha256
    assert second.adapter.version in cli(home, "list").output

    assert cli(home, "add", "tuned", str(first.file_path(registry.settings))).exit_code == 0
    assert cli(home, "add", "on-tuned", "--adapter", str(adapters[0]),
               "--base", "tuned").exit_code == 0
    blocked = cli(home, "remove", "tuned")
    assert blocked.exit_code == 2 and "on-tuned" in blocked.output
    assert cli(home, "remove", "serve").exit_code == 0
    assert not second.adapter.path.exists()
    assert [s.name for s in registry.all() if s.adapter] == ["on-tuned"]


def test_model_add_from_an_rl_run_takes_its_newest_policy_or_converts_its_checkpoint(
        tmp_path, adapters):
    home = own_home(tmp_path / "home")
    registry = ModelRegistry(make_settings(home))
    run = trained_run(tmp_path / "run", *[adapters[0]] * 11, adapters[1])  # v1-v11, v12
    assert cli(home, "add", "trained", "--from-run", str(run)).exit_code == 0
    spec = registry.get("trained")
    assert spec.base == BASE and spec.adapter.path.read_bytes() == adapters[1].read_bytes()

    wrong_base = cli(home, "add", "trained", "--from-run", str(run), "--base", "code-medium")
    assert wrong_base.exit_code == 2 and "trained 'code-small'" in wrong_base.output

    for policy in (run / "adapters").iterdir():  # a torch-sampler run: only the trainer's
        policy.unlink()
    lora = {f"base_model.model.model.layers.0.self_attn.q_proj.lora_{side}.weight": tensor
            for side, tensor in (("A", torch.randn(RANK, 896) / 30), ("B",
                                                                     torch.randn(896, RANK)))}
    torch.save({"lora": lora, "version": 4}, run / "checkpoint" / "trainer.pt")
    converted = cli(home, "add", "trained", "--from-run", str(run))
    assert converted.exit_code == 0, converted.output
    assert registry.get("trained").adapter.version != spec.adapter.version
    engine = Engine(make_settings(home))
    try:
        score = engine.run_sync("trained", "score", [1, 2, 3], [4, 5])
        assert score != pytest.approx(engine.run_sync(BASE, "score", [1, 2, 3], [4, 5]),
                                      abs=1e-4)
    finally:
        engine.close()

    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli(home, "add", "trained", "--from-run", str(empty), "--base", BASE)
    assert result.exit_code == 2 and "not an RL run directory" in result.output


def trained_run(run: Path, *policies: Path) -> Path:
    """An RL run's directory as a run leaves it: its policy adapters (`policy-v1.gguf`, ...),
    the trainer's settings, and the config it wrote at its start (`rl.run.save_config`),
    whose episodes ran the core toolset with 2,000 characters of tool output, an answer turn
    and no hooks."""
    from codeplane.rl.config import RunConfig
    from codeplane.rl.run import save_config

    (run / "adapters").mkdir(parents=True)
    (run / "checkpoint").mkdir()
    (run / "checkpoint" / "trainer.json").write_text(json.dumps(
        {"model": BASE, "lora_rank": RANK, "lora_alpha": 16.0}))
    for version, policy in enumerate(policies, 1):
        (run / "adapters" / f"policy-v{version}.gguf").write_bytes(policy.read_bytes())
    save_config(RunConfig.model_validate({
        "out": str(run), "tasks": {"train_dirs": [str(run)]},
        "rollout": {"toolset": "core", "max_result_chars": 2000, "answer_turn": True,
                    "hooks": "none", "max_turns": 2, "max_tokens": 16}}))
    return run


def test_a_model_from_a_run_is_served_in_the_agent_setup_it_was_trained_in(tmp_path,
                                                                          adapters):
    """`model add --from-run` records the run's agent setup; `codeplane agent` and
    `/v1/agent/runs` on that model run in it, and what a caller sets explicitly wins."""
    from codeplane.cli import app as root_app

    home = own_home(tmp_path / "home")
    run = trained_run(tmp_path / "run", adapters[0])
    setup = {"max_steps": 2, "max_tokens": 16, "toolset": "core", "max_result_chars": 2000,
             "answer_turn": True, "required_steps": 1, "hooks": []}
    older = tmp_path / "older"
    older.mkdir()
    for entry in ("adapters", "checkpoint"):  # a run from before runs recorded their setup
        (older / entry).symlink_to(run / entry)
    refused = cli(home, "add", "trained", "--from-run", str(older))
    assert refused.exit_code == 2 and "codeplane rl record-setup" in refused.output
    added = cli(home, "add", "trained", "--from-run", str(run))
    assert added.exit_code == 0, added.output
    assert ModelRegistry(make_settings(home)).get("trained").agent == setup

    roots = tmp_path / "roots"
    (roots / "ws").mkdir(parents=True)
    (roots / "ws" / "notes.txt").write_text("hello\n")
    server = run_server(home, None, gateway={"auth": "on"}, workspace_roots=[str(roots)])
    try:
        alice = caller(server, "alice")
        listed = {m["id"]: m for m in httpx.get(f"{server.url}/v1/models",
                                                headers=alice).json()["data"]}
        assert listed["trained"]["agent_setup"] == setup
        assert "agent_setup" not in listed[BASE]

        def agent(*args: str) -> dict:
            """The first event of `codeplane agent` on the trained model: what ran."""
            transcript = tmp_path / f"t{len(list(tmp_path.glob('t*.jsonl')))}.jsonl"
            result = CliRunner().invoke(root_app, [
                "agent", "Say hello.", "--model", "trained", "--server", server.url,
                "--path", str(roots / "ws"), "--transcript", str(transcript), "--json",
                *args], env={"CODEPLANE_HOME": str(home),
                             "CODEPLANE_API_KEY": alice["authorization"].split()[1]})
            assert result.exit_code == 0, result.output
            return json.loads(transcript.read_text().splitlines()[0])

        recorded = agent()
        assert {k: recorded["config"][k] for k in setup if k != "hooks"} == {
            k: v for k, v in setup.items() if k != "hooks"}
        assert recorded["hooks"] == [] and len(recorded["tools"]) == 8  # the core toolset
        chosen = agent("--max-steps", "1", "--toolset", "full")
        assert (chosen["config"]["max_steps"], chosen["config"]["toolset"]) == (1, "full")
        assert chosen["config"]["max_result_chars"] == 2000 and chosen["hooks"] == []
        product = agent("--setup", "product", "--max-steps", "1", "--max-tokens", "16")
        assert (product["config"]["toolset"], product["config"]["answer_turn"]) == ("full",
                                                                                   False)
        assert product["hooks"] == list(PRODUCT_HOOKS)

        def served(**body: object) -> dict:
            """The first event of a server's agent run on the trained model."""
            run = httpx.post(f"{server.url}/v1/agent/runs", headers=alice, timeout=30, json={
                "task": "Say hello.", "path": str(roots / "ws"), "model": "trained",
                "stream": False, **body})
            assert run.status_code == 200, run.text
            return wait_end(server.url, run.json()["id"], alice, timeout=300)["transcript"][0]

        first = served()
        assert first["config"]["toolset"] == "core" and first["config"]["max_steps"] == 2
        assert first["hooks"] == []
        explicit = served(max_steps=1, setup="product", max_tokens=16)
        assert (explicit["config"]["toolset"], explicit["config"]["max_steps"]) == ("full", 1)
        bad = httpx.post(f"{server.url}/v1/agent/runs", headers=alice, json={
            "task": "Say hello.", "path": str(roots / "ws"), "model": "trained",
            "setup": "trained"})
        assert bad.status_code in (400, 422)
    finally:
        server.stop()
