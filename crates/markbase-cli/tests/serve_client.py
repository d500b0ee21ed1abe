"""Checks a running `markbase serve` with the official openai Python client.

Usage: serve_client.py SCENARIO BASE_URL API_KEY
Scenarios: basic, concurrency, errors, disconnect, overload. Prints "ok SCENARIO" on success;
a failed check raises (non-zero exit with the reason).
"""

import concurrent.futures
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from http.client import HTTPConnection

import openai

TIMEOUT = 120.0


def client(base, key, **kw):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0, **kw)


def chat(c, content, **kw):
    return c.chat.completions.create(
        model="markbase", messages=[{"role": "user", "content": content}], **kw
    )


def stream_chat(c, content, **kw):
    """Returns (text, finish_reason, usage, chunks) of a streamed reply."""
    chunks = list(
        c.chat.completions.create(
            model="markbase",
            messages=[{"role": "user", "content": content}],
            stream=True,
            **kw,
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finish) == 1, f"one finish_reason expected, got {finish}"
    usage = chunks[-1].usage
    return text, finish[0], usage, chunks


class Resp:
    """A raw HTTP reply (status and body), for what the openai client does not send."""

    def __init__(self, status_code, text):
        self.status_code, self.text = status_code, text

    def json(self):
        return json.loads(self.text)


def http(method, url, body=None, headers=None, timeout=30):
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Resp(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Resp(e.code, e.read().decode())


def post_past_limit(url, size, headers):
    """POSTs a JSON body of `size` bytes, past the server's limit. The server may answer 413 and
    close before it has taken the whole body, which cuts the send short (a broken pipe): the
    reply is read either way."""
    u = urllib.parse.urlsplit(url)
    conn = HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest("POST", u.path)
    for name, value in {"Content-Type": "application/json", "Content-Length": str(size), **headers}.items():
        conn.putheader(name, value)
    conn.endheaders()
    try:
        conn.send(b"{" + b" " * (size - 2) + b"}")
    except (BrokenPipeError, ConnectionResetError):
        pass
    r = conn.getresponse()
    return Resp(r.status, r.read().decode())


def metrics(base):
    text = http("GET", base + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def basic(base, key):
    c = client(base, key)
    models = c.models.list()
    assert len(models.data) == 1 and models.data[0].id, models
    assert http("GET", base + "/health", timeout=10).status_code == 200

    q = "Name three colours."
    whole = chat(c, q, temperature=0, max_tokens=24)
    text = whole.choices[0].message.content
    assert text, whole
    assert whole.choices[0].finish_reason in ("stop", "length"), whole
    assert whole.choices[0].message.role == "assistant"
    u = whole.usage
    assert u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens, u
    assert getattr(whole.choices[0].message, "reasoning_content", None) is None
    assert not whole.choices[0].message.tool_calls

    s_text, s_finish, s_usage, chunks = stream_chat(
        c, q, temperature=0, max_tokens=24, stream_options={"include_usage": True}
    )
    assert s_text == text, f"stream {s_text!r} != non-stream {text!r}"
    assert s_finish == whole.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and s_usage.completion_tokens == u.completion_tokens, s_usage
    assert all(ch.usage is None for ch in chunks[:-1])
    assert len(chunks) >= 4, "the reply should arrive in several chunks"
    # max_completion_tokens is the newer name of the limit.
    short = chat(c, q, temperature=0, max_completion_tokens=3)
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length", short

    # A stop string taken from the greedy reply cuts both forms at the same place.
    words = [w for w in text.split() if len(w) > 2]
    if len(words) >= 2:
        stop = words[1]
        cut = text[: text.index(stop)]
        w = chat(c, q, temperature=0, max_tokens=24, stop=[stop])
        st, sf, _, _ = stream_chat(c, q, temperature=0, max_tokens=24, stop=stop)
        assert w.choices[0].message.content == cut, (w.choices[0].message.content, cut)
        assert st == cut and sf == "stop" and w.choices[0].finish_reason == "stop", (st, sf)

    # Log-probabilities: one entry per token; greedy picks the most likely token.
    lp = chat(c, q, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    entries = lp.choices[0].logprobs.content
    assert len(entries) == lp.usage.completion_tokens, (len(entries), lp.usage)
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0.0, e
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-4, e
    _, _, _, lp_chunks = stream_chat(c, q, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
    streamed = [e for ch in lp_chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]

    # The same seed gives the same sample.
    a = chat(c, q, temperature=0.9, seed=7, max_tokens=8).choices[0].message.content
    b = chat(c, q, temperature=0.9, seed=7, max_tokens=8).choices[0].message.content
    assert a == b, (a, b)

    # System, assistant and tool messages are accepted (the model has no tool syntax).
    conv = c.chat.completions.create(
        model="markbase",
        temperature=0,
        max_tokens=8,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "4"},
        ],
    )
    assert conv.choices[0].message.content is not None

    # Text completions: stream equals non-stream.
    p = "The capital of France is"
    cw = c.completions.create(model="markbase", prompt=p, temperature=0, max_tokens=12)
    cs = list(c.completions.create(model="markbase", prompt=p, temperature=0, max_tokens=12, stream=True))
    assert cw.choices[0].text and "".join(x.choices[0].text for x in cs if x.choices) == cw.choices[0].text
    assert cw.usage.completion_tokens > 0


def concurrency(base, key):
    c = client(base, key)
    prompts = ["Name three colours.", "Count to five.", "What is the sun?", "Say hello in French."]
    alone = {p: chat(c, p, temperature=0, max_tokens=12).choices[0].message.content for p in prompts}
    jobs = [prompts[i % len(prompts)] for i in range(32)]
    before = http("GET", base + "/health", timeout=10).json()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda p: (p, chat(c, p, temperature=0, max_tokens=12).choices[0].message.content), jobs))
    bad = [(p, t, alone[p]) for p, t in got if t != alone[p]]
    assert not bad, f"{len(bad)} of 32 concurrent replies differ from the same request alone: {bad[:3]}"
    # The engine's step counters moved, and /metrics carries the same numbers as /health.
    after = http("GET", base + "/health", timeout=10).json()
    for k in ("steps", "decode_rows", "prefill_rows", "step_seconds"):
        assert after[k] > before[k], (k, before, after)
    for k in ("device_wait_seconds", "device_waits", "graph_replays"):
        assert after[k] >= before[k], (k, before, after)
    assert after["decode_rows"] - before["decode_rows"] > after["steps"] - before["steps"], (before, after)
    m = metrics(base)
    assert m["markbase_engine_steps_total"] >= after["steps"], m
    assert m['markbase_engine_step_rows_total{kind="decode"}'] >= after["decode_rows"], m
    assert m['markbase_engine_step_rows_total{kind="prefill"}'] >= after["prefill_rows"], m
    assert m["markbase_engine_step_seconds"] >= after["step_seconds"], m


def expect_error(resp, status, param=None):
    assert resp.status_code == status, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err


def errors(base, key):
    url = base + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {key}"}
    good = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    expect_error(http("POST", url, b"{not json", auth), 400)
    expect_error(http("POST", url, {"messages": "hi"}, auth), 400, "messages")
    expect_error(http("POST", url, {**good, "temperature": -1}, auth), 400, "temperature")
    expect_error(http("POST", url, {**good, "max_tokens": 10**9}, auth), 400, "max_tokens")
    expect_error(post_past_limit(url, 100_000, auth), 413)
    expect_error(http("POST", url, good), 401)
    expect_error(http("POST", url, good, {"Authorization": "Bearer wrong"}), 401)
    expect_error(http("GET", base + "/v1/models"), 401)
    try:
        chat(client(base, "wrong"), "hi", max_tokens=2)
    except openai.AuthenticationError as e:
        assert e.status_code == 401
    else:
        raise AssertionError("a wrong key was accepted")
    try:
        chat(client(base, key), "hi", max_tokens=2, temperature=-1)
    except openai.BadRequestError as e:
        assert e.status_code == 400
    else:
        raise AssertionError("temperature -1 was accepted")
    assert http("POST", url, good, auth, timeout=60).status_code == 200


def disconnect(base, key):
    c = client(base, key)
    start = metrics(base)
    assert start.get("markbase_kv_blocks_used", 0) == 0, start
    stream = c.chat.completions.create(
        model="markbase",
        messages=[{"role": "user", "content": "Tell me a very long story."}],
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            seen += 1
        if seen >= 5:
            break
    during = metrics(base)
    assert during["markbase_kv_blocks_used"] > 0 and during["markbase_running_sequences"] >= 1, during
    stream.close()
    t0 = time.monotonic()
    while True:
        m = metrics(base)
        if m["markbase_kv_blocks_used"] == 0 and m["markbase_running_sequences"] == 0:
            break
        if time.monotonic() - t0 > 10:
            raise AssertionError(f"KV blocks still in use 10 s after the client left: {m}")
        time.sleep(0.05)
    freed_after = time.monotonic() - t0
    # 1500 tokens would take far longer than this; the sequence was cancelled.
    assert freed_after < 10, freed_after
    print(f"freed {during['markbase_kv_blocks_used']:.0f} KV blocks {freed_after * 1000:.0f} ms after the disconnect")


def overload(base, key):
    c = client(base, key)

    def one(i):
        try:
            chat(c, f"Write a poem number {i}.", temperature=0, max_tokens=32, extra_body={"ignore_eos": True})
            return 200
        except openai.APIStatusError as e:
            body = e.response.json()
            assert set(body["error"]) == {"message", "type", "param", "code"}, body
            return e.status_code

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        codes = list(pool.map(one, range(12)))
    assert 200 in codes, codes
    assert any(code in (429, 503) for code in codes), f"no request was refused: {codes}"
    assert set(codes) <= {200, 429, 503}, codes
    assert http("GET", base + "/health", timeout=10).status_code == 200
    after = chat(c, "Say hi.", temperature=0, max_tokens=4)
    assert after.usage.completion_tokens > 0
    print("status codes under overload:", sorted(codes))


if __name__ == "__main__":
    scenario, base, key = sys.argv[1], sys.argv[2], sys.argv[3]
    {"basic": basic, "concurrency": concurrency, "errors": errors, "disconnect": disconnect, "overload": overload}[scenario](base, key)
    print("ok", scenario)
