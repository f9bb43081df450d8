"""The policy in torch: a registry model's GGUF weights, dequantized, with a LoRA adapter.

Why a torch copy of a llama.cpp model: training needs gradients, which llama.cpp has not.
transformers reads the GGUF directly (`gguf_file=`), but dequantizing it and building its
tokenizer is slow on a CPU; the first load therefore writes a safetensors copy next to the GGUF
(`<models>/torch/<stem>/`), which later loads read instead (docs/rl.md, "The policy", has both
times). The copy is derived data: delete it and the next load rebuilds it.

`TorchSampler` is a `Sampler` over a `Policy`: it renders prompts with the same chat template
and tool format as the llama.cpp engine (`models.engine.render_chat_template`) and parses
replies with the product's tool-call parser, so a rollout sees what the product would show.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from codeplane.config import Settings
from codeplane.core.chat import Cancelled, Sampling, Turn
from codeplane.models.engine import (
    EXTRA_STOP_TOKENS,
    compile_chat_template,
    render_chat_template,
)
from codeplane.models.pull import ensure_weights
from codeplane.models.registry import ModelRegistry
from codeplane.models.toolcalls import assistant_turn
from codeplane.rl.algorithms import token_logprobs

# Attention projections: what the LoRA adapts, and what llama.cpp's GGUF adapters can carry
# for this architecture (see rl/adapter.py for the name mapping).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
REFERENCE = "reference"  # the frozen LoRA of the KL term's reference policy (`set_reference`)
# what `TrainerConfig.dtype` names: the precision of the frozen decoder layers (`Policy`)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Row:
    """One sequence of a forward pass and the spans of it that are scored, as (start,
    length): each span's tokens are scored given everything before them."""

    ids: list[int]
    spans: list[tuple[int, int]]


@dataclass(frozen=True)
class LoraShape:
    rank: int = 16
    alpha: float = 32.0


def model_weights(name: str, settings: Settings) -> Path:
    """The GGUF of a registry model (the same file the llama.cpp engine serves)."""
    return ensure_weights(ModelRegistry(settings).get(name), settings)


def torch_weights(gguf: Path) -> Path:
    """The safetensors copy of `gguf` (built on first use; atomic, so a killed conversion
    leaves nothing half-written)."""
    target = gguf.parent / "torch" / gguf.stem
    if (target / "model.safetensors").is_file():
        return target
    from safetensors.torch import save_file

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{gguf.stem}-"))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide the copy from other local users
    try:
        # save_pretrained refuses a GGUF-loaded model (it counts as quantized), so the
        # dequantized tensors and a plain config are written directly.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX): without it torch
    emulates bfloat16, slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str) -> torch.dtype:
    """`float32`, `bfloat16`, or `auto`: bfloat16 where the CPU has it natively."""
    if name == "auto":
        return torch.bfloat16 if native_bf16() else torch.float32
    return DTYPES[name]


def lower_precision(base: torch.nn.Module, dtype: torch.dtype) -> None:
    """The decoder layers (nearly all the multiply-adds) in `dtype`; the embedding table, the
    rotary frequencies, the final norm and the vocabulary projection stay float32, so the
    logits are float32 (docs/rl.md, "The trainer in bfloat16": the error per log-prob)."""
    decoder = base.get_decoder()
    decoder.layers.to(dtype)
    decoder.embed_tokens.register_forward_hook(lambda _, args, out: out.to(dtype))
    base.get_output_embeddings().register_forward_pre_hook(
        lambda _, args: (args[0].float(), *args[1:]))


class Policy:
    """A causal LM with a LoRA adapter on its attention projections. The base weights are
    frozen. The reference policy for the KL term is the same model with the adapter disabled
    (no second copy in memory), or, once `set_reference` gave it one, with a frozen second
    LoRA: a run that starts from another run's policy stays close to that policy, not to the
    base model it left behind.

    `dtype`: the frozen decoder layers' precision (`lower_precision`); the LoRA weights, and
    so their gradients and the optimiser's state, are float32 in every case."""

    def __init__(self, gguf: Path, lora: LoraShape, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        directory = torch_weights(gguf)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(directory)
        base = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        if dtype != torch.float32:
            lower_precision(base, dtype)
        torch.manual_seed(seed)  # the LoRA A matrices start random: same seed, same policy
        config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,
                            target_modules=list(LORA_TARGETS), bias="none")
        self.model: PeftModel = get_peft_model(base, config)
        self.lora = lora
        source = self.tokenizer.chat_template
        if not source:
            raise ValueError(f"{gguf.name} has no chat template")
        self._source = str(source)
        self._template = compile_chat_template(self._source)
        self.stop_ids = self._stop_ids()

    def _stop_ids(self) -> set[int]:
        """End-of-turn tokens: the tokenizer's EOS plus the texts the engine also stops on."""
        vocab = self.tokenizer.get_vocab()
        ids = {vocab[t] for t in EXTRA_STOP_TOKENS if t in vocab}
        eos = self.tokenizer.eos_token_id
        return ids | ({eos} if isinstance(eos, int) else set())

    # -- prompts -------------------------------------------------------------------------

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """Token ids of the chat prompt, rendered exactly as the llama.cpp engine renders it."""
        text = render_chat_template(
            self._template, self._source, messages, tools,
            bos_token=self.tokenizer.bos_token or "", eos_token=self.tokenizer.eos_token or "")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- weights -------------------------------------------------------------------------

    def lora_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors (a copy: later training must not change what was shipped)."""
        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def load_lora_state(self, state: dict[str, torch.Tensor],
                        adapter: str = "default") -> None:
        result = set_peft_model_state_dict(self.model, state, adapter_name=adapter)
        if result.unexpected_keys:
            raise ValueError(f"LoRA state has unknown tensors: {result.unexpected_keys[:3]}")

    def set_reference(self, state: dict[str, torch.Tensor]) -> None:
        """Score the KL term's reference with this LoRA state (a copy, frozen) instead of the
        bare base model. A second rank-r LoRA costs a few MB; merging it into the base
        weights instead would leave the trained adapter meaningless without it, and the
        samplers and `codeplane model` serve one adapter on the registry's base."""
        if REFERENCE not in self.model.peft_config:
            config = LoraConfig(r=self.lora.rank, lora_alpha=self.lora.alpha, lora_dropout=0.0,
                                target_modules=list(LORA_TARGETS), bias="none",
                                inference_mode=True)  # frozen: never in the optimiser
            self.model.add_adapter(REFERENCE, config)
        self.load_lora_state(state, REFERENCE)

    def reference_state(self) -> dict[str, torch.Tensor] | None:
        """The reference LoRA `set_reference` holds (a copy), None when the reference is the
        base model."""
        if REFERENCE not in self.model.peft_config:
            return None
        state = get_peft_model_state_dict(self.model, adapter_name=REFERENCE)
        return {k: v.detach().clone() for k, v in state.items()}

    # -- scoring -------------------------------------------------------------------------

    def completion_logprobs(self, pairs: list[tuple[list[int], list[int]]],
                            temperature: float = 1.0, reference: bool = False
                            ) -> list[torch.Tensor]:
        """Log-prob of each completion token given its prompt, one tensor per (prompt,
        completion) pair, in one padded forward pass. Gradients flow unless called under
        no_grad; `reference=True` scores with the reference policy (`set_reference`)."""
        rows = [Row(prompt + completion, [(len(prompt), len(completion))])
                for prompt, completion in pairs]
        return [spans[0] for spans in self.row_logprobs(rows, temperature, reference)]

    def row_logprobs(self, rows: list[Row], temperature: float = 1.0,
                     reference: bool = False) -> list[list[torch.Tensor]]:
        """Log-probs of each row's scored spans, one padded forward pass for all rows.

        Left padding aligns every sequence's end; the vocabulary projection (the largest
        tensor here: 152k logits per position) is computed only at the positions that predict
        a scored token."""
        width = max(len(r.ids) for r in rows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for n, row in enumerate(rows):
            ids[n, width - len(row.ids):] = torch.tensor(row.ids)
            mask[n, width - len(row.ids):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # the position before each scored token predicts it; one set for the whole batch
        wanted = sorted({width - len(row.ids) + start - 1 + i for row in rows
                         for start, length in row.spans for i in range(length)})
        keep = torch.tensor(wanted, dtype=torch.long)
        if not reference:
            logits = self._logits(ids, mask, positions, keep)
        elif REFERENCE in self.model.peft_config:
            # peft takes per-row adapters in eval mode only; nothing here depends on the
            # mode (no dropout), and the reference is never trained
            training = self.model.training
            self.model.eval()
            try:
                logits = self._logits(ids, mask, positions, keep, [REFERENCE] * len(rows))
            finally:
                self.model.train(training)
        else:
            with self.model.disable_adapter():
                logits = self._logits(ids, mask, positions, keep)
        column = {p: c for c, p in enumerate(wanted)}
        out = []
        for n, row in enumerate(rows):
            offset = width - len(row.ids)
            spans = []
            for start, length in row.spans:
                at = column[offset + start - 1]
                spans.append(token_logprobs(logits[n, at:at + length],
                                            torch.tensor(row.ids[start:start + length]),
                                            temperature))
            out.append(spans)
        return out

    def _logits(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                keep: torch.Tensor, adapters: list[str] | None = None) -> torch.Tensor:
        """`adapters`: the LoRA each row runs with (peft's per-row adapter names; without
        them the trained one)."""
        extra = {"adapter_names": adapters} if adapters else {}
        return self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                          logits_to_keep=keep, use_cache=False, **extra).logits


class InProcessSampler:
    """What the two samplers that run the policy in this process (`TorchSampler`,
    `adapter.LlamaSampler`) share: how a transcript names them, and how a sampled reply
    becomes the `Turn` the agent reads and the trainer scores."""

    kind: ClassVar[str]
    name: str
    version: int

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "policy_version": self.version}

    def close(self) -> None:
        """Nothing to release: the engine belongs to the caller, a `Policy` goes with the
        sampler."""

    @staticmethod
    def _turn(text: str, tools: list[dict], finish: str, prompt: list[int], ids: list[int],
              logprobs: list[float], version: int) -> Turn:
        """The reply's tool calls parsed as the product parses them, with the exact prompt
        and sampled ids, their logprobs and the policy version that sampled them."""
        message, reason = assistant_turn(text, tools, finish)
        return Turn(message, reason,
                    {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                     "total_tokens": len(prompt) + len(ids)},
                    logprobs, prompt, ids, version)


class TorchSampler(InProcessSampler):
    """`rl.types.Sampler` over a torch `Policy`: exact token ids and logprobs under the very
    numerics the trainer uses (so its only mismatch is staleness)."""

    kind = "torch"

    def __init__(self, policy: Policy, name: str = "torch-policy", seed: int = 0) -> None:
        self.policy = policy
        self.name = name
        self.version = 0
        self._generator = torch.Generator().manual_seed(seed)
        self._lock = threading.Lock()  # one generation at a time: the model is shared

    def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        with self._lock:
            self.policy.load_lora_state(weights)
            self.version = version

    def complete(self, messages: list[dict], tools: list[dict], sampling: Sampling,
                 cancel: threading.Event | None = None) -> Turn:
        shown = sampling.shown(tools)
        with self._lock:
            prompt = self.policy.prompt_ids(messages, shown)
            ids, logprobs, finish = self._sample(prompt, sampling, cancel)
            version = self.version
        text_ids = ids[:-1] if finish == "stop" else ids
        return self._turn(self.policy.decode(text_ids), shown, finish, prompt, ids, logprobs,
                          version)

    @torch.inference_mode()
    def _sample(self, prompt: list[int], sampling: Sampling, cancel: threading.Event | None
                ) -> tuple[list[int], list[float], str]:
        """Token-by-token decoding with the KV cache; the stop token is kept in the ids (the
        policy must learn to stop) but not in the text."""
        model = self.policy.model
        out = model(input_ids=torch.tensor([prompt]), use_cache=True, logits_to_keep=1)
        ids: list[int] = []
        logprobs: list[float] = []
        temperature = sampling.temperature if sampling.temperature > 0 else 1.0
        while len(ids) < sampling.max_tokens:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            logp = torch.log_softmax(out.logits[0, -1].float() / temperature, dim=-1)
            if sampling.temperature > 0:
                token = int(torch.multinomial(logp.exp(), 1, generator=self._generator))
            else:
                token = int(logp.argmax())
            ids.append(token)
            logprobs.append(float(logp[token]))
            if token in self.policy.stop_ids:
                return ids, logprobs, "stop"
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                        use_cache=True, logits_to_keep=1)
        return ids, logprobs, "length"
