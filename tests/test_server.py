"""`graphrt serve` as a client sees it: a real server process on 127.0.0.1 (the embedded
pair, drafting, CPU, float32), queried with the official ``openai`` client.

Every answer is held to offline ``LLM.generate`` on the same checkpoint, greedy: whole,
streamed, chat, under 64 concurrent streams, beside bad requests, and through a SIGTERM
drain. A client that leaves frees its KV (seen through ``/metrics``), and the metrics
parse with prometheus_client's own parser and add up to what the clients received.

Every wait is bounded; the server is killed at the end whatever happened.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from graphrt.core.serve import LLM, TextParams  # noqa: E402

MODEL = "gemma4-code"
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range("]
WAIT_S = 120  # the longest any one wait may take on a slow machine

pytestmark = pytest.mark.slow  # about 20 s: start it early beside the other workers


@pytest.fixture(scope="module")
def server():
    """The server process and its base URL; SIGKILLed at the end if still running."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        # A drain long enough for any machine: the SIGTERM test's stream must finish.
        [
            sys.executable,
            "-m",
            "graphrt.core.cli.main",
            "serve",
            "--device",
            "cpu",
            "--port",
            "0",
            "--drain-timeout",
            str(WAIT_S),
        ],  # fmt: skip
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + WAIT_S
    url = None
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        found = [re.search(r"at (http://\S+:\d+)", line) for line in list(lines)]
        url = next((m.group(1) for m in found if m), None)
        time.sleep(0.05)
    assert url is not None, f"the server did not start: {''.join(lines)}"
    proc.lines, proc.reader = lines, reader
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=WAIT_S)


@pytest.fixture(scope="module")
def client(server):
    _, url = server
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=WAIT_S)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(device="cpu")  # the same embedded pair, drafting


def _connect(url: str, timeout: float = WAIT_S) -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


def _request(url: str, method: str, path: str, body=None, timeout: float = WAIT_S):
    """(status, body text) of one plain HTTP request (no client library in between)."""
    conn = _connect(url, timeout)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, data, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read().decode()
    finally:
        conn.close()


def _metrics(url: str) -> dict[tuple, float]:
    """Every sample of /metrics, parsed by prometheus_client: (name, labels) -> value."""
    status, text = _request(url, "GET", "/metrics")
    assert status == 200
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def _streamed(stream) -> tuple[str, str | None]:
    """(text, finish reason) of a completions or chat stream."""
    text, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            text.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish


def test_completions_and_chat_whole_and_streamed_equal_offline_generate(client, offline):
    params = TextParams(max_tokens=24)
    want = offline.generate(PROMPTS[:2], params)
    for prompt, w in zip(PROMPTS[:2], want):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert whole.choices[0].text == w.text and whole.choices[0].finish_reason == "length"
        assert whole.usage.completion_tokens == 24
        assert whole.usage.prompt_tokens == w.prompt_tokens
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        assert _streamed(stream) == (w.text, "length")
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat_want = offline.chat(messages, params)
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    assert whole.choices[0].message.content == chat_want.text
    assert whole.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert _streamed(chunks[:-1]) == (chat_want.text, "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [m.id for m in client.models.list()] == [MODEL]
    # vLLM's return_token_ids: each chunk's new tokens, every token once, in order.
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stream=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    streamed_ids = [t for chunk in stream for c in chunk.choices for t in c.token_ids or ()]
    assert streamed_ids == want[0].token_ids
    # Several prompts in one request: a choice each, by index, whole and streamed.
    both = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=24, temperature=0)
    assert [(c.index, c.text) for c in both.choices] == [(0, want[0].text), (1, want[1].text)]
    assert both.usage.completion_tokens == 48
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS[:2], max_tokens=24, temperature=0, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == {0: want[0].text, 1: want[1].text}


def test_a_stop_string_ends_the_text_before_it(client, offline):
    (whole,) = offline.generate(PROMPTS[2:3], TextParams(max_tokens=24))
    stop = whole.text.strip()[-6:-2]
    cut = whole.text.index(stop)
    got = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=["@@@", stop]
    )
    assert got.choices[0].text == whole.text[:cut] and got.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, stop=stop, stream=True
    )
    assert _streamed(stream) == (whole.text[:cut], "stop")


def test_64_concurrent_streams_each_get_their_own_greedy_text(client, offline):
    prompts = [f"def f{i}(x):\n    return x" + " +" * (i % 3) for i in range(64)]
    want = [c.text for c in offline.generate(prompts, TextParams(max_tokens=12))]

    def one(prompt):
        stream = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
        return _streamed(stream)[0]

    with ThreadPoolExecutor(64) as pool:
        got = list(pool.map(one, prompts, timeout=WAIT_S))
    assert got == want


def _wait_aborted(url: str, count: float) -> dict:
    """/metrics once ``count`` requests have ended aborted (at most WAIT_S): the abort
    frees the KV at once, its completion is counted at the engine loop's next pass."""
    deadline = time.monotonic() + WAIT_S
    while True:
        m = _metrics(url)
        if m.get(ABORTED, 0) >= count or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


ABORTED = ("graphrt:request_success_total", (("finished_reason", "interrupted"),))


def test_a_client_that_leaves_mid_stream_frees_its_kv(server):
    _, url = server
    before = _metrics(url)
    body = {"prompt": PROMPTS[0], "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    conn = _connect(url)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})  # fmt: skip
    r = conn.getresponse()
    assert r.status == 200 and r.readline().startswith(b"data: ")  # it runs
    m = _metrics(url)
    assert m[("graphrt:num_requests_running", ())] == 1
    assert m[("graphrt:kv_cache_usage_perc", ())] > 0
    conn.close()  # the client leaves: the server aborts the request, its slots return
    after = _wait_aborted(url, before.get(ABORTED, 0) + 1)
    assert after[ABORTED] == before.get(ABORTED, 0) + 1
    assert after[("graphrt:num_requests_running", ())] == 0
    assert after[("graphrt:kv_cache_usage_perc", ())] == 0
    # ... as a client waiting for a whole answer that gives up does.
    with pytest.raises(TimeoutError):
        _request(url, "POST", "/v1/completions", body, timeout=1.0)
    after = _wait_aborted(url, before.get(ABORTED, 0) + 2)
    assert after[ABORTED] == before.get(ABORTED, 0) + 2
    assert after[("graphrt:kv_cache_usage_perc", ())] == 0


def test_bad_requests_get_400_while_a_stream_goes_on(server, client, offline):
    _, url = server
    (want,) = offline.generate(PROMPTS[3:4], TextParams(max_tokens=64))
    got = {}

    def long_stream():
        stream = client.completions.create(
            model=MODEL, prompt=PROMPTS[3], max_tokens=64, temperature=0, stream=True
        )
        got["text"] = _streamed(stream)

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    bad = [
        ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": [5] * 5000, "max_tokens": 4}, "context"),  # over 4096 tokens
        ({"prompt": [4096], "max_tokens": 4}, "vocabulary"),
        ({"prompt": "x", "model": "gpt-4"}, "does not exist"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": 7}, "prompt"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "logprobs": 3}, "logprobs"),
    ]
    for body, says in bad:
        status, text = _request(url, "POST", "/v1/completions", body)
        assert status == 400, (body, text)
        error = json.loads(text)["error"]
        assert error["type"] == "invalid_request_error" and says in error["message"], error
    status, text = _request(url, "POST", "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and "messages" in json.loads(text)["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    streaming.join(timeout=WAIT_S)
    assert got["text"] == (want.text, "length")


def test_metrics_parse_and_add_up_to_what_clients_received(server, client):
    _, url = server
    before = _metrics(url)
    usages = []
    for prompt in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        usages.append(r.usage)
    after = _metrics(url)

    def grew(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert grew("graphrt:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("graphrt:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    ended = sum(grew("graphrt:request_success_total", (("finished_reason", r),))
                for r in ("length", "stop"))  # fmt: skip
    assert ended == len(PROMPTS)
    assert grew("graphrt:time_to_first_token_seconds_count") == len(PROMPTS)
    assert grew("graphrt:e2e_request_latency_seconds_count") == len(PROMPTS)
    tokens = sum(u.completion_tokens for u in usages)  # ITL: every token after the first
    # A prompt's first token is the prefill's alone: every later token has its gap.
    assert grew("graphrt:inter_token_latency_seconds_count") == tokens - len(PROMPTS)
    # The drafter ran: drafts were verified, and the per-position counts sum to the total.
    # (Since the server started: auto lengths may choose plain steps for a while.)
    assert after[("graphrt:spec_decode_num_drafts_total", ())] > 0
    per_pos = [v for (name, labels), v in after.items()
               if name == "graphrt:spec_decode_num_accepted_tokens_per_pos_total"]  # fmt: skip
    assert sum(per_pos) == after[("graphrt:spec_decode_num_accepted_tokens_total", ())]
    assert after[("graphrt:spec_decode_num_draft_tokens_total", ())] >= sum(per_pos)
    assert after[("graphrt:kv_cache_tokens", ())] > 0


def test_a_port_in_use_is_one_line_and_exit_2_before_loading_anything():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "graphrt.core.cli.main", "serve", "--device", "cpu"]
        r = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True,
                           timeout=WAIT_S)  # fmt: skip
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"graphrt: error: cannot listen on 127.0.0.1:{port}: ")
    assert len(r.stderr.splitlines()) == 1


def test_sigterm_drains_the_streams_in_flight_then_exits_0(server, client, offline):
    """Last in this file: it stops the module's server."""
    proc, url = server
    # 256 tokens, to the end: still running when the signal lands on a slow machine.
    (want,) = offline.generate(PROMPTS[1:2], TextParams(max_tokens=256, ignore_eos=True))
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=256, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    first = next(iter(stream))
    proc.send_signal(signal.SIGTERM)
    text, finish = _streamed(stream)
    assert (first.choices[0].text + text, finish) == (want.text, "length")
    assert proc.wait(timeout=WAIT_S) == 0
    proc.reader.join(timeout=WAIT_S)  # stderr read to its end
    assert any("drained: 1 requests in flight finished" in line for line in proc.lines)
    with pytest.raises(ConnectionRefusedError):
        _request(url, "GET", "/health", timeout=5)
