"""A small Python API for notebooks: load a checkpoint onto a mesh and compute logits.

    from tunix_train import api
    model = api.load("outputs/default/2026-11-22/10-00-00")       # a run (its latest checkpoint)
    model = api.load("/models/gemma-3-1b-pt", mesh_shape=[[4, 1], ["fsdp", "tp"]])  # Hugging Face
    logits = model.logits([[2, 651, 6037]])                           # [batch, positions, vocab]

    model.generate([[2, 651, 6037]], max_new_tokens=32)              # new token ids per prompt
    model.generate_text(["To be, or not"], max_new_tokens=32, temperature=0.7, top_p=0.9)

`path` is a GGUF file (llama.cpp's format), a Hugging Face Gemma directory (config.json +
safetensors), or a tunix_train run directory, its checkpoints/ folder, or one step's folder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from omegaconf import OmegaConf

from tunix_train.checkpoint import resolve_resume_path, restore_params
from tunix_train.config import (
    Config,
    ConfigError,
    LoraConfig,
    ModelConfig,
    Remat,
    reads_text,
    without_retired_keys,
)
from tunix_train.data.chat import ChatTemplate, check_messages, find_template
from tunix_train.data.tokenizer import Tokenizer, carries_tokenizer, load_tokenizer, run_tokenizer, with_bos
from tunix_train.files import write_text
from tunix_train.generate import Completion, Engine, Request, Sampling
from tunix_train.generate.session import before_stop
from tunix_train.interop import checkpoint_format, gguf, hf, importer, peft
from tunix_train.observe.memory import MemoryErrors
from tunix_train.parallel import model_graphdef
from tunix_train.sharding import LOGICAL_RULES, make_mesh, validate_model_for_mesh
from tunix_train.train.init import ParamsPlan, plan_params
from tunix_train.train.setup import frozen_as_recorded
from tunix_train.train.weights import Weights


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    mesh: Mesh
    params: nnx.State  # sharded over `mesh`
    tokenizer: Optional[Tokenizer] = None  # the checkpoint's, where it carries one
    stop_ids: tuple[int, ...] = ()  # tokens that end a generated sequence (EOS)
    # A LoRA run's adapters and their settings; `params` then holds them merged into the base.
    adapters: Optional[nnx.State] = None
    lora: Optional[LoraConfig] = None
    chat: Optional[ChatTemplate] = None  # the chat template, where the model has a tokenizer

    def __post_init__(self):
        # one forward pass of the whole stack on every device: positions whole, layers not pipelined
        graphdef = model_graphdef(self.config, Remat.none, rules=LOGICAL_RULES.replace(seq=()))
        self._forward = jax.jit(
            lambda params, micro: nnx.merge(graphdef, params)(
                micro["inputs"], micro["positions"], micro["segment_ids"]
            )
        )
        self.engine = Engine(
            self.config,
            self.mesh,
            self.stop_ids,
            decode=None if self.tokenizer is None else self.tokenizer.decode,
        )

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 0,
        on_tokens: Optional[Callable[[int, list[int]], None]] = None,
    ) -> list[list[int]]:
        """New token ids for each prompt (token ids, or text encoded with BOS by the tokenizer),
        without the stop token: greedy at temperature 0, else sampled (prompt i draws from
        fold_in(key(seed), i): same seed, same tokens on any mesh and beside any other prompt).
        on_tokens(prompt index, new tokens) as they are produced."""
        return [
            c.tokens
            for c in self.complete(
                self.requests(prompts, max_new_tokens, temperature, top_k, top_p, seed), on_tokens
            )
        ]

    def requests(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 0,
    ) -> list[Request]:
        """The engine's requests for `prompts` (see generate)."""
        sampling = Sampling(temperature, top_k, top_p)
        return [
            Request(tuple(self._encode(p) if isinstance(p, str) else p), max_new_tokens, sampling, seed, i)
            for i, p in enumerate(prompts)
        ]

    def complete(
        self, requests: Sequence[Request], on_tokens: Optional[Callable[[int, list[int]], None]] = None
    ) -> list[Completion]:
        """Each request's completion: its tokens, their log-probabilities, why it ended."""
        with MemoryErrors(None, self.mesh, training=False, first_tips=self._memory_tips(requests)):
            return self.engine.generate(self.params, requests, on_tokens=on_tokens)

    def stream(
        self, prompt: Sequence[int] | str, max_new_tokens: int, **sampling: Any
    ) -> Iterator[list[int]]:
        """The new tokens of one prompt, a chunk at a time, as they are produced."""
        (request,) = self.requests([prompt], max_new_tokens, **sampling)
        with MemoryErrors(None, self.mesh, training=False, first_tips=self._memory_tips([request])):
            yield from self.engine.stream(self.params, request)

    def _memory_tips(self, requests: Sequence[Request]) -> list[str]:
        return [
            f"fewer prompts at once ({len(requests)} now)",
            f"shorter prompts (the longest has {max((len(r.prompt) for r in requests), default=0)} tokens)",
            f"max_new_tokens={max(max((r.max_new_tokens for r in requests), default=2) // 2, 1)}",
        ]

    def reply(self, messages: Sequence[dict], max_new_tokens: int, **sampling: Any) -> Iterator[str]:
        """The assistant's reply to a conversation ([{role, content}], rendered with the chat
        template and its generation prompt), as pieces of text while it is produced; it ends at
        the template's end of turn (not included). Keyword arguments as for generate."""
        chat = self._need_chat()
        end = chat.end_of_turn()
        prompt, _ = chat.encode(
            check_messages(list(messages), "the conversation"), add_generation_prompt=True
        )
        (request,) = self.requests([prompt], max_new_tokens, **sampling)
        if end and len(self.tokenizer.encode(end)) > 1:  # not one token: the engine stops at its text
            request = dataclasses.replace(request, stop_strings=(end,))
        ids, shown = [], ""
        with MemoryErrors(None, self.mesh, training=False, first_tips=self._memory_tips([request])):
            for new in self.engine.stream(self.params, request):
                ids.extend(new)
                text, _ = before_stop(self.tokenizer.decode(ids), [end] if end else [], final=False)
                if len(text) > len(shown):
                    yield text[len(shown) :]
                    shown = text

    def _need_chat(self) -> ChatTemplate:
        self._need_tokenizer()
        return self.chat

    def generate_text(self, texts: Sequence[str], max_new_tokens: int, **sampling: Any) -> list[str]:
        """The continuation of each text, decoded; keyword arguments as for generate."""
        return [self._decode(ids) for ids in self.generate(list(texts), max_new_tokens, **sampling)]

    def export(self, directory: Path) -> None:
        """A Hugging Face checkpoint: config.json, model.safetensors (float32) and the tokenizer
        (tokenizer.json or tokenizer.model) with its chat template (chat_template.jinja, where
        transformers reads it), where the model has one."""
        hf.export(self.params, self.config, directory)
        if self.tokenizer is not None and jax.process_index() == 0:
            self.tokenizer.save(directory)
            write_text(directory / "chat_template.jinja", self.chat.template)

    def export_gguf(self, path: Path, dtype: str = "f16", overwrite: bool = False) -> None:
        """A GGUF file that llama.cpp, Ollama and LM Studio run: the weights in `dtype` (f32, f16,
        bf16, q8_0, q4_0), the tokenizer and the chat template (interop/gguf_export.py)."""
        from tunix_train.interop import gguf_export

        gguf_export.export(
            self.params,
            self.config,
            self.tokenizer,
            self.chat and self.chat.template,
            Path(path),
            dtype,
            overwrite,
        )

    def export_adapters(
        self, path: Path, format: str = "peft", dtype: str = "f16", overwrite: bool = False
    ) -> None:
        """A LoRA run's adapters, for the base its run started from: in PEFT's format (a directory:
        interop/peft.py), or as a llama.cpp LoRA adapter GGUF (format="gguf": interop/gguf_export.py)."""
        if self.adapters is None:
            raise ConfigError(
                "this checkpoint has no LoRA adapters (training.lora.rank was null): export the "
                "whole model instead"
            )
        if format == "gguf":
            from tunix_train.interop import gguf_export

            gguf_export.export_adapters(self.adapters, self.config, self.lora, Path(path), dtype, overwrite)
        else:
            peft.export(self.adapters, self.config, self.lora, Path(path))

    def _encode(self, text: str) -> list[int]:
        tokenizer = self._need_tokenizer()
        return with_bos(tokenizer, tokenizer.encode(text))

    def _decode(self, ids: list[int]) -> str:
        return self._need_tokenizer().decode(ids)

    def _need_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ConfigError("this checkpoint carries no tokenizer: pass token ids instead of text")
        return self.tokenizer

    def logits(self, tokens: Any, positions: Any = None, segment_ids: Any = None) -> np.ndarray:
        """float32 next-token logits [B, T, V] for token ids [B, T] (one document per row by default)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape
        micro = {
            "inputs": tokens,
            "positions": jnp.broadcast_to(jnp.arange(T), (B, T))
            if positions is None
            else jnp.asarray(positions),
            "segment_ids": jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids),
        }
        with jax.set_mesh(self.mesh):
            return np.asarray(self._forward(self.params, micro))


def run_config(path: Path) -> Config:
    """The Config saved in a run directory (found from the run, checkpoints or step folder)."""
    for folder in (path, *path.parents):
        saved = folder / ".hydra" / "config.yaml"
        if saved.is_file():
            recorded = without_retired_keys(OmegaConf.to_container(OmegaConf.load(saved)))
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), recorded))
    raise ConfigError(f"{path}: no .hydra/config.yaml in it or above it; is it a tunix_train run?")


def load(path: str | Path, mesh_shape: Any = None, devices: list[jax.Device] | None = None) -> LoadedModel:
    """Parameters of a Hugging Face or native checkpoint, sharded over `mesh_shape` (default: all
    devices on fsdp)."""
    path = Path(path).expanduser().resolve()
    mesh_shape = mesh_shape or [[-1], ["fsdp"]]
    kind = checkpoint_format(path)
    if kind == "gguf":
        cfg = Config(model=ModelConfig(name=path.stem, **gguf.model_fields(gguf.open_gguf(path), path)))
    elif kind == "hf":
        cfg = Config(model=ModelConfig(name=path.name, **hf.model_fields_from_hf(hf.read_hf_config(path))))
    else:
        resolve_resume_path(str(path))
        cfg = run_config(path)
    mesh = make_mesh(mesh_shape, devices)
    validate_model_for_mesh(cfg.model, mesh)
    weights = Weights.for_run(cfg, keeps_reference=False)  # a run's LoRA adapters, if it had them
    plan = plan_params(cfg.model, mesh, cfg.training.seed, weights)
    adapters = None
    with MemoryErrors(cfg, mesh, training=False):
        if kind != "run":
            params = importer(path).load_params(path, cfg.model, plan.abstract)
        else:
            params, record = restore_params(str(path), plan.trainable)
            if weights.lora is not None:  # the base comes from where the run started
                with jax.set_mesh(mesh):
                    adapters, base = (
                        params,
                        frozen_as_recorded(
                            cfg, record.get("frozen"), lambda: _starting_base(cfg, plan, weights)
                        ),
                    )
                    params = weights.merged(adapters, base)
    tokenizer, stop_ids = _tokenizer_and_stops(path, cfg)
    chat = None
    if tokenizer is not None:
        source = run_tokenizer(cfg)[0] if kind == "run" else path
        chat = ChatTemplate(*find_template(cfg.data.chat_template, source), tokenizer)
        end = tokenizer.encode(chat.end_of_turn())
        if len(end) == 1:  # as an instruction-tuned Gemma's generation_config lists <end_of_turn>
            stop_ids = tuple(dict.fromkeys((*stop_ids, *end)))
    return LoadedModel(cfg.model, mesh, params, tokenizer, stop_ids, adapters, weights.lora, chat)


def _starting_base(cfg: Config, plan: ParamsPlan, weights: Weights) -> nnx.State:
    """A LoRA run's frozen base as the run started it: model.init_from's weights, or fresh from
    training.seed."""
    if not cfg.model.init_from:
        return plan.fresh_frozen()
    return weights.frozen_base(
        importer(cfg.model.init_from).load_params(Path(cfg.model.init_from), cfg.model, plan.base)
    )


def _tokenizer_and_stops(path: Path, cfg: Config) -> tuple[Optional[Tokenizer], tuple[int, ...]]:
    """A GGUF's or a Hugging Face directory's own tokenizer and EOS ids (config.json and
    generation_config.json add theirs); a run's tokenizer (as its training read text) and its EOS."""
    if checkpoint_format(path) != "run":
        tokenizer = (
            load_tokenizer(path, cfg.model.vocab_size, "tokenizer") if carries_tokenizer(path) else None
        )
        stops: list[int] = [tokenizer.eos_id] if tokenizer else []
        for name in ("config.json", "generation_config.json"):
            if (path / name).is_file():
                eos = json.loads((path / name).read_text()).get("eos_token_id")
                stops += [eos] if isinstance(eos, int) else list(eos or [])
        return tokenizer, tuple(dict.fromkeys(stops))
    if not reads_text(cfg.data):
        return None, ()
    source, key = run_tokenizer(cfg)
    tokenizer = load_tokenizer(source, cfg.model.vocab_size, key)
    return tokenizer, (tokenizer.eos_id,)
