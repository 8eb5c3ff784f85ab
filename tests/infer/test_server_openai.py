"""The OpenAI fields beyond the basics, through the official ``openai`` client against a
live server: ``stream_options.include_usage`` ends a stream with a usage chunk; ``n``
choices are separate sequences (seed, seed + 1, ...), streamed interleaved by ``index``;
``logprobs`` are the model's raw log-softmax (a direct forward agrees within 1e-4, whatever
the temperature); ``/tokenize`` and ``/detokenize`` round-trip behind the API key; bad
values get a 400 naming the field."""

from __future__ import annotations

import math
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from tests.infer.test_server import server  # noqa: F401  (the module's live server fixture)

PROMPT = "def main("
CHAT = [{"role": "user", "content": "hi"}]


def greedy(server, **kw):
    return server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, **kw)


@torch.no_grad()
def raw_logprobs(server, prompt_ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward over prompt + output: row i predicts out_ids[i]. (len(out), V)"""
    logits = server.engine.model(torch.tensor([prompt_ids + out_ids]))[0].float()
    return torch.log_softmax(logits, -1)[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(out_ids)]


def ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens[:3]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_include_usage_ends_the_stream_with_a_usage_chunk(server):
    want = greedy(server)
    chunks = list(server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == want.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == want.choices[0].text
    chat = list(server.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    usage = chat[-1].usage
    assert chat[-1].choices == [] and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens > 0
    plain = list(server.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices  # off by default


def test_n_choices_are_separate_sequences_and_stream_interleaved(server):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    r = server.client.completions.create(n=3, **kw)
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3  # different seeds, different text
    assert r.usage.completion_tokens == 30
    for i in range(3):  # choice i is the single request with seed 5 + i
        assert server.client.completions.create(**{**kw, "seed": 5 + i}).choices[0].text == texts[i]
    chunks = list(server.client.completions.create(n=3, stream=True, **kw))
    by_index = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i) for i in range(3)]
    assert by_index == texts
    order = [c.choices[0].index for c in chunks]
    assert order != sorted(order)  # interleaved as they are decoded together, not one after another
    assert sum(c.choices[0].finish_reason == "length" for c in chunks) == 3
    chat = server.client.chat.completions.create(model="tiny", messages=CHAT, n=2, max_tokens=4, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same sequence twice


@pytest.mark.parametrize("temperature", [0.0, 1.7])
def test_completion_logprobs_are_the_models_raw_log_softmax(server, temperature):
    """Before temperature and top-p: the same numbers as a plain forward at any temperature."""
    prompt_ids = server.tok.encode(PROMPT).ids
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=temperature, logprobs=3, seed=1, top_p=0.9)
    r = server.client.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    out_ids = ids_of(lp.tokens)
    assert server.tok.decode(out_ids) == r.choices[0].text
    ref = raw_logprobs(server, prompt_ids, out_ids)
    torch.testing.assert_close(torch.tensor(lp.token_logprobs), ref.gather(1, torch.tensor(out_ids)[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    for i, top in enumerate(lp.top_logprobs):
        values, top_ids = ref[i].topk(3)
        assert ids_of(list(top)) == top_ids.tolist()
        torch.testing.assert_close(torch.tensor(list(top.values())), values, atol=1e-4, rtol=0)
    if temperature == 0:  # greedy: the sampled token is the top one
        assert [ids_of(list(t))[0] for t in lp.top_logprobs] == out_ids
    plain = server.client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    assert plain.text == r.choices[0].text  # seeded: the same tokens, now shown as text
    offsets, tokens = plain.logprobs.text_offset, plain.logprobs.tokens
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(plain.text)
    # A whole-character token is found at its offset (one holding part of a character shows U+FFFD).
    assert all(plain.text.startswith(t, at) for t, at in zip(tokens, offsets) if "\ufffd" not in t)
    assert all(math.isfinite(v) and v <= 0 for v in plain.logprobs.token_logprobs)


def test_chat_logprobs_and_streamed_logprobs(server):
    r = server.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                              top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert bytes(b for e in content for b in e.bytes).decode() == r.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token  # greedy
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob) and e.top_logprobs[1].logprob <= e.logprob
    chunks = list(server.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0,
                                                        logprobs=True, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # top_logprobs not asked for
    assert r.choices[0].logprobs is not None
    assert server.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2).choices[0].logprobs is None


def test_tokenize_and_detokenize_round_trip_behind_the_key(server):
    text = "def main(): pass"
    r = server.http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == server.tok.encode(text).ids and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == server.engine.max_context == 128
    assert server.http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"prompt": text}
    chat = server.http.post("/tokenize", json={"messages": CHAT}).json()
    served = server.client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    assert chat["count"] == served.usage.prompt_tokens  # the prompt the chat endpoint sends to the model
    assert httpx.post(server.url + "/tokenize", json={"prompt": text}).status_code == 401
    assert httpx.post(server.url + "/detokenize", json={"tokens": [1]}).status_code == 401


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 9}, "n"),  # more than max_batch_size + max_queue = 8
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
    ("/tokenize", {"text": "x"}, "prompt"),
    ("/detokenize", {"tokens": [1, 100000]}, "tokens"),
])
def test_bad_values_get_a_400_naming_the_field(server, path, body, param):
    r = server.http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    if path == "/v1/completions" and "n" in body:
        with pytest.raises(openai.BadRequestError, match="'n'"):
            server.client.completions.create(model="tiny", **body)


def test_logprobs_with_speculative_decoding_is_a_400_naming_the_field(small_data):
    from tests.infer.test_server import serving, tiny_model
    from tests.infer.test_speculative import perturbed
    from trainforge.data.tokenizer import eos_id, load_tokenizer
    from trainforge.infer.engine import Engine, EngineConfig
    from trainforge.infer.server import ServerConfig
    from trainforge.infer.speculative import DraftModelDrafter

    tok = load_tokenizer(small_data / "tokenizer.json")
    V = tok.get_vocab_size()
    engine = Engine(tiny_model(V), EngineConfig(max_batch_size=2, max_context=128, block_size=8,
                                                num_speculative_tokens=2), tokenizer=tok, eos_ids=(eos_id(tok),),
                    drafter=DraftModelDrafter(perturbed(tiny_model(V), 0.1)))
    with serving(engine, tok, ServerConfig(access_log=False)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="speculative") as e:
            client.completions.create(model="trainforge", prompt="x", max_tokens=3, logprobs=1)
        assert e.value.body["param"] == "logprobs"
        assert client.completions.create(model="trainforge", prompt="x", max_tokens=3).choices[0].logprobs is None


@pytest.mark.parametrize("sync_interval_steps", [1, 4])  # 4: tokens read every 4 steps, as on CUDA (8)
def test_engine_logprobs_of_a_mixed_batch_match_a_direct_forward(server, sync_interval_steps):
    """Rows with and without logprobs share a batch; each row's logprobs are its own."""
    from tests.infer.test_server import tiny_model
    from trainforge.infer.engine import Engine, EngineConfig
    from trainforge.infer.sampling import SamplingParams

    engine = Engine(tiny_model(server.tok.get_vocab_size()),
                    EngineConfig(max_batch_size=3, max_context=128, sync_interval_steps=sync_interval_steps),
                    tokenizer=server.tok)
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    params = [SamplingParams(max_new_tokens=9, temperature=0.8, seed=3, logprobs=2, ignore_eos=True),
              SamplingParams(max_new_tokens=7, temperature=0, ignore_eos=True),
              SamplingParams(max_new_tokens=11, temperature=0, logprobs=0, repetition_penalty=1.3, ignore_eos=True)]
    reqs = engine.generate(prompts, params)
    assert reqs[1].logprobs == []
    for req, k in ((reqs[0], 2), (reqs[2], 0)):
        assert len(req.logprobs) == len(req.output_ids) == req.params.max_new_tokens
        ref = raw_logprobs(SimpleNamespace(engine=engine), req.prompt_ids, req.output_ids)
        got = torch.tensor([lp for lp, _ in req.logprobs])
        torch.testing.assert_close(got, ref.gather(1, torch.tensor(req.output_ids)[:, None])[:, 0], atol=1e-4, rtol=0)
        for i, (_, top) in enumerate(req.logprobs):
            assert [t for t, _ in top] == ref[i].topk(k).indices.tolist()
