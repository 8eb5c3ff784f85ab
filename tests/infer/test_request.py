"""What a request makes of its tokens: stop tokens end it uncounted, the length limit
holds, a stop string cuts the text before itself, and streamed text is never retracted:
it holds back an unfinished character and a stop string being written."""

from __future__ import annotations

from trainforge.infer.request import Request
from trainforge.infer.sampling import SamplingParams

EOS = 0


class CharTokenizer:
    """Token i > 0 decodes to one character; tokens 90 then 91 make one two-byte character
    ("é"), and 90 alone decodes to U+FFFD like an unfinished UTF-8 sequence."""

    def decode(self, ids: list[int]) -> str:
        out, i = [], 0
        while i < len(ids):
            if ids[i] == 90:
                out.append("é" if i + 1 < len(ids) and ids[i + 1] == 91 else "\ufffd")
                i += 2 if i + 1 < len(ids) and ids[i + 1] == 91 else 1
            else:
                out.append(chr(ord("a") + ids[i] % 26) if ids[i] < 60 else "!")
                i += 1
        return "".join(out)


def stream(ids: list[int], **params) -> tuple[Request, list[str], str | None]:
    req = Request(0, [1], SamplingParams(**{"max_new_tokens": 50, **params}))
    deltas, reason = [], None
    for t in ids:  # one token per update, as the engine hands them out on CPU
        _, delta, reason = req.add_tokens([t], (EOS,), CharTokenizer())
        deltas.append(delta)
        if reason:
            break
    return req, deltas, reason


def test_stop_token_and_length():
    req, _, reason = stream([1, 2, 3, EOS, 4])
    assert reason == "stop" and req.output_ids == [1, 2, 3] and req.text == "bcd"
    req, _, reason = stream([1, 2, 3, EOS, 4], ignore_eos=True, max_new_tokens=5)
    assert reason == "length" and req.output_ids == [1, 2, 3, EOS, 4]
    req, _, reason = stream([1, 2, 7, 3], stop_token_ids=(7,))
    assert reason == "stop" and req.output_ids == [1, 2]


def test_stop_string_cuts_the_text_and_never_streams():
    # b c d e ! ! f g : "bcde!!fg"; stop at "!!"
    req, deltas, reason = stream([1, 2, 3, 4, 60, 61, 5, 6], stop=("!!", "zz"))
    assert reason == "stop" and req.text == "bcde" and "".join(deltas) == "bcde"
    assert all("!" not in d for d in deltas)
    # The earliest of several stop strings wins.
    req, _, _ = stream([1, 2, 3, 4, 60, 61], stop=("!", "cd"))
    assert req.text == "b"


def test_streamed_text_holds_back_an_unfinished_character():
    req, deltas, reason = stream([1, 90, 91, 2], max_new_tokens=4)
    assert reason == "length" and req.text == "béc"
    assert deltas[1] == "" and "\ufffd" not in "".join(deltas) and "".join(deltas) == "béc"
