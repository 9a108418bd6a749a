"""Token ids to text as they arrive: the pieces add up to the whole decode (a real byte-level BPE tokenizer, whose
characters may span tokens, and a word-level one that puts spaces between tokens), and stop strings end the text before
them even when they straddle two pieces."""
import pytest

from pipeline.serving.text_stream import TextStream

TEXTS = ["Hello, world! The café serves crème brûlée.", "数学很有趣，日本語もです。", "emoji 🙂👍🏽 and 🇫🇷 flags",
         "  leading spaces\n\ttabs and\nnew lines  ", "def f(x):\n    return x ** 2  # square"]


@pytest.fixture(scope="module")
def bpe(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def pieces(tokenizer, ids, stop=(), chunk=1):
    stream = TextStream(tokenizer, stop)
    out = [stream.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return out + [stream.finish()], stream


@pytest.mark.parametrize("chunk", [1, 3])
def test_pieces_add_up_to_the_whole_decode(bpe, chunk):
    for text in TEXTS:
        ids = bpe(text).input_ids + [bpe.eos_token_id]
        out, _ = pieces(bpe, ids, chunk=chunk)
        assert "".join(out) == bpe.decode(ids, skip_special_tokens=True) == text
        assert all("\ufffd" not in p for p in out)  # never half a character
    assert sum(1 for p in pieces(bpe, bpe(TEXTS[2]).input_ids)[0] if p) > 3  # piece by piece, not at the end


def test_a_tokenizer_that_joins_words_with_spaces_gets_them_between_pieces(tiny_chat_target):
    from transformers import AutoTokenizer

    words = AutoTokenizer.from_pretrained(tiny_chat_target)  # word-level: decode puts the spaces between tokens
    ids = words("w5 w6 w7 w40 w41").input_ids
    out, _ = pieces(words, ids)
    assert out[:5] == ["w5", " w6", " w7", " w40", " w41"] and "".join(out) == words.decode(ids) == "w5 w6 w7 w40 w41"


def test_a_stop_string_ends_the_text_before_it_even_across_pieces(bpe):
    ids = bpe("The answer is 42. END of story, more text").input_ids
    out, stream = pieces(bpe, ids, stop=["END", "never"])
    assert "".join(out) == "The answer is 42. " and stream.stopped
    assert all(not p.endswith(("E", "EN")) for p in out)  # a stop string's start is held back, not sent
    # a stop string spelt over several tokens, each token a character
    chars = [bpe.convert_tokens_to_ids(c) for c in "abcSTOPdef"]
    out, stream = pieces(bpe, chars, stop=["STOP"])
    assert "".join(out) == "abc" and stream.stopped and out[-1] == ""
    # held-back text that turns out not to be a stop string is sent
    out, stream = pieces(bpe, bpe("a STOOL here").input_ids, stop=["STOP"])
    assert "".join(out) == "a STOOL here" and not stream.stopped
