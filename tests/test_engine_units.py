"""Streaming text assembly in the engine, without a model."""

from codeplane.models.engine import _StopDecoder


def test_utf8_split_across_tokens_is_not_mangled():
    decoder = _StopDecoder([])
    pieces = [b"caf", "é".encode()[:1], "é".encode()[1:], b" ", "日本".encode()[:4],
              "日本".encode()[4:]]
    shown = "".join(decoder.feed(p)[0] for p in pieces) + decoder.flush()
    assert shown == decoder.text == "café 日本"


def test_stop_string_spanning_pieces_is_withheld_and_cut():
    decoder = _StopDecoder(["\n\n"])
    deltas = [decoder.feed(p) for p in (b"return x", b"\n", b"\nprint(1)")]
    assert "".join(d for d, _ in deltas) == "return x"
    assert deltas[-1][1] is True and decoder.text == "return x"
