"""Every reduction that the pp and cp shard_maps make runs in float32.

Why: XLA:CPU (jaxlib 0.10.2) aborts when it compiles a bfloat16 reduction that a shard_map leaves
next to auto mesh axes ("Invalid binary instruction opcode copy"). Shardy gives the reducer a
`copy` root, and the bfloat16 upcaster then cannot clone it. The reductions involved are the
gradient sum over cp of the parameters, the sum over pp of the pipeline's input gradient and of
its outputs, and the reduce-scatter that transposes cp's all-gather of keys and values.

So what enters a region replicated over its manual axes enters in float32 and is cast back inside
(`float32` and `cast_like`), and cp gathers with a float32 backward pass (`all_gather`). Under
float32 training all of this is the identity.
"""

from __future__ import annotations

from functools import partial
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


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def all_gather(x, axis_name: str):
    """jax.lax.all_gather(x, axis_name, axis=1, tiled=True), whose backward reduce-scatter is float32."""
    return jax.lax.all_gather(x, axis_name, axis=1, tiled=True)


def _all_gather_fwd(x, axis_name):
    return all_gather(x, axis_name), None


def _all_gather_bwd(axis_name, _, g):
    return (jax.lax.psum_scatter(g.astype(jnp.float32), axis_name, scatter_dimension=1, tiled=True).astype(g.dtype),)


all_gather.defvjp(_all_gather_fwd, _all_gather_bwd)
