"""Tests for splitspec.text.textstream: UTF-8-safe incremental detokenization with stop handling."""

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitspec.text.textstream import StreamDelta, TextStream
from splitspec.text.tokenizer import Tokenizer, byte_level_vocab, write_gguf_tokenizer

CORPUS = (
    "Streaming text: the answer is 42. </answer> def f(x):\n    return x * 2\n"
    "中文流式输出测试，你好世界。日本語も。😀👍🏽👨‍👩‍👧‍👦 🇩🇪 e\u0301 café\r\n"
) * 3
EMOJI_CJK = "😀 中文 👨‍👩‍👧‍👦 𝄞 ü e\u0301 🇩🇪 日本語"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A tiny Qwen-style tokenizer whose merges cut multi-byte characters into several tokens."""
    vocab = byte_level_vocab(CORPUS, num_merges=200)
    path = tmp_path_factory.mktemp("gguf") / "stream.gguf"
    writer = gguf.GGUFWriter(path, "qwen3")
    write_gguf_tokenizer(writer, vocab)
    writer.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Tokenizer.load(path)


def eos(tok):
    return tok.eos_token_ids[0]


def run(stream, chunks):
    """Push ``chunks`` until the stream finishes (flushing otherwise); the deltas."""
    deltas = []
    for chunk in chunks:
        deltas.append(stream.push(chunk))
        if deltas[-1].finished:
            return deltas
    deltas.append(stream.flush())
    return deltas


def byte_ids(text):
    """Ids of ``text`` one byte per token (the vocabulary's ids 0..255 are the bytes)."""
    return list(text.encode("utf-8"))


def test_multibyte_characters_split_across_tokens_come_out_whole(tok):
    ids = byte_ids(EMOJI_CJK * 3)
    stream = TextStream(tok)
    deltas = run(stream, [[i] for i in ids])
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == EMOJI_CJK * 3
    # A 4-byte emoji pushed byte by byte appears only with its last byte.
    assert [d.text for d in deltas[:4]] == ["", "", "", "😀"]
    assert stream.num_tokens == len(ids)


def test_merged_tokens_that_cut_characters(tok):
    text = "世界，好你。本日文中 😀👨 " + CORPUS  # the corpus' characters in orders its merges did not see
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens do cut characters
    deltas = run(TextStream(tok), [[i] for i in ids])
    assert all("\ufffd" not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == text


def test_stop_string_spanning_pushes(tok):
    ids = byte_ids("Hello, world! STOP and more")
    stream = TextStream(tok, stop_strings=["STOP"])
    first = stream.push(ids[:16])  # "Hello, world! ST"
    # "S" and "T" may start the stop string: their text is held back, and so are they.
    assert first == StreamDelta("Hello, world! ", ids[:14], False, None)
    second = stream.push(ids[16:])
    assert second == StreamDelta("", [], True, "stop_string")  # "O", "P" complete the stop; no token of it is reported
    assert stream.num_tokens == 18 and stream.num_reported == 14
    with pytest.raises(RuntimeError):
        stream.push([ord("x")])


def test_stop_string_prefix_is_held_then_released(tok):
    stream = TextStream(tok, stop_strings=["</answer>"])
    assert stream.push(byte_ids("a </ans")) == StreamDelta("a ", byte_ids("a "), False, None)
    assert stream.push(byte_ids("x")) == StreamDelta("</ansx", byte_ids("</ansx"), False, None)
    assert stream.push(byte_ids("er <")) == StreamDelta("er ", byte_ids("er "), False, None)
    assert stream.push(byte_ids("/answer> tail")) == StreamDelta("", [], True, "stop_string")
    assert stream.num_reported == len("a </ansxer ")


def test_stop_string_within_one_token_and_first_match_wins(tok):
    stream = TextStream(tok, stop_strings=["world", "lo, w"])
    delta = stream.push(tok.encode("Hello, world") + tok.encode(" ignored"))
    assert delta.finished and delta.text == "Hel"
    # The tokens of the text sent: the last one holds "l" and runs on into the stop string "lo, w".
    assert tok.decode(delta.token_ids).startswith("Hel") and len(tok.decode(delta.token_ids[:-1])) < len("Hel")


def test_tokens_of_invalid_bytes_before_a_stop_string(tok):
    """Bytes that never make a character come out as U+FFFD; the token after them starts after
    that character, so a stop string starting there leaves every byte token reported."""
    ids = [0xEB, 0xA9, 0xEF, 0xE6, 0xB0, ord("W"), ord("x")]  # "\ufffd\ufffd\ufffd" then "W"
    stream = TextStream(tok, stop_strings=["W"])
    deltas = run(stream, [[i] for i in ids])
    assert "".join(d.text for d in deltas) == "\ufffd" * 3
    assert [i for d in deltas for i in d.token_ids] == ids[:5] and deltas[-1].stop_reason == "stop_string"
    # An emoji cut short by a stop string right after it: all of its bytes are its tokens.
    emoji = byte_ids("😀")
    stream = TextStream(tok, stop_strings=["!"])
    deltas = run(stream, [[i] for i in [*emoji, ord("!")]])
    assert "".join(d.text for d in deltas) == "😀" and [i for d in deltas for i in d.token_ids] == emoji


def test_token_ids_are_the_tokens_of_the_text_sent(tok):
    """A stop string that starts at a token boundary: the tokens it spans are never reported, and
    usage counts (``num_reported``) are those of the text sent."""
    words = ["def", " f", "():", "\n", "STOP", "\n", "more"]
    ids = [i for w in words for i in tok.encode(w)]
    stream = TextStream(tok, stop_strings=["STOP"])
    deltas = run(stream, [[i] for i in ids])
    text = "".join(d.text for d in deltas)
    reported = [i for d in deltas for i in d.token_ids]
    assert text == "def f():\n" and deltas[-1].stop_reason == "stop_string"
    assert tok.decode(reported) == text and reported == [i for w in words[:4] for i in tok.encode(w)]
    assert stream.num_reported == len(reported) < stream.num_tokens


def test_stop_token_in_the_middle_of_a_push(tok):
    stop = eos(tok)
    stream = TextStream(tok, stop_strings=["<stop>"], stop_token_ids=[stop])
    ids = tok.encode("partial <st")
    delta = stream.push([*ids, stop, *tok.encode("never seen")])
    # Held-back text (a possible stop-string start) is released; the stop token is reported, later ones dropped.
    assert delta == StreamDelta("partial <st", [*ids, stop], True, "stop_token")
    assert stream.num_tokens == len(ids) + 1
    with pytest.raises(RuntimeError):
        stream.push([stop])


def test_stop_token_releases_incomplete_character(tok):
    ids = byte_ids("ok 😀")[:-1]
    stream = TextStream(tok, stop_token_ids=[eos(tok)])
    # The emoji's first three bytes are held back with their text, which the stop token releases.
    assert stream.push(ids) == StreamDelta("ok ", ids[:3], False, None)
    assert stream.push([eos(tok)]) == StreamDelta("\ufffd", [*ids[3:], eos(tok)], True, "stop_token")


def test_flush_releases_held_text(tok):
    stream = TextStream(tok, stop_strings=["<end>"])
    assert stream.push(byte_ids("done <en")) == StreamDelta("done ", byte_ids("done "), False, None)
    assert stream.flush() == StreamDelta("<en", byte_ids("<en"), False, None)  # the held tokens come with their text
    assert stream.flush() == StreamDelta("", [], False, None)
    with pytest.raises(RuntimeError):
        stream.push([ord("x")])


def test_special_tokens_are_skipped_and_prompt_gives_context(tok):
    prompt = tok.encode("<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n")
    start = tok.token_to_id("<|im_start|>")
    stream = TextStream(tok, prompt_ids=prompt)
    deltas = run(stream, [byte_ids("Hi ")[:2], [start], byte_ids("Hi ")[2:] + byte_ids("世")])
    assert "".join(d.text for d in deltas) == "Hi 世"


def test_decode_window_stays_bounded(tok, monkeypatch):
    sizes = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: sizes.append(len(ids)) or decode(ids, **kw))
    text = EMOJI_CJK * 40
    stream = TextStream(tok, stop_strings=["never appears"])
    assert "".join(d.text for d in run(stream, [[i] for i in byte_ids(text)])) == text
    assert len(sizes) > 1000 and max(sizes) <= 17  # a window of at most 16 tokens, plus the new one


TEXTS = st.lists(
    st.one_of(st.sampled_from([*"ab <>/\n\t\r中文😀é\u0301", "👍🏽", "👨‍👩‍👧‍👦", "\r\n"]), st.characters(codec="utf-8")),
    max_size=30,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, data=st.data())
def test_joined_deltas_equal_truncated_decode(tok, text, data):
    ids = list(
        data.draw(
            st.one_of(
                st.sampled_from([tok.encode(text, add_special_tokens=False), byte_ids(text)]),
                st.lists(st.integers(0, 255), max_size=40),  # any bytes, invalid UTF-8 included
            ),
            label="ids",
        )
    )
    stop = eos(tok)
    specials = sorted(tok.special_ids - {stop})
    for _ in range(data.draw(st.integers(0, 3), label="specials")):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(specials)))
    use_stop_token = data.draw(st.booleans(), label="stop token")
    if use_stop_token:
        ids.insert(data.draw(st.integers(0, len(ids)), label="stop token at"), stop)
    # Stop strings: pieces of the text (so they match) and short strings that may not.
    cuts = st.tuples(st.integers(0, len(text)), st.integers(1, 6)).map(lambda c: text[c[0] : c[0] + c[1]])
    stop_strings = [s for s in data.draw(st.lists(st.one_of(cuts, st.text("ab<>/中😀", min_size=1)), max_size=3)) if s]
    sizes = data.draw(st.lists(st.integers(1, 8), max_size=len(ids) + 1), label="push sizes")
    chunks, rest = [], list(ids)
    for size in sizes:
        chunks.append(rest[:size])
        rest = rest[size:]
    chunks.append(rest)

    stream = TextStream(tok, stop_strings=stop_strings, stop_token_ids=[stop] if use_stop_token else ())
    deltas = run(stream, chunks)
    reported = [i for d in deltas for i in d.token_ids]
    emitted = "".join(d.text for d in deltas)

    assert reported == ids[: len(reported)]
    assert stream.num_reported == len(reported) <= stream.num_tokens
    consumed = ids[: stream.num_tokens]
    decoded = tok.decode(consumed)
    starts = [i for i in (decoded.find(s) for s in stop_strings) if i >= 0]
    assert emitted == decoded[: min(starts, default=len(decoded))]
    reason = deltas[-1].stop_reason
    assert deltas[-1].finished == (reason is not None)
    if reason == "stop_string":
        # The last token consumed completed the match: no stop string in the text before it (less a
        # final U+FFFD, which may be a character the last token completes).
        before = tok.decode(consumed[:-1])
        before = before[:-1] if before.endswith("\ufffd") else before
        assert starts and not any(s in before for s in stop_strings)
        # The reported tokens are those of the text sent: each of them starts before the stop
        # string (the text of the ones before it is shorter than what was sent), the next one does not.
        settled = lambda t: t[:-1] if t.endswith("\ufffd") else t  # noqa: E731
        if reported:
            assert len(settled(tok.decode(reported[:-1]))) < len(emitted)
        assert tok.decode(reported).startswith(emitted)
        if "\ufffd" not in decoded:  # then exactly: the shortest run of tokens that spells the text sent
            shortest = next(r for r in range(len(consumed) + 1) if tok.decode(consumed[:r]).startswith(emitted)) if emitted else 0
            assert len(reported) == shortest
        assert stream.num_tokens == len(consumed)
    elif reason == "stop_token":
        assert reported[-1] == stop and stop not in reported[:-1]
        assert not starts
    else:
        assert reported == ids and not starts
    if reason != "stop_string":
        assert stream.num_reported == stream.num_tokens
    if "\ufffd" not in decoded:
        assert all("\ufffd" not in d.text for d in deltas)
