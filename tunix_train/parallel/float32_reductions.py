"""Every reduction that the pp and cp shard_maps make runs in float32.

Why: XLA:CPU (jaxlib 0.10.2) aborts when it compiles a bfloat16 reduction that a shard_map leaves
next to auto mesh axes ("Invalid binary instruction opcode copy"). Shardy gives the reducer a
`copy` root, and the bfloat16 upcaster then cannot clone it. The reductions involved are the
gradient sum over cp of the parameters, and the sums over pp of the pipeline's input gradient and
of its outputs.

So what enters a region replicated over its manual axes enters in float32 and is cast back inside
(`float32` and `cast_like`), and what leaves by a sum leaves in float32. Under float32 training all
of this is the identity.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def float32(tree: Any) -> Any:
    """Floating leaves of `tree` in float32; others as they are."""
    return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def dtypes(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.dtype, tree)


def cast_like(tree: Any, like_dtypes: Any) -> Any:
    return jax.tree.map(lambda a, dtype: a.astype(dtype), tree, like_dtypes)
