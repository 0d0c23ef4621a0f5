"""The OpenAI-compatible server, through the `openai` client on 127.0.0.1: answers equal the
engine's, streams equal answers, concurrent streams each get the tokens they get alone, bad
requests are 4xx while the server keeps serving, a client that leaves frees its slot, SIGTERM ends it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jax
import pytest

pytestmark = pytest.mark.slow  # a training run and a server in subprocesses: the README's suite stays short

openai = pytest.importorskip("openai", reason="needs the openai client: pip install -e '.[test]'")
pytest.importorskip("fastapi", reason="needs FastAPI and uvicorn: pip install -e '.[serve]'")

from conftest import REPO, cpu_env, run_training  # noqa: E402

from tunix_train import api  # noqa: E402

QUESTION = [{"role": "user", "content": "Who is there?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["plain", "draft"])
def server(tmp_path_factory, request):
    """A 2-step run of gemma3_tiny on the bundled corpus, served with 8 slots on 2 devices; and
    again decoding speculatively, with the run itself as its draft model (--draft): every test
    holds for both."""
    tmp = tmp_path_factory.mktemp("serve")
    run_dir = tmp / "run"
    trained = run_training(
        "model=gemma3_tiny",
        "model.vocab_size=4096",
        "data.seq_len=64",
        "training.max_steps=2",
        'model.mesh_shape=[[1],["fsdp"]]',
        f"hydra.run.dir={run_dir}",
        devices=1,
        timeout=300,
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    port = _free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tunix_train.serve",
            str(run_dir),
            "--port",
            str(port),
            "--slots",
            "8",
            "--max_len",
            "96",
            "--name",
            "tiny",
            "--mesh_shape",
            '[[2],["fsdp"]]',
            *(["--draft", str(run_dir), "--speculative_tokens", "3"] if request.param == "draft" else []),
        ],
        cwd=REPO,
        env=cpu_env(2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{base}/health", timeout=1)
            break
        except (urllib.error.URLError, ConnectionError):
            assert process.poll() is None, process.stderr.read()[-2000:]
            time.sleep(0.25)
    yield run_dir, base, process
    if process.poll() is None:
        process.kill()


def _client(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def _health(base):
    return json.loads(urllib.request.urlopen(f"{base}/health", timeout=5).read())


def test_answers_equal_the_engines_and_streams_equal_answers(server):
    run_dir, base, process = server
    client = _client(base)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    model = api.load(run_dir, mesh_shape=[[1], ["fsdp"]], devices=jax.devices()[:1])
    want = "".join(model.reply(QUESTION, 12))
    got = client.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want and len(want) > 0
    assert got.usage.prompt_tokens == len(model.chat.encode(QUESTION, add_generation_prompt=True)[0])
    stream = client.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    text = client.completions.create(model="tiny", prompt="To be, or not", max_tokens=10, temperature=0)
    assert text.choices[0].text == model.generate_text(["To be, or not"], 10)[0]
    # sampled, with the server's speculation turned off for the request: the engine's own draws of its seed
    sampled = "".join(model.reply(QUESTION, 12, temperature=1.0, seed=5))
    got = client.chat.completions.create(
        model="tiny",
        messages=QUESTION,
        max_tokens=12,
        temperature=1.0,
        seed=5,
        extra_body={"speculative": False},
    )
    assert got.choices[0].message.content == sampled
    metrics = json.loads(urllib.request.urlopen(f"{base}/metrics", timeout=5).read())
    speculating = "--draft" in process.args
    assert ("acceptance_rate" in metrics) == speculating
    if speculating:  # the model is its own draft: every draft is kept (opted-out requests uncounted)
        assert metrics["acceptance_rate"] == 1.0 and metrics["mean_accepted_length"] == 4.0, metrics


def test_concurrent_streams_each_get_their_tokens_alone(server):
    """32 streaming requests at once through 8 slots, sampled with seeds: each text equals the
    text of the same request sent alone."""
    _, base, _ = server
    client = _client(base)

    def ask(i, stream):
        kwargs = dict(model="tiny", prompt=f"Speak {i}:", max_tokens=4 + i % 13, temperature=0.9, seed=i)
        if not stream:
            return client.completions.create(**kwargs).choices[0].text
        return "".join(
            c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices
        )

    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda i: ask(i, True), range(32)))
    alone = [ask(i, False) for i in range(32)]
    assert together == alone and len(set(alone)) > 16
    assert _health(base)["running"] == 0 and _health(base)["queued"] == 0


BAD = [  # (body, status, words in the message)
    (b"{not json", 400, "not valid JSON"),
    (json.dumps({"model": "tiny"}).encode(), 400, "'messages' is a required property"),
    (json.dumps({"model": "gpt-9", "messages": QUESTION}).encode(), 404, "does not exist"),
    (json.dumps({"model": "tiny", "messages": QUESTION, "max_tokens": 0}).encode(), 400, "must be positive"),
    (json.dumps({"model": "tiny", "messages": QUESTION, "speculative": "no"}).encode(), 400, "true or false"),
    (
        json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Speak. " * 80}]}).encode(),
        400,
        "pass this server's 96 tokens",
    ),
    (
        json.dumps({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}).encode(),
        400,
        "unknown role",
    ),
    (json.dumps({"model": "tiny", "messages": QUESTION, "temperature": -1}).encode(), 400, "out of range"),
]


@pytest.mark.parametrize("body, status, words", BAD)
def test_bad_requests_are_4xx_and_the_server_keeps_serving(server, body, status, words):
    _, base, _ = server
    request = urllib.request.Request(
        f"{base}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == status
    error = json.loads(caught.value.read())["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert _client(base).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2).choices


def _metrics(base):
    return json.loads(urllib.request.urlopen(f"{base}/metrics", timeout=5).read())


def _leave_mid_stream(base) -> bool:
    """Reads a 90-token stream's first chunk, then leaves: True when /health saw the request
    running and the engine made fewer than its 90 tokens (the cancel freed the slot), False when
    the engine finished first (90 tokens take about 0.1 s here, so a loaded machine can lose the race)."""
    tokens = _metrics(base).get("tokens", 0)
    stream = _client(base).completions.create(model="tiny", prompt="Now", max_tokens=90, stream=True)
    next(iter(stream))
    running = _health(base)["running"]
    stream.close()
    for _ in range(100):
        if _health(base)["running"] == 0:
            break
        time.sleep(0.1)
    assert _health(base) == {"status": "ok", "model": "tiny", "running": 0, "queued": 0}
    return running == 1 and _metrics(base)["tokens"] - tokens < 90


def test_a_client_that_leaves_frees_its_slot_and_sigterm_ends_the_server(server):
    _, base, process = server
    assert any(_leave_mid_stream(base) for _ in range(5))
    # SIGTERM: the request in flight finishes, then the server exits (uvicorn re-raises the signal
    # once it has shut down, so the status is the signal's)
    stream = _client(base).completions.create(model="tiny", prompt="Now", max_tokens=40, stream=True)
    chunks = iter(stream)
    next(chunks)
    os.kill(process.pid, signal.SIGTERM)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert process.wait(timeout=60) == -signal.SIGTERM
