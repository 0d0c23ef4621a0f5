"""Qwen 3 MoE: transformers' Qwen3MoeForCausalLM, llama.cpp's `qwen3moe`. Every layer's MLP is
experts with a softmax router; checkpoints store each expert's projections as tensors of their
own, llama.cpp's files as three stacked tensors."""

from __future__ import annotations

from typing import Any

from tunix_train.config import ModelConfig, MoeRouter
from tunix_train.interop.families import llama_like
from tunix_train.interop.families.family import Family, register

FIXED = dict(
    llama_like.LLAMA_DECODER,
    **llama_like.NO_WINDOWS,
    use_qk_norm=True,
    qkv_bias=False,
    **{"moe.router": MoeRouter.softmax, "moe.dense_mlp": False},
)


def from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    llama_like.refuse(
        hf,
        "qwen3_moe",
        {
            "attention_bias": hf.get("attention_bias"),
            "mlp_only_layers": hf.get("mlp_only_layers"),
            "decoder_sparse_step": hf.get("decoder_sparse_step", 1) != 1,
        },
    )
    return {
        **llama_like.llama_from_hf(hf, "qwen3_moe"),
        # transformers 5 writes num_local_experts; published checkpoints, num_experts
        "moe.experts": hf.get("num_experts") or hf["num_local_experts"],
        "moe.experts_per_token": hf["num_experts_per_tok"],
        "moe.hidden_dim": hf["moe_intermediate_size"],
        "moe.norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
    }


def to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        **llama_like.llama_to_hf(cfg, "qwen3_moe"),
        "attention_bias": False,
        "use_sliding_window": False,
        "num_experts": cfg.moe.experts,
        "num_experts_per_tok": cfg.moe.experts_per_token,
        "moe_intermediate_size": cfg.moe.hidden_dim,
        "norm_topk_prob": cfg.moe.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


FAMILY = register(
    Family(
        "qwen3_moe",
        ("qwen3_moe",),
        "Qwen3MoeForCausalLM",
        from_hf,
        to_hf,
        FIXED,
        gguf=llama_like.gguf("qwen3moe", stacked_experts=True),
        hf_names={
            **llama_like.HF_NAMES,
            "layers.moe.router_DE": "mlp.gate.weight",
            "layers.moe.gate_up_EDCM": "mlp.experts.gate_up_proj",
            "layers.moe.down_EMD": "mlp.experts.down_proj",
        },
        split_experts=True,
    )
)
