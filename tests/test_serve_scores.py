"""What lm-eval's local-completions reads from the server: /v1/completions' `logprobs` and `echo`
equal to the model's own logits (api.load(...).logits: log-softmax, within 1e-4) through the
openai client and raw HTTP, batched prompts of token ids, and the tokenizer endpoints. One live
server in this process (test_serve_abuse's), a random gemma3_tiny on the bundled tokenizer."""

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="needs FastAPI and uvicorn: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="needs the openai client: pip install -e '.[test]'")
from test_serve_abuse import KEY, Live  # noqa: E402

from tunix_train.data.tokenizer import with_bos  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve_scores")


@pytest.fixture(scope="module")
def live():
    server = Live()
    yield server
    server.stop()


def _log_softmax(model, row):
    logits = np.asarray(model.logits(np.asarray([row])), np.float64)[0]
    return logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)


def test_echoed_prompts_score_as_the_logits_do(live):
    """Two prompts of token ids in one request (as lm-eval batches them), max_tokens 0: each
    choice's log-probabilities, its top 5 and their order equal the logits' log-softmax."""
    tokenizer = live.model.tokenizer
    rows = [with_bos(tokenizer, tokenizer.encode(t)) for t in ("To be, or not to be", "Who is there?")]
    status, reply, _ = live.send(
        "/v1/completions", {"prompt": rows, "max_tokens": 0, "echo": True, "logprobs": 5, "temperature": 0}
    )
    assert status == 200, reply
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    for row, choice in zip(rows, reply["choices"]):
        want = _log_softmax(live.model, row)
        got = choice["logprobs"]
        assert choice["text"] == tokenizer.decode(row) == "".join(got["tokens"])
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        np.testing.assert_allclose(
            got["token_logprobs"][1:], want[np.arange(len(row) - 1), row[1:]], atol=1e-4
        )
        for j in range(1, len(row)):
            top = np.sort(want[j - 1])[::-1][:5]
            alternatives = sorted(got["top_logprobs"][j].values(), reverse=True)
            np.testing.assert_allclose(alternatives[:5], top, atol=1e-4)  # with the chosen one: 5 or 6
        offsets = got["text_offset"]
        assert offsets == [sum(len(t) for t in got["tokens"][:k]) for k in range(len(row))]
    assert reply["usage"] == {"prompt_tokens": sum(map(len, rows)), "completion_tokens": 0,
                              "total_tokens": sum(map(len, rows))}  # fmt: skip


def test_the_openai_client_reads_a_completions_logprobs(live):
    """echo with a greedy completion of 4 tokens: the text is the prompt's then the engine's, and the
    generated tokens' log-probabilities are the logits' over the whole sequence."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key=KEY, max_retries=0)
    prompt = "To be, or not"
    got = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True
    ).choices[0]
    new = live.model.generate([prompt], 4)[0]
    row = with_bos(live.model.tokenizer, live.model.tokenizer.encode(prompt)) + new
    assert got.text == live.model.tokenizer.decode(row[:-4]) + live.model.generate_text([prompt], 4)[0]
    want = _log_softmax(live.model, row)
    np.testing.assert_allclose(
        got.logprobs.token_logprobs[1:], want[np.arange(len(row) - 1), row[1:]], atol=1e-4
    )
    assert all(len(top) in (2, 3) for top in got.logprobs.top_logprobs[1:])
    alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=0)
    np.testing.assert_allclose(
        alone.choices[0].logprobs.token_logprobs, got.logprobs.token_logprobs[-4:], atol=1e-6
    )
    assert alone.choices[0].text == live.model.generate_text([prompt], 4)[0]


def test_the_tokenizer_endpoints_are_the_models_tokenizer(live):
    tokenizer = live.model.tokenizer
    status, info, _ = live.send("/tokenizer_info", method="GET")
    assert status == 200 and info["model_max_length"] == 96
    for special, name in ((tokenizer.eos_id, "eos_token"), (tokenizer.bos_id, "bos_token")):
        _, got, _ = live.send("/tokenize", {"prompt": info[name], "add_special_tokens": False})
        assert got["tokens"] == [special]  # lm-eval's RemoteTokenizer reads EOS's id so
    text = "To be, or not to be"
    _, got, _ = live.send("/tokenize", {"prompt": text})
    assert got["tokens"] == with_bos(tokenizer, tokenizer.encode(text)) and got["count"] == len(got["tokens"])
    _, plain, _ = live.send("/tokenize", {"prompt": text, "add_special_tokens": False})
    assert plain["tokens"] == tokenizer.encode(text)
    _, back, _ = live.send("/detokenize", {"tokens": plain["tokens"]})
    assert back == {"prompt": text}
