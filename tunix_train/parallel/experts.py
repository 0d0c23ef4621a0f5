"""Expert parallelism (the `ep` mesh axis): the mixture-of-experts dispatch on a mesh.

`MeshDispatch` is what model/moe.py's MoE takes as its `Dispatch` in every run (the model builds it
through tunix_train.parallel.model_graphdef):
- outside any shard_map, with data shards: each data shard (dp x fsdp x ep) ranks and dispatches
  its own tokens' copies, in a shard_map manual over the data axes (`_expert_parallel`). With an ep
  axis the experts are split over it; each ep shard sends each of its copies to the shard holding
  its expert with one all-to-all, computes there, and an all-to-all brings the results back.
- inside cp's or pp's shard_map, the compiler partitions the dispatch (a nested shard_map fails to
  differentiate there, jax 0.10-0.12), and no jax.lax.cond or switch may choose the path: runs hung
  in the compiler's collectives inside the branches (XLA:CPU: ep x cp on jax 0.10.2; fsdp x cp x tp
  on jax 0.12, even with every device made to take the same branch).
Axis letters as in moe.py; S ep shards.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tunix_train import platform
from tunix_train.config import MoeDispatch
from tunix_train.model import kernels
from tunix_train.model.moe import Dispatching, apply_experts, capacity_experts, dropless_experts, slots_for
from tunix_train.sharding import BATCH_AXES, Rules, constrain, data_axes, manual_axes

AXIS = "ep"


@dataclasses.dataclass(frozen=True)
class MeshDispatch:
    """moe.Dispatch over the ambient mesh (the experts' logical axes under `rules`)."""

    rules: Rules

    def top_k(self, probs_XE, k: int):
        """jax.lax.top_k on each data shard's tokens. Why: XLA's partitioner all-gathers TopK's operand
        over the batch (jaxlib 0.10.2 and 0.12): every device ranked every token's experts, behind a
        collective, in every layer and again in its backward pass."""
        mesh = jax.sharding.get_abstract_mesh()
        data = () if mesh.empty or manual_axes() else data_axes(mesh)
        if not data:
            return jax.lax.top_k(probs_XE, k)
        return jax.shard_map(
            partial(jax.lax.top_k, k=k), in_specs=P(data), out_specs=P(data), axis_names=set(data)
        )(probs_XE)

    def __call__(self, x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD, how: Dispatching):
        mesh = jax.sharding.get_abstract_mesh()
        manual = manual_axes()
        how = dataclasses.replace(
            how,
            ragged=platform.ragged_dot_is_native(),
            may_choose=not any(a not in BATCH_AXES for a in manual),
        )
        if not manual and not mesh.empty and any(mesh.shape.get(a, 1) > 1 for a in BATCH_AXES):
            return _expert_parallel(x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD, how)
        if manual:
            # the experts enter split over ep alone: split over fsdp or tp as well, they crashed jax
            # 0.12's partitioner (a failed check in spmd_partitioner_util.cc)
            gate_up_EDCM = constrain(gate_up_EDCM, ("experts", None, None, None), self.rules)
            down_EMD = constrain(down_EMD, ("experts", None, None), self.rules)
        return apply_experts(x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD, how)


def _expert_parallel(x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD, how: Dispatching):
    """moe.apply_experts with the experts split over the ep mesh axis (and the tokens with them: ep
    is one of the batch's axes), in a shard_map manual over the data axes (dp, fsdp, ep).

    Each shard sends shard s the copies of its tokens bound for s's experts, in a buffer of A rows
    per destination (a shard's every copy may go to one shard: no copy is dropped), by one
    all_to_all; shard s computes them with its E/S experts, and a second all_to_all returns them.
    Without ep (or ep=1) each data shard runs every expert on its own tokens, with no exchange."""
    mesh = jax.sharding.get_abstract_mesh()
    S = mesh.shape.get(AXIS, 1)
    kind, capacity_factor, ragged, act = how.kind, how.capacity_factor, how.ragged, how.act

    def shard(x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD):
        # the weights vary over the data axes as the tokens do (kernels.slotted_matmul's custom
        # gradient needs it); the cast's transpose sums their gradients over them
        gate_up_EDCM, down_EMD = jax.lax.pcast((gate_up_EDCM, down_EMD), whole, to="varying")
        if S == 1:  # every expert here: no exchange
            return apply_experts(x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD, how)
        X, K = experts_XK.shape
        E_local, D = gate_up_EDCM.shape[0], x_XD.shape[1]
        expert_A = experts_XK.reshape(-1)  # copy a is token a // K
        A = expert_A.shape[0]
        # the [S, A] send buffer: slot (s, i) holds the i-th copy bound for shard s (source: none = A)
        source_R, slot_A, _ = kernels.slotting(expert_A // E_local, S, kernels.Slots(A, 1, 0))
        send_SAD = kernels.take_rows(jnp.repeat(x_XD, K, axis=0), source_R, slot_A).reshape(S, A, D)
        # each slot's local expert, E_local for an empty slot
        send_SA = jnp.take(jnp.append(expert_A % E_local, E_local), source_R).reshape(S, A)
        recv_SAD = jax.lax.all_to_all(send_SAD, AXIS, 0, 0, tiled=False)
        recv_SA = jax.lax.all_to_all(send_SA, AXIS, 0, 0, tiled=False)
        x_RD, local_R = recv_SAD.reshape(S * A, D), recv_SA.reshape(-1)
        if kind is MoeDispatch.dropless:
            y_RD = dropless_experts(x_RD, local_R, gate_up_EDCM, down_EMD, A, ragged, act=act)
        else:
            y_RD = capacity_experts(
                x_RD, local_R, gate_up_EDCM, down_EMD, slots_for(A, E_local, capacity_factor), act
            )
        back_SAD = jax.lax.all_to_all(y_RD.reshape(S, A, D), AXIS, 0, 0, tiled=False)
        y_AD = kernels.take_rows(back_SAD.reshape(S * A, D), slot_A, source_R)  # in token order
        return jnp.einsum("xkd,xk->xd", y_AD.reshape(X, K, -1), weights_XK.astype(y_AD.dtype))

    # manual over every data axis, not ep alone: with fsdp left to the compiler, it resharded every
    # token's activations to meet the experts' fsdp-split weights. The weights enter whole over fsdp
    # (gathered, as fsdp gathers any weight before use); tp stays the compiler's.
    data = data_axes(mesh)
    tokens = P(data)
    experts = P(AXIS) if AXIS in mesh.shape else P()
    whole = tuple(a for a in data if a != AXIS)  # the axes the experts enter whole over
    return jax.shard_map(
        shard, in_specs=(tokens, tokens, tokens, experts, experts), out_specs=tokens, axis_names=set(data)
    )(x_XD, weights_XK, experts_XK, gate_up_EDCM, down_EMD)
