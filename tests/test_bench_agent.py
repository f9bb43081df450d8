"""bench/agent/run.py runs a model in the agent setup `codeplane agent` would give it: a
trained model in its recorded setup with `--setup model`, the product's with `--setup
product`, and what the command sets explicitly wins over either (no model needed: the
setup is resolved before any turn)."""

from __future__ import annotations

from conftest import bench_script

from codeplane.agent.hooks import PRODUCT_HOOKS

# As `codeplane model add --from-run` records a run's setup (product-warm's is this one).
RECORDED = {"max_steps": 4, "max_tokens": 192, "toolset": "core", "max_result_chars": 2000,
            "answer_turn": True, "required_steps": 1, "hooks": ["preread", "corrections"]}
RUN = bench_script("agent/run.py")


def ran(recorded: dict | None, choice: str, **chosen: object) -> dict:
    """The setup a row records for a run resolved from these inputs."""
    setup = RUN.agent_setup(recorded, choice, chosen)
    return RUN.record(setup.config, setup.hooks)


def test_a_trained_model_runs_in_its_recorded_setup() -> None:
    """Its own turns and tokens, not the suite's limits (4 turns of 192 tokens, not 12 of
    512), its toolset, output limit, answer turn and hooks."""
    assert ran(RECORDED, "model", max_steps=None) == RECORDED


def test_the_product_setup_ignores_the_recorded_one() -> None:
    """`--setup product`, and `--setup model` on a model trained nowhere: the product's
    defaults within the suite's limits."""
    product = {"max_steps": 12, "max_tokens": 512, "toolset": "full",
               "max_result_chars": 6000, "answer_turn": False, "required_steps": 1,
               "hooks": list(PRODUCT_HOOKS)}
    assert ran(RECORDED, "product", max_steps=None) == product
    assert ran(None, "model", max_steps=None) == product


def test_explicit_options_win_over_either_setup() -> None:
    """`--max-steps` and `--config` fields override the recorded setup and the suite's
    limits alike; what they leave unset keeps the setup's value."""
    mine = ran(RECORDED, "model", max_steps=2, toolset="full", max_tokens=None)
    assert (mine["max_steps"], mine["toolset"], mine["max_tokens"]) == (2, "full", 192)
    assert mine["answer_turn"] is True and mine["hooks"] == RECORDED["hooks"]
    product = ran(RECORDED, "product", max_steps=6, max_tokens=64)
    assert (product["max_steps"], product["max_tokens"], product["toolset"]) == (6, 64, "full")
