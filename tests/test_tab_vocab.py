"""Token healing's view of the real code-small vocabulary (`LocalModel.vocab_pieces`,
`tab/healing.py`'s `VocabIndex`): every token's bytes, long ones too, and an index that
answers as the plain definitions over the whole vocabulary do."""

from __future__ import annotations

from codeplane.tab.healing import VocabIndex, _blank_run

# a long run of dashes and a deep indentation are single tokens of more than 32 bytes
LONG = "#" + "-" * 64 + "\n" + " " * 40 + "return x\n"


def test_the_pieces_of_a_texts_tokens_spell_the_text(local_model) -> None:
    """Healing re-emits the bytes of the typed text's last tokens: a piece read short (every
    token over 32 bytes came back empty from llama-cpp-python's detokenize) healed the
    wrong text."""
    pieces = local_model.vocab_pieces()
    tokens = local_model.tokenize(LONG)
    assert max(len(pieces[t]) for t in tokens) > 32
    assert b"".join(pieces[t] for t in tokens) == LONG.encode()
    assert len(pieces) == local_model.llama.n_vocab()


def test_the_index_answers_as_the_definitions_over_the_whole_vocabulary(local_model) -> None:
    pieces = local_model.vocab_pieces()
    index = VocabIndex(pieces)
    ids = [i for i, p in enumerate(pieces) if p]
    for rest in (b"    ", b" ", b"Opti", b" retu", b"\n", b"-" * 40, b"self.", b"\xc2"):
        longer = {i for i in ids if pieces[i].startswith(rest)}
        shorter = {i for i in ids if len(pieces[i]) < len(rest) and rest.startswith(pieces[i])}
        assert set(index.allowed(rest).tolist()) == longer | shorter, rest
        assert index.extends(rest) == any(len(pieces[i]) > len(rest) for i in longer), rest
        blank_free = {i for i in longer if _blank_run(pieces[i][len(rest):]) == 0} \
            if rest.strip() else {i for i in longer if _blank_run(pieces[i]) <= len(rest)}
        assert set(index.allowed(rest, code_next=True).tolist()) == blank_free | shorter, rest
    code_first = {i for i in ids if _blank_run(pieces[i]) == 0}
    assert set(index.allowed(b"", code_next=True).tolist()) == code_first
