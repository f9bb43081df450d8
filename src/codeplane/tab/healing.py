"""Token healing: let the model re-choose the token boundary at the cursor.

A prompt that ends inside a word (`typing.Opti|`) or inside indentation ends on a token the
model rarely saw there: BPE would have merged `Optional` or `"       " + " self"` differently
had it seen the whole line. So the last token of the typed text is backed off and the first
generated token(s) must re-emit its bytes: either a token that starts with them (` Optional`)
or a token that is a prefix of them, followed by more constrained tokens. This is what
llama.cpp's `--token-healing` and guidance do; llama-cpp-python has no such option, so it is
a logits processor here.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


class VocabIndex:
    """Token ids by their bytes: which tokens start with a text, which are a prefix of it.

    Built before the first Tab request after a start, so its build is kept to what Python
    does fast (docs/tab.md, "The first suggestion in a file"): one keyed sort, the blank
    runs of the tokens that can start with a blank, and exact pieces found by bisection."""

    def __init__(self, pieces: list[bytes]) -> None:
        order = sorted((i for i, p in enumerate(pieces) if p), key=pieces.__getitem__)
        self._sorted = [pieces[i] for i in order]
        self._ids = np.array(order, dtype=np.intc)
        # bytes of whitespace each token starts with: after a blank `rest` (indentation) a
        # token goes on with a blank iff its run is longer than `rest` - one vector compare
        # per generated token instead of decoding tens of thousands of ` x` tokens
        self._lead = np.array([_blank_run(p) if p[0] in _MAY_START_BLANK else 0
                               for p in self._sorted], dtype=np.intc)
        self._code_first = self._ids[self._lead == 0]
        self.size = len(pieces)

    def allowed(self, rest: bytes, code_next: bool = False) -> np.ndarray:
        """Ids that keep the output consistent with `rest` (bytes still to be re-emitted);
        with `code_next`, only those whose bytes after `rest` do not start with a blank (an
        empty `rest` then allows every token that starts with code)."""
        if not rest:
            return self._code_first
        lo, hi = self._range(rest)
        longer = self._ids[lo:hi]
        if code_next and not rest.strip():
            longer = longer[self._lead[lo:hi] <= len(rest)]
        elif code_next:  # code in `rest`: few tokens start with it
            longer = longer[[_blank_run(p[len(rest):]) == 0 for p in self._sorted[lo:hi]]
                            ] if hi > lo else longer
        shorter = [self._exact(rest[:k]) for k in range(1, len(rest))]
        return np.concatenate([longer, *shorter])

    def extends(self, text: bytes) -> bool:
        """Whether some token is `text` followed by more bytes (` retu` -> ` return`)."""
        at = bisect.bisect_right(self._sorted, text)
        return at < len(self._sorted) and self._sorted[at].startswith(text)

    def _range(self, text: bytes) -> tuple[int, int]:
        """Where the tokens that start with `text` lie in sorted order."""
        lo = bisect.bisect_left(self._sorted, text)
        end = _successor(text)
        return lo, bisect.bisect_left(self._sorted, end, lo) if end else len(self._sorted)

    def _exact(self, piece: bytes) -> np.ndarray:
        """Ids of the tokens whose bytes are `piece`."""
        lo = bisect.bisect_left(self._sorted, piece)
        return self._ids[lo:bisect.bisect_right(self._sorted, piece, lo)]


# first bytes of a token that may start with a blank once decoded: ASCII whitespace (as
# str.isspace has it), and every byte outside ASCII (a no-break space, or a stray
# continuation byte that decoding drops)
_MAY_START_BLANK = frozenset([*(b for b in range(128) if chr(b).isspace()), *range(128, 256)])


def _blank_run(piece: bytes) -> int:
    """Bytes of the whitespace a token starts with - any, not only ASCII: held off spaces,
    the model reached for a no-break space."""
    text = piece.decode("utf-8", "ignore")
    return len(text[:len(text) - len(text.lstrip())].encode())


def _successor(text: bytes) -> bytes:
    """The smallest byte string greater than every string that starts with `text` (b"" if
    there is none): the end of `text`'s range in sorted order."""
    stripped = text.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b""


@dataclass
class Healing:
    """The prompt with its last typed token backed off, and the text that must come back."""

    tokens: list[int]
    text: str  # "" when nothing was backed off
    # The line so far is indentation: after `text` the output must go on with code, not
    # more blanks. Free, the model re-emitted the indentation as a longer run of spaces
    # than typed (`   except`) or as spaces only until the line ended (an empty answer).
    # The indentation is still backed off: kept whole and followed by code-first, the
    # model answered from a split it never saw (`.`, `_x`), further from the author's line
    # (docs/tab.md, "Accuracy: token healing").
    code_next: bool = False


def back_off(tokens: list[int], typed: list[int], piece: Callable[[int], bytes],
             extends: Callable[[bytes], bool]) -> Healing:
    """Drop the last token of `typed` (the tail of `tokens`), then - llama.cpp's dynamic
    healing - the one before it too, as long as what is dropped is still the start of a
    longer token: `retu` tokenizes as ` ret` + `u`, and backing off `u` alone leaves the
    model to finish a word from a split it never saw in training (Tab then got such cursors
    right far less often than the plain call: docs/tab.md, "Accuracy: token healing").
    `piece` gives a token's bytes, `extends(b)` whether some vocabulary token is `b` followed
    by more bytes."""
    if not typed:
        return Healing(tokens, "")
    dropped = 1
    while dropped < len(typed) and extends(b"".join(piece(t) for t in typed[-dropped - 1:])):
        dropped += 1
    text = b"".join(piece(t) for t in typed[-dropped:])
    try:
        healed = text.decode("utf-8")
    except UnicodeDecodeError:  # half of a multi-byte character: leave the prompt alone
        return Healing(tokens, "")
    return Healing(tokens[:-dropped], healed) if healed else Healing(tokens, "")


class HealingMask:
    """Logits processor: until `text` has been re-emitted, mask every inconsistent token;
    with `code_next`, also every token that would put a blank right after it."""

    def __init__(self, index: VocabIndex, pieces: list[bytes], text: str,
                 prompt_tokens: int, code_next: bool = False) -> None:
        self._index, self._pieces = index, pieces
        self._text = text.encode()
        self._prompt = prompt_tokens
        self._code_next = code_next

    def __call__(self, input_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        out = b"".join(self._pieces[int(t)] for t in input_ids[self._prompt:])
        if len(out) > len(self._text) or (len(out) == len(self._text)
                                          and not self._code_next):
            return scores  # healed: decode freely
        allowed = self._index.allowed(self._text[len(out):], self._code_next)
        masked = np.full_like(scores, -np.inf)
        allowed = allowed[allowed < scores.size]
        masked[allowed] = scores[allowed]
        return masked
