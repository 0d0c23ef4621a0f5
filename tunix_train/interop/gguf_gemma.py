"""GGUF conventions of Gemma, Gemma 2 and Gemma 3, as llama.cpp's convert_hf_to_gguf.py writes them
(GemmaModel, Gemma2Model, Gemma3Model) and transformers' GGUF loader reads them back; gguf.py and
gguf_export.py hold what all families share.

- metadata: the sizes every family writes; Gemma 2 and 3: attention.sliding_window; Gemma 2:
  attn_logit_softcapping; final_logit_softcapping where set; linear RoPE scaling where set;
- Q and K rows as transformers holds them (llama.cpp does not permute Gemma's);
- what a file is silent on (the query scale, the layer pattern, the local RoPE base) takes the
  values transformers' config classes assume (Gemma2Config, Gemma3TextConfig).

Each family module holds one GemmaGguf with its architecture's defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tunix_train.config import ConfigError, ModelConfig


@dataclasses.dataclass(frozen=True)
class GemmaGguf:
    architecture: str
    rope_base: float = 10_000.0
    attn_softcap: float | None = None  # written and read as {arch}.attn_logit_softcapping
    final_softcap: float | None = None
    local_per_global: int = 0  # transformers' default layer pattern where the file gives none
    window: int | None = None  # sliding window where the file gives none; None: no local layers
    local_rope_base: float = 10_000.0
    # the 27B model's layer count, whose query scale llama.cpp takes from the width (query_scale)
    layers_of_27b: int | None = None
    qk_interleaved: bool = False
    stacked_experts: bool = False

    def fields(self, file) -> dict[str, Any]:
        key = file.key
        layers, embed, heads = key("block_count"), key("embedding_length"), key("attention.head_count")
        head_dim = key("attention.key_length", embed // heads)
        pattern = key("attention.sliding_window_pattern")
        per_global = _local_per_global(pattern, self.local_per_global, layers, file)
        scaling = key("rope.scaling.factor") if key("rope.scaling.type") == "linear" else None
        return {
            "num_layers": layers,
            "embed_dim": embed,
            "hidden_dim": key("feed_forward_length"),
            "num_heads": heads,
            "num_kv_heads": key("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "vocab_size": int(file.shape("token_embd.weight")[-1]),  # GGML order: [D, V]
            "query_pre_attn_scalar": self.query_scale(layers, embed, heads, head_dim),
            "attn_logit_softcap": key("attn_logit_softcapping", self.attn_softcap),
            "final_logit_softcap": key("final_logit_softcapping", self.final_softcap),
            "local_layers_per_global": per_global,
            "sliding_window": key("attention.sliding_window", self.window) if per_global else None,
            "rope_base_global": float(key("rope.freq_base", self.rope_base)),
            "rope_base_local": float(
                key(
                    "rope.freq_base_swa",
                    self.local_rope_base if per_global else key("rope.freq_base", self.rope_base),
                )
            ),
            "rope_scale_global": float(scaling or 1.0),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            "context_length": key("context_length"),
            "tie_embeddings": "output.weight" not in file.names,
        }

    def query_scale(self, layers: int, embed: int, heads: int, head_dim: int) -> int:
        """The attention's query scale as llama.cpp computes it (src/llama-model.cpp,
        LLM_ARCH_GEMMA2 and LLM_ARCH_GEMMA3: f_attention_scale), the file holding no key for it:
        1/sqrt(n_embd / n_head) for the 27B models (46 and 62 layers: Gemma 2's 144, Gemma 3's
        168), 1/sqrt(head_dim) otherwise (256 for every other published size). Transformers' GGUF
        loader assumes 256, which is wrong for the 27B files."""
        return embed // heads if layers == self.layers_of_27b else head_dim

    def write_metadata(self, writer, cfg: ModelConfig) -> None:
        if self.window is not None:
            writer.add_sliding_window(cfg.sliding_window or 4096)
        if self.attn_softcap is not None and cfg.attn_logit_softcap is not None:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcap)
        if cfg.final_logit_softcap is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcap)

    def extra_tensors(self, cfg: ModelConfig) -> dict[str, np.ndarray]:
        return {}

    def check_exportable(self, cfg: ModelConfig) -> None:
        """What a file cannot hold shows when the export reads its own file back."""

    def claims(self, file) -> bool:
        return False


def _local_per_global(pattern: Any, default: int, layers: int, file) -> int:
    """Local layers before each global one, from {arch}.attention.sliding_window_pattern (a period,
    or a per-layer list of 'is sliding'), else transformers' default."""
    if pattern is None:
        return default
    if isinstance(pattern, (int, np.integer)):
        return int(pattern) - 1
    sliding = [bool(s) for s in pattern]
    per_global = sliding.index(False) if False in sliding else layers
    if sliding != [(i + 1) % (per_global + 1) != 0 for i in range(layers)]:
        raise ConfigError(
            f"{file.path}: sliding_window_pattern {sliding} is not N local layers then a global one"
        )
    return per_global if per_global < layers else 0
