"""Tokens as lm-eval's `local-completions` reads them: a completion's `logprobs` (with `echo`,
the prompt's), and vLLM's tokenizer endpoints (/tokenizer_info, /tokenize, /detokenize), through
which it tokenizes with this server's own tokenizer."""

from __future__ import annotations

import itertools

from tunix_train.data.tokenizer import with_bos
from tunix_train.serve import schema
from tunix_train.serve.schema import BadRequest


def logprobs(model, ask, requests, generated: list[list[int]]) -> list[dict]:
    """Each choice's `logprobs` as OpenAI's completions write them: its tokens (the prompt's
    first, with echo; the first has none), their log-probabilities under the model (before
    temperature and top-k/top-p, as vLLM's default reports them), at each the ask.logprobs
    likeliest tokens and the chosen one, and where each token's text starts in the choice's."""
    rows = [list(r.prompt) + list(g) for r, g in zip(requests, generated)]
    out = []
    for request, row, scored in zip(requests, rows, model.score(rows, top=ask.logprobs)):
        first = 0 if ask.echo else len(request.prompt)
        pieces = [_piece(model.tokenizer, row, j, row[j]) for j in range(first, len(row))]
        offset = 0 if ask.echo else len(model.tokenizer.decode(list(request.prompt)))
        offsets = list(itertools.accumulate(map(len, pieces[:-1]), initial=offset))
        chosen = [None if j == 0 else float(scored.logprobs[j - 1]) for j in range(first, len(row))]
        top = [
            None
            if j == 0
            else {
                **{
                    _piece(model.tokenizer, row, j, int(t)): float(lp)
                    for t, lp in zip(scored.top_ids[j - 1], scored.top_logprobs[j - 1])
                },
                pieces[j - first]: chosen[j - first],
            }
            for j in range(first, len(row))
        ]
        out.append({"tokens": pieces, "token_logprobs": chosen, "top_logprobs": top, "text_offset": offsets})
    return out


def _piece(tokenizer, row: list[int], j: int, token: int) -> str:
    """The text `token` adds in place of row[j] after row[j - 1] (a piece's leading space is
    lost when it is decoded alone)."""
    decode = tokenizer.decode
    if j == 0:
        return decode([token])
    return decode([row[j - 1], token])[len(decode([row[j - 1]])) :]


def tokenizer_info(tokenizer, max_len: int) -> dict:
    def piece(i):
        return tokenizer.token(i) if i >= 0 else None

    return {
        "eos_token": piece(tokenizer.eos_id),
        "bos_token": piece(tokenizer.bos_id),
        "pad_token": piece(tokenizer.pad_id),
        "model_max_length": max_len,
    }


def tokenize(tokenizer, data: bytes, max_len: int) -> dict:
    """{"prompt": text, "add_special_tokens": BOS first (default true)}: its ids, special tokens
    written in the text read as themselves (a tokenizer's encode of "<eos>" is EOS's id)."""
    body = _fields(data, {"prompt", "add_special_tokens", "model"})
    prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string", "prompt")
    if not isinstance(special, bool):
        raise BadRequest("'add_special_tokens' must be true or false", "add_special_tokens")
    ids = tokenizer.encode_with_offsets(prompt)[0]
    ids = with_bos(tokenizer, ids) if special else ids
    return {"tokens": ids, "count": len(ids), "max_model_len": max_len}


def detokenize(tokenizer, data: bytes) -> dict:
    ids = _fields(data, {"tokens", "model"}).get("tokens")
    if not (
        isinstance(ids, list)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < tokenizer.vocab_size for t in ids)
    ):
        raise BadRequest(f"'tokens' must be a list of token ids in [0, {tokenizer.vocab_size})", "tokens")
    return {"prompt": tokenizer.decode(ids)}


def _fields(data: bytes, known: set) -> dict:
    body = schema.parse_json(data)
    if unknown := sorted(set(body) - known):
        raise BadRequest(f"Unrecognized request argument supplied: {unknown[0][:80]}", unknown[0][:80])
    return body
