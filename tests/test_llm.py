"""graphrt's text API (``graphrt.core.serve.LLM``) on the embedded pair, CPU, float32.

Text is held to the tokens: a completion's text is its tokens decoded, the streamed
deltas join to it, drafting changes no greedy token, and a stop (string or token id)
cuts both where it appears and frees the request's KV at once.
"""

from __future__ import annotations

import threading

import pytest
from helpers import cycling_chooser

from graphrt.core.errors import RequestError
from graphrt.core.serve import LLM, TextParams
from graphrt.spec.adaptive import LOOK_HORIZON

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
PARAMS = TextParams(max_tokens=24)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")  # the embedded pair, drafting (auto lengths)


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM(device="cpu", draft=False)


def _kv_free(llm: LLM) -> bool:
    return llm.engine.kv_pool.available() == llm.engine.kv_pool.num_slots


def test_text_is_the_tokens_decoded_and_drafting_changes_no_greedy_token(llm, plain, monkeypatch):
    assert llm.engine.strategy.name != plain.engine.strategy.name
    # Every draft length and plain steps, in turn: auto's own choice follows the host's
    # step times, and on a loaded 2-core CPU lane it once chose plain steps throughout
    # (no round to check). What is checked holds for any choice.
    strategy = llm.engine.strategy
    lengths = cycling_chooser(strategy.cfg.num_steps, (5, 1, 0, 3, 2, 4))
    monkeypatch.setattr(strategy, "chooser", lengths)
    params = TextParams(max_tokens=LOOK_HORIZON + 8, ignore_eos=True)
    got = llm.generate(PROMPTS, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in plain.generate(PROMPTS, params)]
    for prompt, c in zip(PROMPTS, got):
        assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert c.prompt_tokens == len(llm.encode(prompt)) and c.finish_reason == "length"
        assert len(c.token_ids) == params.max_tokens
    assert llm.engine.stats.spec_rounds > 0  # drafts were verified
    assert _kv_free(llm)


def test_streamed_deltas_join_to_the_generated_text(llm):
    (whole,) = llm.generate(PROMPTS[:1], PARAMS)
    deltas = list(llm.stream(PROMPTS[0], PARAMS))
    assert len(deltas) > 3 and "".join(deltas) == whole.text
    assert _kv_free(llm)


def test_generate_closes_its_batch_and_a_stream_leaves_it_open(llm, monkeypatch):
    """``LLM.generate`` runs its prompts to completion together: the draft-length chooser
    weighs when the batch finishes (closed); a stream's request may be joined by others
    as it runs: not closed."""
    chooser = llm.engine.strategy.chooser
    closed, choose = [], chooser.choose

    def spy(bucket, reqs, refused=frozenset(), closed_batch=False):
        closed.append(closed_batch)
        return choose(bucket, reqs, refused, closed_batch)

    monkeypatch.setattr(chooser, "choose", spy)
    llm.generate(PROMPTS, PARAMS)
    assert closed and all(closed)
    closed.clear()
    list(llm.stream(PROMPTS[0], PARAMS))
    assert closed and not any(closed)


def test_a_stop_string_ends_the_text_before_it_and_frees_the_kv(llm):
    (whole,) = llm.generate(PROMPTS[:1], PARAMS)
    stop = whole.text.strip()[-6:-2]  # text from late in the completion
    cut = whole.text.index(stop)
    params = TextParams(max_tokens=24, stop=("no such text", stop))
    (c,) = llm.generate(PROMPTS[:1], params)
    assert c.text == whole.text[:cut] and c.finish_reason == "stop"
    assert whole.token_ids[: len(c.token_ids)] == c.token_ids < whole.token_ids
    assert "".join(llm.stream(PROMPTS[0], params)) == whole.text[:cut]  # held back, not cut
    assert _kv_free(llm)


def test_a_stop_token_ends_the_request_after_it(llm):
    (whole,) = llm.generate(PROMPTS[1:2], PARAMS)
    token = whole.token_ids[5]
    first = whole.token_ids.index(token)
    # A stop string that the stop token's text begins and nothing completes: that text is
    # held back as a possible stop, and must still come out when the token ends the request.
    tail = llm.tokenizer.decode([token], skip_special_tokens=True)
    assert tail
    params = TextParams(max_tokens=24, stop_token_ids=(token,), stop=(tail[-1] + "\uffff",))
    (c,) = llm.generate(PROMPTS[1:2], params)
    assert c.token_ids == whole.token_ids[: first + 1] and c.finish_reason == "stop"
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert "".join(llm.stream(PROMPTS[1], params)) == c.text
    assert _kv_free(llm)


def test_closing_a_stream_early_aborts_the_request_and_frees_its_kv(llm):
    stream = llm.stream(PROMPTS[2], TextParams(max_tokens=24))
    next(stream)
    assert not _kv_free(llm)
    stream.close()
    assert _kv_free(llm) and not llm.engine.has_work


def test_chat_renders_the_checkpoints_template(llm):
    messages = [{"role": "user", "content": "def fibonacci(n):"}]
    assert llm.render_chat(messages) == "def fibonacci(n):\n"
    (want,) = llm.generate(["def fibonacci(n):\n"], PARAMS)
    assert llm.chat(messages, PARAMS).text == want.text
    with pytest.raises(RequestError, match="a chat message is"):
        llm.chat([{"role": "user"}])


def test_threads_share_steps_and_each_gets_its_own_completion(llm):
    want = [c.text for c in llm.generate(PROMPTS, PARAMS)]
    got: dict[int, str] = {}

    def run(i: int) -> None:
        got[i] = llm.generate([PROMPTS[i]], PARAMS)[0].text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [got[i] for i in range(len(PROMPTS))] == want
    assert _kv_free(llm)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TextParams(stop=("",)), "stop strings must be non-empty"),
        (lambda: TextParams(stop_token_ids=(-1,)), "stop_token_ids must be token ids"),
        (lambda: TextParams(max_tokens=0), "max_new_tokens must be >= 1"),
        (lambda: TextParams(temperature=-1.0), "temperature"),
    ],
)
def test_bad_parameters_are_refused_with_one_line(make, match):
    with pytest.raises(RequestError, match=match):
        make()


def test_a_bad_prompt_queues_nothing(llm):
    with pytest.raises(RequestError, match="a prompt is text or a list of token ids"):
        llm.generate(["fine", [1, "two"]])
    assert not llm.engine.has_work and _kv_free(llm)


def test_a_model_without_a_tokenizer_takes_and_gives_token_ids():
    """The random presets have no tokenizer.json: prompts are ids, completions carry
    tokens and no text, and text where text is needed is a one-line RequestError."""
    llm = LLM("random:llama-tiny", device="cpu")
    (c,) = llm.generate([[1, 2, 3]], TextParams(max_tokens=5, ignore_eos=True))
    assert len(c.token_ids) == 5 and c.text == "" and c.prompt_tokens == 3
    with pytest.raises(RequestError, match="no tokenizer.json: prompts must be token ids"):
        llm.generate(["text"], TextParams(max_tokens=5))
    with pytest.raises(RequestError, match="stop strings need text"):
        llm.generate([[1, 2]], TextParams(max_tokens=5, stop=["x"]))


def test_graphrt_itself_exports_the_text_api_lazily():
    import graphrt

    assert graphrt.LLM is LLM and graphrt.TextParams is TextParams
    assert "LLM" in dir(graphrt) and "Engine" in graphrt.__all__
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        graphrt.Nope  # noqa: B018
