"""Per-token text (positronic/text.py): each token's text decoded as part of its span, so a
leading space survives and a character split over byte tokens is whole in the token that ends
it; and the rows a needle's occurrences overlap (--pin)."""

from positronic.text import CONTEXT, rows_matching, span_texts

PIECES = {1: "▁Hello", 2: "▁world", 3: ",", 4: "▁again"}


def sentencepiece_decode(ids: list[int]) -> str:
    """Like a sentencepiece tokenizer: the space of the first piece of a decode is dropped."""
    return "".join(PIECES[i] for i in ids).replace("▁", " ").removeprefix(" ")


def test_a_leading_space_survives_where_decoding_one_token_would_drop_it():
    assert sentencepiece_decode([2]) == "world", "the tokenizer on its own drops it"
    assert span_texts(sentencepiece_decode, [1, 2, 3, 4]) == ["Hello", " world", ",", " again"]
    assert span_texts(sentencepiece_decode, [2, 4], previous=1) == [" world", " again"]
    assert span_texts(sentencepiece_decode, []) == []


def test_a_character_split_over_byte_tokens_is_whole_in_the_token_that_ends_it(tiny):
    ids = tiny.encode("a€b")
    assert len(ids) == 5, "the byte tokenizer: one token per byte"
    texts = span_texts(tiny.decode, ids)
    assert texts[0] == "a" and texts[3] == "€" and texts[4] == "b"
    assert texts[1] == texts[2] == "\ufffd", "the unfinished bytes show as a replacement character"
    assert span_texts(tiny.decode, ids[1:], previous=ids[0]) == texts[1:], "the same texts after a previous token"


def test_text_far_into_a_long_span_is_decoded_with_a_short_left_context(tiny):
    text = "x" * (3 * CONTEXT) + " tail"
    texts = span_texts(tiny.decode, tiny.encode(text))
    assert "".join(texts) == text
    calls = []

    def counting(ids):
        calls.append(len(ids))
        return tiny.decode(ids)

    span_texts(counting, tiny.encode(text))
    assert max(calls) <= CONTEXT + 1, "each token is decoded with at most CONTEXT tokens before it"


def test_rows_matching_gives_every_row_an_occurrence_overlaps_in_row_order():
    texts = ["The", " big", " red", " dog", " and", " big", " red", " cat"]
    assert rows_matching(texts, "g r") == [1, 2, 5, 6]
    assert rows_matching(texts, "dog") == [3]
    assert rows_matching(texts, " dog and big") == [3, 4, 5]
    assert rows_matching(texts, "e") == [0, 2, 6]
    assert rows_matching(texts, "bird") == [] and rows_matching(texts, "") == []
    assert rows_matching(["aa", "a"], "aa") == [0, 1], "overlapping occurrences count too"
