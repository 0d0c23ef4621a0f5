"""A model loaded for generation: its parameters on a mesh (interop/loader.py), its tokenizer and
chat template, and the engine (engine.py) behind generate, stream, reply and logits. The notebook
API (tunix_train/api.py), the generation CLI, the server and export use it.
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

from tunix_train.config import (
    ConfigError,
    LoraConfig,
    ModelConfig,
    Remat,
    reads_text,
)
from tunix_train.data.chat import ChatTemplate, check_messages, find_template
from tunix_train.data.images import ImageTokens, split_images
from tunix_train.data.tokenizer import Tokenizer, carries_tokenizer, load_tokenizer, run_tokenizer, with_bos
from tunix_train.files import write_text
from tunix_train.generate.engine import Completion, Engine, Request, Tuning
from tunix_train.generate.sampling import Sampling
from tunix_train.generate.scoring import Scored, Scorer
from tunix_train.generate.session import before_stop
from tunix_train.generate.speculative import Speculation
from tunix_train.interop import hf, loader, peft
from tunix_train.observe.memory import MemoryErrors
from tunix_train.parallel import model_graphdef
from tunix_train.sharding import LOGICAL_RULES, make_mesh, mesh_over, validate_model_for_mesh


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
                micro["inputs"], micro["positions"], micro["segment_ids"], images=micro.get("images")
            )
        )
        self.engine = Engine(
            self.config,
            self.mesh,
            self.stop_ids,
            decode=None if self.tokenizer is None else self.tokenizer.decode,
        )
        self._scorer = Scorer(graphdef, self.mesh, self.config.vocab_size)
        self._speculating: dict = {}  # engine_for's engines, by (k, lookup, draft)
        self._drafts: dict[tuple, LoadedModel] = {}  # load_draft's draft models, by (path, mesh)

    def score(self, rows: Sequence[Sequence[int]], top: int = 0, batch: int = 8) -> list[Scored]:
        """Each row of token ids scored teacher-forced (scoring.py): log p(token | tokens before
        it) for its tokens after the first, whether each was the most likely, and the `top` most
        likely tokens at each position."""
        with MemoryErrors(None, self.mesh, training=False, first_tips=[f"batch={max(batch // 2, 1)}"]):
            return self._scorer(self.params, rows, top, batch)

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int,
        on_tokens: Optional[Callable[[int, list[int]], None]] = None,
        draft: Any = None,
        speculative_tokens: int = 4,
        adaptive_speculation: bool = False,
        **sampling: Any,
    ) -> list[list[int]]:
        """New token ids for each prompt (token ids, or text encoded with BOS by the tokenizer),
        without the stop token: greedy at temperature 0, else sampled (prompt i draws from
        fold_in(key(seed), i): same seed, same tokens on any mesh and beside any other prompt).
        on_tokens(prompt index, new tokens) as they are produced. draft: speculative decoding with
        a draft model (a checkpoint's path, or a LoadedModel on these devices: load_draft),
        speculative_tokens drafted a round (adaptive_speculation: as many of up to
        speculative_tokens as pay, the rows' acceptance and the programs' speed measured as they
        run: adaptive.py), or as a Speculation says (speculative.py: prompt lookup); the same
        tokens greedily, the same distribution sampled. sampling: requests' keywords."""
        requests = self.requests(prompts, max_new_tokens, **sampling)
        done = self.complete(requests, on_tokens, draft, speculative_tokens, adaptive_speculation)
        return [c.tokens for c in done]

    def requests(
        self,
        prompts: Sequence[Sequence[int] | str],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: Optional[int] = None,
        top_p: Optional[float] = None,
        seed: int = 0,
        images: Optional[Sequence[Any]] = None,
    ) -> list[Request]:
        """The engine's requests for `prompts` (see generate). images: per prompt, its images' pixel
        values [I, C, H, W] in the order of its placeholders, or None."""
        sampling = Sampling(temperature, top_k, top_p)
        images = [None] * len(prompts) if images is None else images
        return [
            Request(
                tuple(self._encode(p) if isinstance(p, str) else p),
                max_new_tokens,
                sampling,
                seed,
                i,
                images=None if pixels is None else np.asarray(pixels, np.float32),
            )
            for i, (p, pixels) in enumerate(zip(prompts, images, strict=True))
        ]

    def complete(
        self,
        requests: Sequence[Request],
        on_tokens: Optional[Callable[[int, list[int]], None]] = None,
        draft: Any = None,
        speculative_tokens: int = 4,
        adaptive_speculation: bool = False,
    ) -> list[Completion]:
        """Each request's completion: its tokens, their log-probabilities, why it ended (draft,
        speculative_tokens: as generate takes them)."""
        engine, draft_params = self.engine_for(draft, speculative_tokens, adaptive_speculation)
        with MemoryErrors(None, self.mesh, training=False, first_tips=self._memory_tips(requests)):
            return engine.generate(self.params, requests, on_tokens=on_tokens, draft_params=draft_params)

    def stream(
        self,
        prompt: Sequence[int] | str,
        max_new_tokens: int,
        images: Any = None,
        draft: Any = None,
        speculative_tokens: int = 4,
        adaptive_speculation: bool = False,
        **sampling: Any,
    ) -> Iterator[list[int]]:
        """The new tokens of one prompt, a chunk at a time, as they are produced (images: its
        pixel values [n, C, H, W]; draft, speculative_tokens: as generate takes them)."""
        (request,) = self.requests([prompt], max_new_tokens, images=[images], **sampling)
        engine, draft_params = self.engine_for(draft, speculative_tokens, adaptive_speculation)
        with MemoryErrors(None, self.mesh, training=False, first_tips=self._memory_tips([request])):
            yield from engine.stream(self.params, request, draft_params)

    def engine_for(self, draft: Any, tokens: int = 4, adaptive: bool = False) -> tuple[Engine, Any]:
        """The engine for `draft` (as speculation_for takes it; None: the plain one), made once
        per draft, and the draft model's parameters (or None)."""
        speculation, draft_params = self.speculation_for(draft, tokens, adaptive)
        if speculation is None:
            return self.engine, None
        key = (speculation.tokens, speculation.lookup, id(speculation.draft), speculation.adaptive)
        key += (speculation.draft_mesh_shape,)
        if key not in self._speculating:
            self._speculating[key] = Engine(
                self.config,
                self.mesh,
                self.stop_ids,
                decode=None if self.tokenizer is None else self.tokenizer.decode,
                tuning=Tuning(speculation=speculation),
            )
        return self._speculating[key], draft_params

    def speculation_for(
        self, draft: Any, tokens: int = 4, adaptive: bool = False
    ) -> tuple[Optional[Speculation], Any]:
        """How to speculate with `draft`: a LoadedModel on this model's devices (load_draft) or a
        checkpoint's path (loaded once, on this mesh), drafting `tokens` a round (adaptive: up to),
        or a Speculation (prompt lookup); None: no speculation. Returns it and the draft model's
        parameters (or None)."""
        if draft is None or isinstance(draft, Speculation):
            if draft is not None and draft.draft is not None:
                raise ConfigError("a Speculation with a draft model: pass the loaded draft model instead")
            return draft, None
        if isinstance(draft, (str, Path)):
            draft = self.load_draft(draft)
        if not isinstance(draft, LoadedModel):
            raise ConfigError(f"draft={draft!r}: give a loaded model, a checkpoint's path or a Speculation")
        if list(draft.mesh.devices.flat) != list(self.mesh.devices.flat):
            raise ConfigError(
                "a draft model must be loaded on the model's devices, in their order: load it with "
                "LoadedModel.load_draft"
            )
        shape = None if draft.mesh == self.mesh else _mesh_shape(draft.mesh)
        return Speculation(tokens, draft.config, adaptive=adaptive, draft_mesh_shape=shape), draft.params

    def load_draft(self, path: str | Path, mesh_shape: Any = None) -> LoadedModel:
        """A draft model for this one from a checkpoint's path (loaded once), on this model's
        devices: on its mesh, or split by `mesh_shape` (Speculation.draft_mesh: e.g. [[8], ["dp"]]
        puts the whole draft on each device beside a model split over tp)."""
        mesh = self.mesh if mesh_shape is None else mesh_over(mesh_shape, self.mesh, "draft_mesh_shape")
        key = (str(path), mesh)
        if key not in self._drafts:
            try:
                self._drafts[key] = _load_on(loader.source(path), mesh)
            except ConfigError as err:
                raise ConfigError(f"the draft {path}: {err}") from None
        return self._drafts[key]

    def _memory_tips(self, requests: Sequence[Request]) -> list[str]:
        return [
            f"fewer prompts at once ({len(requests)} now)",
            f"shorter prompts (the longest has {max((len(r.prompt) for r in requests), default=0)} tokens)",
            f"max_new_tokens={max(max((r.max_new_tokens for r in requests), default=2) // 2, 1)}",
        ]

    def reply(
        self,
        messages: Sequence[dict],
        max_new_tokens: int,
        images_from: Optional[Path] = None,
        draft: Any = None,
        speculative_tokens: int = 4,
        adaptive_speculation: bool = False,
        **sampling: Any,
    ) -> Iterator[str]:
        """The assistant's reply to a conversation ([{role, content}], rendered with the chat
        template and its generation prompt), as pieces of text while it is produced; it ends at
        the template's end of turn (not included). Contents may hold image parts (a model with
        model.vision): files relative to images_from (None: any local path), data: URIs or bytes.
        Keyword arguments as for generate."""
        chat = self._need_chat()
        end = chat.end_of_turn()
        plain, payloads = split_images(check_messages(list(messages), "the conversation", parts=True))
        images = self.pixel_values(payloads, images_from, "the conversation") if payloads else None
        prompt, _ = chat.encode(plain, add_generation_prompt=True, images=images)
        (request,) = self.requests([prompt], max_new_tokens, images=[images], **sampling)
        if end and len(self.tokenizer.encode(end)) > 1:  # not one token: the engine stops at its text
            request = dataclasses.replace(request, stop_strings=(end,))
        ids, shown = [], ""
        engine, draft_params = self.engine_for(draft, speculative_tokens, adaptive_speculation)
        with MemoryErrors(None, self.mesh, training=False, first_tips=self._memory_tips([request])):
            for new in engine.stream(self.params, request, draft_params):
                ids.extend(new)
                text, _ = before_stop(self.tokenizer.decode(ids), [end] if end else [], final=False)
                if len(text) > len(shown):
                    yield text[len(shown) :]
                    shown = text

    def pixel_values(self, payloads: Sequence[Any], folder: Optional[Path], where: str) -> np.ndarray:
        """Images (paths, data: URIs, bytes) as the tower takes them [n, C, H, W]; a one-line error
        for a model without a tower or a tokenizer without Gemma 3's image tokens."""
        from tunix_train.data.images import pixel_stack

        vision = self.config.vision
        if vision is None:
            raise ConfigError("this model reads no images (its model.vision is null)")
        if self.chat is None or self.chat.image_tokens is None:
            raise ConfigError(
                "this model's tokenizer lacks Gemma 3's image tokens (<start_of_image>, <image_soft_token>, "
                "<end_of_image>), so a prompt cannot hold an image"
            )
        return pixel_stack(payloads, vision, folder, where)

    def image_prompt(self, text: str, images: Sequence[str]) -> tuple[list[int], np.ndarray]:
        """A text prompt and image files: each <start_of_image> in the text takes an image in order
        (with none, the images go in front of the text), expanded to the tower's tokens; [BOS] first."""
        pixels = self.pixel_values(images, None, "--image")
        tokens = self.chat.image_tokens
        marks = text.count(tokens.marker)
        if marks == 0:
            text, marks = tokens.marker * len(images) + text, len(images)
        if marks != len(images):
            raise ConfigError(f"the prompt has {marks} {tokens.marker} but {len(images)} images were given")
        return self._encode(tokens.expand(text, [], pixels)[0]), pixels

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
        tokenizer = self.tokenizer
        special = None
        if tokenizer is not None:
            special = {
                "bos_token_id": tokenizer.bos_id if tokenizer.bos_id >= 0 else None,
                "eos_token_id": list(self.stop_ids) if len(self.stop_ids) > 1 else tokenizer.eos_id,
                "pad_token_id": tokenizer.pad_id if tokenizer.pad_id >= 0 else None,
            }
        hf.export(self.params, self.config, directory, special)
        if self.tokenizer is not None and jax.process_index() == 0:
            self.tokenizer.save(directory)
            write_text(directory / "chat_template.jinja", self.chat.template)

    def export_gguf(
        self, path: Path, dtype: str = "f16", overwrite: bool = False, mmproj: Optional[Path] = None
    ) -> None:
        """A GGUF file that llama.cpp, Ollama and LM Studio run: the weights in `dtype` (f32, f16,
        bf16, q8_0, q4_0), the tokenizer and the chat template (interop/gguf_export.py); mmproj:
        also the image tower as llama.cpp's projector file (interop/gguf_mmproj.py: f32 when dtype
        is, else f16), checked before either is written."""
        from tunix_train.interop import gguf_export, gguf_mmproj

        tower_dtype = "f32" if dtype == "f32" else "f16"
        if mmproj is not None:
            gguf_mmproj.check(self.config, Path(mmproj), tower_dtype, overwrite)

        gguf_export.export(
            self.params,
            self.config,
            self.tokenizer,
            self.chat and self.chat.template,
            Path(path),
            dtype,
            overwrite,
        )
        if mmproj is not None:
            gguf_mmproj.export(self.params, self.config, Path(mmproj), tower_dtype, overwrite)

    def export_adapters(
        self, path: Path, format: str = "peft", dtype: str = "f16", overwrite: bool = False
    ) -> None:
        """A LoRA run's adapters, for the base its run started from: in PEFT's format (a directory:
        interop/peft.py; a reward model's head with them), or as a llama.cpp LoRA adapter GGUF
        (format="gguf": interop/gguf_export.py)."""
        if self.adapters is None:
            raise ConfigError(
                "this checkpoint has no LoRA adapters (training.lora.rank was null): export the "
                "whole model instead"
            )
        if "score_DO" in self.adapters and format == "gguf":
            raise ConfigError(
                "this LoRA run trained a scalar head beside its adapters (a reward model), which a "
                "llama.cpp adapter cannot hold: export the adapters in PEFT's format or the merged model"
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

    def logits(
        self, tokens: Any, positions: Any = None, segment_ids: Any = None, images: Any = None
    ) -> np.ndarray:
        """float32 next-token logits [B, T, V] for token ids [B, T] (one document per row by default);
        images: each row's pixel values [B, I, C, H, W] (data/images.py), in the order of its image
        placeholders (a row with fewer images leaves the rest unread)."""
        tokens = jnp.asarray(tokens, jnp.int32)
        B, T = tokens.shape
        micro = {
            "inputs": tokens,
            "positions": jnp.broadcast_to(jnp.arange(T), (B, T))
            if positions is None
            else jnp.asarray(positions),
            "segment_ids": jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids),
        }
        if images is not None:
            if self.config.vision is None:
                raise ConfigError("images given to a text-only model (its model.vision is null)")
            micro["images"] = jnp.asarray(images, jnp.float32)
        with jax.set_mesh(self.mesh):
            return np.asarray(self._forward(self.params, micro))


def load(path: str | Path, mesh_shape: Any = None, devices: list[jax.Device] | None = None) -> LoadedModel:
    """Parameters of a Hugging Face, GGUF or native checkpoint (interop/loader.py), sharded over
    `mesh_shape` (default: all devices on fsdp), with the checkpoint's tokenizer and chat template."""
    src = loader.source(path)
    return _load_on(src, make_mesh(mesh_shape or [[-1], ["fsdp"]], devices))


def _load_on(src: loader.Source, mesh: Mesh) -> LoadedModel:
    cfg = src.cfg
    validate_model_for_mesh(cfg.model, mesh)
    with MemoryErrors(cfg, mesh, training=False):
        loaded = loader.load(src, mesh)
    tokenizer, stop_ids = _tokenizer_and_stops(src)
    chat = None
    if tokenizer is not None:
        template_source = run_tokenizer(cfg)[0] if src.kind == "run" else src.path
        chat = ChatTemplate(
            *find_template(cfg.data.chat_template, template_source),
            tokenizer,
            _image_tokens(cfg.model, tokenizer),
        )
        end = tokenizer.encode(chat.end_of_turn())
        if len(end) == 1:  # as an instruction-tuned Gemma's generation_config lists <end_of_turn>
            stop_ids = tuple(dict.fromkeys((*stop_ids, *end)))
    return LoadedModel(
        cfg.model, mesh, loaded.params, tokenizer, stop_ids, loaded.adapters, loaded.lora, chat
    )


def _mesh_shape(mesh: Mesh) -> list:
    """A mesh's mesh_shape: [[sizes], [axis names]]."""
    return [list(mesh.shape.values()), list(mesh.shape.keys())]


def _image_tokens(model: ModelConfig, tokenizer: Tokenizer) -> Optional[ImageTokens]:
    """How the chat template's images become tokens, for a model with an image tower whose
    tokenizer has Gemma 3's image tokens (else None: images are refused when given)."""
    if model.vision is None:
        return None
    try:
        return ImageTokens.for_model(tokenizer, model.vision)
    except ConfigError:
        return None


def _tokenizer_and_stops(src: loader.Source) -> tuple[Optional[Tokenizer], tuple[int, ...]]:
    """A GGUF's or a Hugging Face directory's own tokenizer and EOS ids (config.json and
    generation_config.json add theirs); a run's tokenizer (as its training read text) and its EOS."""
    path, cfg = src.path, src.cfg
    if src.kind != "run":
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
