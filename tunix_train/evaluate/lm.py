"""lm-eval's model for any checkpoint api.load reads (a run, its adapters merged; a Hugging Face
directory; a GGUF file), on any mesh: loglikelihoods teacher-forced through generate/scoring.py,
generations through the engine, all requests of a kind in one batched call.

Registered with lm-eval as "tunix_train" once this module is imported:

    import lm_eval, tunix_train.evaluate.lm
    lm_eval.simple_evaluate(model="tunix_train", model_args={"pretrained": PATH}, tasks=[...])

Tokens are as lm-eval's API models make them: the text's ids, BOS first only with add_bos_token
(None: where the tokenizer adds one, as training and generation here do), so that
add_bos_token=False scores as `local-completions` against our server does.
"""

from __future__ import annotations

from typing import Any

import lm_eval.models  # noqa: F401 - lm-eval's own models first: it imports them only into an empty registry
from lm_eval import utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model


@register_model("tunix_train")
class TunixLM(TemplateLM):
    def __init__(
        self,
        pretrained: Any = None,
        mesh_shape: Any = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        add_bos_token: bool | None = None,
        seed: int = 0,
        **torch_only: Any,  # lm-eval's device and max_batch_size, for torch models: unused here
    ):
        super().__init__()
        if unknown := sorted(set(torch_only) - {"device", "max_batch_size"}):
            raise TypeError(f"tunix_train's lm-eval model takes no argument {unknown[0]!r}")
        from tunix_train.generate.loaded import LoadedModel, load

        model = pretrained if isinstance(pretrained, LoadedModel) else load(pretrained, mesh_shape)
        if model.tokenizer is None:
            from tunix_train.config import ConfigError

            raise ConfigError("this checkpoint carries no tokenizer, which lm-eval's tasks need (text)")
        self.model, self.tokenizer = model, model.tokenizer
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8  # "auto": 8
        self.max_length = int(max_length or model.config.context_length or 2048)
        self.max_gen_toks, self.seed = int(max_gen_toks), int(seed)
        self.add_bos_token = self.tokenizer.add_bos if add_bos_token is None else _bool(add_bos_token)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id if self.tokenizer.bos_id >= 0 else self.tokenizer.eos_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self.tokenizer.encode(string)
        bos = self.add_bos_token if add_special_tokens is None else add_special_tokens
        return [self.tokenizer.bos_id, *ids] if bos and self.tokenizer.bos_id >= 0 else ids

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether each continuation token was the likeliest) of
        each (key, context ids, continuation ids); a row longer than max_length + 1 loses its start."""
        rows = [(context + continuation)[-(self.max_length + 1) :] for _, context, continuation in requests]
        answers = []
        for (key, _, continuation), scored in zip(requests, self.model.score(rows, batch=self.batch_size)):
            n = len(continuation)
            answer = (float(scored.logprobs[-n:].astype("float64").sum()), bool(scored.greedy[-n:].all()))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            answers.append(answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each text's log-likelihood in windows of max_length tokens, each conditioned on the
        one token before it (the first on prefix_token_id), as lm-eval's models compute it."""
        windows, owners = [], []
        for i, (text,) in enumerate(r.args for r in requests):
            rolling = utils.get_rolling_token_windows(
                token_list=self.tok_encode(text, add_special_tokens=False),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(utils.make_disjoint_window, rolling):
                windows.append((None, *window))
                owners.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued by the engine (greedy unless do_sample and a temperature) up to
        max_gen_toks tokens or the first of its `until` strings, which is cut off."""
        from tunix_train.generate import Request, Sampling

        engine_requests, stops = [], []
        for i, (context, settings) in enumerate(r.args for r in requests):
            settings = dict(settings)
            until = settings.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new = int(settings.get("max_gen_toks", self.max_gen_toks))
            sampled = settings.get("do_sample", settings.get("temperature", 0.0) > 0)
            temperature = float(settings.get("temperature", 1.0)) if sampled else 0.0
            prompt = self.tok_encode(context)[-max(self.max_length - new, 1) :]
            sampling = Sampling(temperature, settings.get("top_k"), settings.get("top_p"))
            engine_requests.append(Request(tuple(prompt), new, sampling, self.seed, i, tuple(until)))
            stops.append(until)
        texts = []
        for request, until, done in zip(requests, stops, self.model.complete(engine_requests)):
            text = self.tokenizer.decode(done.tokens)
            for stop in until:
                text = text.split(stop)[0] if stop else text
            self.cache_hook.add_partial("generate_until", request.args, text)
            texts.append(text)
        return texts


def _bool(value: Any) -> bool:
    """A model_args value: a bool, or lm-eval's string form ("True", "false")."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError(f"add_bos_token={value!r} must be true or false")
