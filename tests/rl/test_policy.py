"""The torch policy and both samplers with the real code-small weights (small max_tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from conftest import make_settings

from codeplane.core.chat import Sampling
from codeplane.models.engine import Engine
from codeplane.models.lora import AdapterError, write_gguf_adapter
from codeplane.rl.adapter import LlamaSampler
from codeplane.rl.policy import LoraShape, Policy, TorchSampler, model_weights

pytestmark = pytest.mark.model

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the workspace",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]
ASK = [{"role": "system", "content": "You are a coding agent. Use the tools."},
       {"role": "user", "content": "Show me what is in setup.py."}]
LORA = LoraShape(rank=8, alpha=16.0)


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    return make_settings(tmp_path_factory.mktemp("rl") / "home")


@pytest.fixture(scope="module")
def policy(settings):
    return Policy(model_weights("code-small", settings), LORA, seed=0)


@pytest.fixture(scope="module")
def engine(settings):
    """Our own engine: adapters swapped in here must not leak into other tests' model."""
    eng = Engine(settings)
    yield eng
    eng.close()


def perturbed(policy: Policy, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A LoRA state whose B matrices are non-zero (a fresh adapter is the identity)."""
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(v.shape, generator=gen) * scale if "lora_B" in k else v)
            for k, v in policy.lora_state().items()}


def test_prompts_match_the_engines_tokens_with_tools(policy, engine):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "read_file", "arguments": '{"path": "setup.py"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "from setuptools import setup"}]
    ids = policy.prompt_ids(history, TOOLS)
    assert ids == engine.run_sync("code-small", "chat_tokens", history, TOOLS)
    assert "<tools>" in policy.decode(ids) and "read_file" in policy.decode(ids)


def test_torch_sampler_returns_the_policys_own_tokens_and_logprobs(policy):
    sampler = TorchSampler(policy, seed=3)
    turn = sampler.complete(ASK, TOOLS, Sampling(max_tokens=8, temperature=1.0))
    assert turn.prompt_ids == policy.prompt_ids(ASK, TOOLS)
    assert turn.policy_version == 0 and turn.message["role"] == "assistant"
    assert len(turn.token_ids) == len(turn.logprobs) == turn.usage["completion_tokens"] <= 8
    with torch.no_grad():
        rescored = policy.completion_logprobs([(turn.prompt_ids, turn.token_ids)])[0]
    assert rescored.tolist() == pytest.approx(turn.logprobs, abs=1e-3)


def test_greedy_tool_call_is_parsed_by_the_products_parser(policy):
    ask = [{"role": "user", "content": "Use read_file to read setup.py."}]
    turn = TorchSampler(policy).complete(ask, TOOLS, Sampling(max_tokens=48, temperature=0))
    assert turn.finish_reason == "tool_calls", turn.message
    call = turn.message["tool_calls"][0]["function"]
    assert call["name"] == "read_file" and "setup.py" in call["arguments"]
    assert turn.token_ids[-1] in policy.stop_ids  # the end-of-turn token is trained on too


def test_load_weights_changes_the_policy_and_stamps_the_version(policy):
    sampler = TorchSampler(policy, seed=1)
    before = sampler.complete(ASK, [], Sampling(max_tokens=6, temperature=1.0))
    base = policy.lora_state()
    sampler.load_weights(perturbed(policy, 0), version=7)
    try:
        after = sampler.complete(ASK, [], Sampling(max_tokens=6, temperature=1.0))
        assert after.policy_version == 7
        with torch.no_grad():
            pair = [(before.prompt_ids, before.token_ids)]
            new = policy.completion_logprobs(pair)[0]
            ref = policy.completion_logprobs(pair, reference=True)[0]
        assert (new - torch.tensor(before.logprobs)).abs().max() > 1e-2
        assert ref.tolist() == pytest.approx(before.logprobs, abs=1e-3)  # adapter off = base
    finally:
        policy.load_lora_state(base)


def test_gguf_adapter_swaps_into_llama_cpp_and_matches_torch(policy, engine, tmp_path: Path):
    state = perturbed(policy, 1)
    sampler = LlamaSampler(engine, "code-small", tmp_path / "adapters", LORA.alpha, seed=5)
    base_turn = sampler.complete(ASK, [], Sampling(max_tokens=12, temperature=1.0))
    scored = ("code-small", "score", base_turn.prompt_ids, base_turn.token_ids)
    base_score = engine.run_sync(*scored)
    sampler.load_weights(state, version=3)
    turn = sampler.complete(ASK, [], Sampling(max_tokens=12, temperature=1.0))
    assert turn.policy_version == 3 and len(turn.token_ids) == len(turn.logprobs)
    assert [p.name for p in (tmp_path / "adapters").iterdir()] == ["policy-v3.gguf"]
    pair = [(turn.prompt_ids, turn.token_ids)]
    policy.load_lora_state(state)
    try:
        with torch.no_grad():
            adapted = policy.completion_logprobs(pair)[0]
            reference = policy.completion_logprobs(pair, reference=True)[0]
    finally:
        policy.load_lora_state(perturbed(policy, 0, scale=0.0))
    sampled = torch.tensor(turn.logprobs)
    # llama.cpp applies the adapter: torch with the same adapter agrees far better than
    # torch without it (quantized vs fp32 numerics leave a small gap either way).
    with_gap = float((adapted - sampled).abs().mean())
    without_gap = float((reference - sampled).abs().mean())
    assert with_gap < 0.25 and with_gap < without_gap / 2, (with_gap, without_gap)
    assert engine.run_sync(*scored) != pytest.approx(base_score, abs=1e-3)  # adapter on
    # swapping the base back restores the base model's numbers exactly (scored the same way:
    # with llama.cpp's extra buffer types off, one-token decode and batched prefill round
    # differently, so sampled logprobs are compared to scores only loosely above)
    engine.run_sync("code-small", "set_lora", None)
    assert engine.run_sync(*scored) == pytest.approx(base_score, abs=1e-3)


def test_a_broken_adapter_is_refused(engine, tmp_path: Path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(AdapterError):
        engine.run_sync("code-small", "set_lora", bad)
    wrong = write_gguf_adapter(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 7),
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(7, 4)},
        tmp_path / "wrong.gguf", "qwen2", 8.0)
    with pytest.raises(AdapterError):
        engine.run_sync("code-small", "set_lora", wrong)


def test_required_tool_choice_is_a_grammar_constrained_call(engine, tmp_path: Path):
    """`[rollout] required_steps` (the agent's first turns): tool_choice "required" makes
    llama.cpp decode through the product's tool-call grammar, so a turn code-small answers
    in prose (arithmetic) becomes a parsed call of one of the tools."""
    sampler = LlamaSampler(engine, "code-small", tmp_path / "adapters", LORA.alpha, seed=5)
    ask = [{"role": "user", "content": "What is 2 + 2? Answer with the number only."}]
    free = sampler.complete(ask, TOOLS, Sampling(48, 0.0, "auto"))
    forced = sampler.complete(ask, TOOLS, Sampling(48, 0.0, "required"))
    assert not free.message.get("tool_calls")
    assert [c["function"]["name"] for c in forced.message["tool_calls"]] == ["read_file"]
    assert len(forced.logprobs) == len(forced.token_ids)
