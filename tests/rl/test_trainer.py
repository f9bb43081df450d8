"""The trainer on real code-small rollouts: determinism, resuming, filtering, direction."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from conftest import make_settings
from pydantic import ValidationError

from codeplane.rl.trainer import PolicyTrainer, TrainerConfig, rows_of
from codeplane.rl.types import Episode, Sample

pytestmark = pytest.mark.model

CONFIG = TrainerConfig(lr=1e-3, lora_rank=4, lora_alpha=8.0, micro_batch=2, seed=11)
# bfloat16 against float32 on the fixture's samples (docs/rl.md, "The trainer in bfloat16":
# measured 0.025 nats mean |log-prob difference| per token, gradient cosine 0.999)
BF16_MEAN = 0.05
BF16_GRAD_COSINE = 0.99
MISMATCH = {"float32": 1e-3, "bfloat16": BF16_MEAN}
PROMPTS = ["Name one prime number.", "Write a Python keyword.", "Say a colour."]
REPLIES = [["Seven is prime.", "Nine."], ["lambda", "print it"], ["Blue.", "Red."]]


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    return make_settings(tmp_path_factory.mktemp("rl") / "home")


@pytest.fixture(scope="module")
def rollouts(settings) -> list[list[Episode]]:
    """Three groups of two episodes whose replies are scored by the initial policy, as its
    own sampler would have reported them (version 0); rewards 1/0, 0/1 and 1/1 (the last has
    zero variance). Real token ids of the chat template, without paying for decoding."""
    policy = PolicyTrainer(CONFIG, settings).policy
    stop = policy.tokenizer.eos_token_id
    pairs = [(policy.prompt_ids([{"role": "user", "content": prompt}], []),
              [*policy.tokenizer(reply)["input_ids"], stop])
             for prompt, replies in zip(PROMPTS, REPLIES, strict=True) for reply in replies]
    with torch.no_grad():  # all six in one padded forward, as the trainer scores them
        scored = policy.completion_logprobs(pairs)
    samples = iter(Sample(ids, completion, logprobs.tolist(), 0)
                   for (ids, completion), logprobs in zip(pairs, scored, strict=True))
    return [[Episode(f"t{g}", f"g{g}", [next(samples)], float(reward), steps=1)
             for reward in rewards]
            for g, rewards in enumerate(([1, 0], [0, 1], [1, 1]))]


def batch(rollouts, *indices):
    return [rollouts[i] for i in indices]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_is_deterministic_and_moves_logprobs_with_the_advantage(settings, rollouts,
                                                                       dtype):
    config = CONFIG.model_copy(update={"dtype": dtype})
    first, second = PolicyTrainer(config, settings), PolicyTrainer(config, settings)
    rewarded = rollouts[0][0].samples[0]
    pair = [(rewarded.prompt_ids, rewarded.completion_ids)]
    before = sum(rewarded.logprobs)  # scored by the same initial policy (the fixture)
    a, b = first.step(batch(rollouts, 0, 1, 2)), second.step(batch(rollouts, 0, 1, 2))
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert all(torch.equal(x, y) for x, y in zip(first.weights().values(),
                                                 second.weights().values(), strict=True))
    assert a["groups_kept"] == 2 and a["episodes"] == 4 and first.version == 1
    assert a["tokens"] == sum(len(e.samples[0].completion_ids) for e in
                              rollouts[0] + rollouts[1])
    # sampled by the same weights in float32 torch: no mismatch beyond bfloat16's own
    assert a["mismatch_abs_mean"] < MISMATCH[dtype] and a["tis_truncated"] == 0
    with torch.no_grad():
        after = first.policy.completion_logprobs(pair)[0].sum()
    assert after > before  # the rewarded episode became more likely


def test_bfloat16_scores_and_learns_like_float32(settings, rollouts):
    """The frozen base in bfloat16, the LoRA (and so AdamW's state) float32: the log-probs of
    real samples stay within bfloat16's measured error of float32's, and one imitation step
    on them takes a gradient pointing the same way (docs/rl.md, "The trainer in bfloat16")."""
    samples = [e.samples[0] for group in rollouts for e in group]
    grads, logprobs = {}, {}
    for dtype in ("float32", "bfloat16"):
        trainer = PolicyTrainer(CONFIG.model_copy(update={"dtype": dtype}), settings)
        with torch.no_grad():
            logprobs[dtype] = torch.cat(trainer.policy.completion_logprobs(
                [(s.prompt_ids, s.completion_ids) for s in samples]))
        trainer.imitate(samples)
        lora = [p for p in trainer.policy.model.parameters() if p.requires_grad]
        assert {p.dtype for p in lora} == {torch.float32}
        grads[dtype] = torch.cat([p.grad.flatten() for p in lora if p.grad is not None])
    layer = trainer.policy.model.get_base_model().model.layers[0].mlp.up_proj
    assert layer.weight.dtype == torch.bfloat16
    assert (logprobs["bfloat16"] - logprobs["float32"]).abs().mean() < BF16_MEAN
    assert torch.nn.functional.cosine_similarity(grads["float32"], grads["bfloat16"],
                                                 dim=0) > BF16_GRAD_COSINE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resuming_from_a_checkpoint_gives_the_same_next_loss(settings, rollouts,
                                                             tmp_path: Path, dtype):
    config = CONFIG.model_copy(update={"dtype": dtype})
    trainer = PolicyTrainer(config, settings)
    trainer.step(batch(rollouts, 0))
    trainer.step(batch(rollouts, 1))
    trainer.save(str(tmp_path / "ckpt"))
    expected = trainer.step(batch(rollouts, 1))  # one group: the checkpoint is under test
    del trainer
    # another seed: its fresh adapter differs, so only the checkpoint can make them agree
    resumed = PolicyTrainer(config.model_copy(update={"seed": 99}), settings)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.version == 2
    got = resumed.step(batch(rollouts, 1))
    assert got["loss"] == expected["loss"] and got["grad_norm"] == expected["grad_norm"]


def test_starting_from_another_runs_policy_takes_its_weights_not_its_optimiser(
        settings, rollouts, tmp_path: Path):
    """`init`: RL after another run's warm start. The LoRA and version come over; the
    optimiser and RNGs stay this trainer's, so two seeds started from one checkpoint differ."""
    warm = PolicyTrainer(CONFIG, settings)
    warm.step(batch(rollouts, 0))
    warm.save(str(tmp_path / "warm"))
    fresh = PolicyTrainer(CONFIG.model_copy(update={"seed": 99}), settings)
    assert not all(torch.equal(x, y) for x, y in zip(
        warm.weights().values(), fresh.weights().values(), strict=True))
    fresh.start_from(str(tmp_path / "warm"))
    assert fresh.version == 1 and fresh.optimizer.state_dict()["state"] == {}
    assert all(torch.equal(x, y) for x, y in zip(warm.weights().values(),
                                                 fresh.weights().values(), strict=True))
    with pytest.raises(FileNotFoundError):
        fresh.start_from(str(tmp_path / "nowhere"))


def test_starting_with_the_init_runs_optimiser_state_is_not_a_sign_step(
        settings, rollouts, tmp_path: Path):
    """`init_optimizer`: a fresh AdamW's first update moves every weight by lr (lr x the
    gradient's sign, whatever its size); with the init run's moments carried over, the
    update follows the gradients' size, at this run's learning rate."""
    warm = PolicyTrainer(CONFIG, settings)
    warm.step(batch(rollouts, 0))
    warm.step(batch(rollouts, 1))
    warm.save(str(tmp_path / "warm"))
    lr = CONFIG.lr / 10

    def first_update(optimizer: bool) -> torch.Tensor:
        """|delta w| of every LoRA weight in one step after `start_from`, over lr."""
        trainer = PolicyTrainer(CONFIG.model_copy(update={"lr": lr, "seed": 99}), settings)
        trainer.start_from(str(tmp_path / "warm"), optimizer)
        assert all(g["lr"] == lr for g in trainer.optimizer.param_groups)
        before = {k: v.clone() for k, v in trainer.weights().items()}
        trainer.step(batch(rollouts, 0))
        return torch.cat([(trainer.weights()[k] - v).abs().flatten() / lr
                          for k, v in before.items()])

    fresh, carried = first_update(False), first_update(True)
    assert ((fresh - 1).abs() < 0.05).float().mean() > 0.99  # a sign step
    assert ((carried - 1).abs() < 0.05).float().mean() < 0.1
    assert carried.max() < 5  # a step of about lr's size, not the init run's


def test_a_run_started_from_another_runs_policy_keeps_its_kl_to_that_policy(
        settings, rollouts, tmp_path: Path):
    """`init` with `kl_beta`: the KL term's reference is the policy the run started from,
    so at the first step the policy equals its reference (KL ~0), not the warm start's
    distance from the base model; a resumed run keeps that reference."""
    warm = PolicyTrainer(CONFIG, settings)
    # a warm start far from the base: every LoRA tensor random (B starts at zero otherwise)
    generator = torch.Generator().manual_seed(5)
    warm.policy.load_lora_state({k: torch.randn(v.shape, generator=generator) * 0.05
                                 for k, v in warm.weights().items()})
    warm.save(str(tmp_path / "warm"))
    kl_config = CONFIG.model_copy(update={"kl_beta": 0.1, "lr": 1e-9})
    from_base = PolicyTrainer(kl_config, settings)  # the same policy, the base as reference
    from_base.policy.load_lora_state(warm.weights())
    assert from_base.step(batch(rollouts, 0))["kl"] > 1e-3
    started = PolicyTrainer(kl_config, settings)
    started.start_from(str(tmp_path / "warm"))
    assert started.step(batch(rollouts, 0))["kl"] < 1e-6
    started.save(str(tmp_path / "run"))
    resumed = PolicyTrainer(kl_config, settings)
    resumed.load(str(tmp_path / "run"))
    assert resumed.step(batch(rollouts, 0))["kl"] < 1e-6
    assert all(torch.equal(x, y) for x, y in zip(  # the reference is not what is trained
        warm.weights().values(), resumed.policy.reference_state().values(), strict=True))


def test_nothing_to_learn_from_is_no_step(settings, rollouts):
    trainer = PolicyTrainer(CONFIG, settings)
    weights = trainer.weights()
    faulted = [Episode(e.task_id, e.group_id, e.samples, e.reward, fault="sandbox_killed")
               for e in rollouts[0]]
    asked = trainer.nothing_to_learn([rollouts[2], faulted])  # what the run asks first
    metrics = trainer.step([rollouts[2], faulted])
    assert metrics["skipped"] == 1 and metrics["faulted"] == 2 and trainer.version == 0
    assert asked == metrics
    assert trainer.nothing_to_learn(batch(rollouts, 0, 2)) is None
    assert all(torch.equal(weights[k], v) for k, v in trainer.weights().items())


def test_checkpoint_of_another_shape_is_refused(settings, tmp_path: Path):
    trainer = PolicyTrainer(CONFIG, settings)
    trainer.save(str(tmp_path / "ckpt"))
    other = PolicyTrainer(CONFIG.model_copy(update={"lora_rank": 2}), settings)
    with pytest.raises(ValueError, match="policy shape"):
        other.load(str(tmp_path / "ckpt"))


def test_config_rejects_nonsense():
    with pytest.raises(ValidationError):
        TrainerConfig(lr=-1)
    with pytest.raises(ValidationError):
        TrainerConfig(algorithm="ppo")


def test_warm_start_imitates_the_solvers_solved_episodes(settings, tmp_path: Path):
    """The grep solver solves "grep"-instruction tasks through a real sandbox and the
    product's grep; its turns carry the token ids of the policy's chat template, and one
    imitation step makes exactly those tokens more likely."""
    import re
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import make_repo

    from codeplane.rl.envserver import EnvServer
    from codeplane.rl.rollout import RolloutConfig, play
    from codeplane.rl.tasks import locate_tasks
    from codeplane.rl.warmstart import GrepSolver, demonstrations

    trainer = PolicyTrainer(CONFIG, settings)
    tasks = locate_tasks("shapes", make_repo(tmp_path / "shapes"), instruction="grep")
    env = EnvServer(scratch=str(tmp_path))
    config = RolloutConfig(max_turns=2, answer_turn=True, temperature=0.0, toolset="core")
    episodes = [play(GrepSolver(trainer.policy), env, t, "g", config) for t in tasks]
    env.close()
    assert [e.reward for e in episodes] == [1.0] * len(tasks)
    call, answer = demonstrations(episodes)[0]
    assert trainer.policy.decode(call.completion_ids).startswith('<tool_call>\n{"name": "grep"')
    assert re.fullmatch(r"pkg/shapes\.py:\d+<\|im_end\|>",
                        trainer.policy.decode(answer.completion_ids))
    # one sample: its prompt is the product's (~1,200 tokens), and fp32 on CPU is slow
    pairs = [(call.prompt_ids, call.completion_ids)]
    with torch.no_grad():
        before = sum(lp.sum() for lp in trainer.policy.completion_logprobs(pairs))
    metrics = trainer.imitate([call], lr=1e-3)
    with torch.no_grad():
        after = sum(lp.sum() for lp in trainer.policy.completion_logprobs(pairs))
    assert after > before and trainer.version == 1 and metrics["nll"] > 0


def test_an_episodes_turns_scored_as_one_row_match_each_turn_scored_alone(settings):
    """Turn two's prompt extends turn one (prompt, completion, then a tool result): the trainer
    scores both in one forward over turn two and must get what two forwards give."""
    policy = PolicyTrainer(CONFIG, settings).policy
    stop = policy.tokenizer.eos_token_id
    first = policy.prompt_ids([{"role": "user", "content": "Name one prime number."}], [])
    reply = [*policy.tokenizer("Seven.")["input_ids"], stop]
    result = policy.tokenizer("\n<|im_start|>user\nAnother one?<|im_end|>\n"
                              "<|im_start|>assistant\n")["input_ids"]
    second = [*first, *reply, *result]
    answer = [*policy.tokenizer("Eleven.")["input_ids"], stop]
    samples = [Sample(first, reply, [0.0] * len(reply), 0),
               Sample(second, answer, [0.0] * len(answer), 0),
               Sample(first, answer, [0.0] * len(answer), 0)]  # another episode: its own row
    rows = rows_of(samples)
    assert [len(r.spans) for r in rows] == [2, 1]
    with torch.no_grad():
        together = [lp for spans in policy.row_logprobs(rows) for lp in spans]
        alone = policy.completion_logprobs([(s.prompt_ids, s.completion_ids) for s in samples])
    for a, b in zip(together, alone, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-4)
