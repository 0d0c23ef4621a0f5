"""The decoder (Gemma 1 to 4, Llama 3, Qwen 2.5 and 3) in Flax NNX: one implementation, whose
differences between model families are config fields (norm placement, QK norm, q/k/v biases, the
MLP's activation, soft-capping, the sliding-window pattern, RoPE and its scaling, the embedding's
scale, a tied or separate output layer, experts and their router); model.family only names the
family for the files (tunix_train.interop.families).

Axis letters: B batch, T query positions, S key positions, D embed, N query heads, K key/value
heads, G query heads per key/value head (N = K * G), H head dim, F MLP width, V vocab, L layers.
Every parameter carries logical axis names (metadata `axes`); activations are constrained by
logical names under `rules`, the table tunix_train.sharding maps to the mesh. What is written for
a compiler's layout rather than as the math (fused projections, attention's layout and backward
pass, the rotary flip, the remat policies) lives in kernels.py.

Layers whose parameters have the same shapes are stacked and scanned. Gemma 4 mixes shapes (its
global layers have their own head dim; KV-sharing layers have no key/value weights), so its layers
form `LayerGroup`s: a period of layers repeated, scanned over the repeats (docs/models.md).

The layer is attention.py's Attention and block.py's MLP and Block; this file is the stack: the
embeddings, the layers scanned or run by a LayerRunner, the output layer.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tunix_train.config import (
    AttentionImpl,
    BaseQuantization,
    LoraConfig,
    ModelConfig,
    Remat,
    VisionEncoder,
)
from tunix_train.model import kernels
from tunix_train.model.block import Block, stacked_blocks
from tunix_train.model.common import RMSNorm, output_logits, param
from tunix_train.model.gemma4_vision import Gemma4VisionTower
from tunix_train.model.layout import (
    GLOBAL_WINDOW,
    LayerGroup,
    LayerShape,
    layer_groups,
    layer_shapes,
    layer_windows,
    one_stack,
)
from tunix_train.model.lora import Adapter
from tunix_train.model.moe import Dispatch, LocalDispatch
from tunix_train.model.rope import rope_table
from tunix_train.model.vision import VisionTower, image_slots, images_on_global, merged_embeddings
from tunix_train.sharding import LOGICAL_RULES, Rules, constrain

TOWERS = {
    VisionEncoder.siglip: VisionTower,
    VisionEncoder.gemma4: Gemma4VisionTower,
}  # by model.vision.encoder


class LayerRunner(Protocol):
    """What runs the layer stack over the mesh's pp and cp axes (tunix_train.parallel.Parallelism):
    the model hands it the function that applies a run of layers."""

    def run_layers(self, layers: Callable, layer_xs, x_BTD, rows: dict, make_attend: Callable): ...


@dataclasses.dataclass(frozen=True)
class LayerLoop:
    """How a pass runs the stack of layers: what the backward pass recomputes, and how many layers
    each iteration of the scan over them takes (training.remat, training.scan_unroll)."""

    remat: Remat = Remat.none
    unroll: int = 1


class Decoder(nnx.Module):
    """Token ids [B, T] -> float32 next-token logits [B, T, V]; the output layer is the embedding
    table (tie_embeddings) or its own [V, D]."""

    def __init__(
        self,
        cfg: ModelConfig,
        rngs: nnx.Rngs,
        loop: LayerLoop = LayerLoop(),
        attention: AttentionImpl = AttentionImpl.xla,
        rules: Rules = LOGICAL_RULES,
        parallel: LayerRunner | None = None,
        lora: LoraConfig | None = None,
        experts: Dispatch = LocalDispatch(),
    ):
        """parallel: a LayerRunner (tunix_train.parallel.Parallelism) that runs the layer stack over the pp
        and cp
        mesh axes; None runs it as written. lora: adapters on the projections it targets. experts:
        how a mixture-of-experts layer's tokens reach their experts (moe.Dispatch).

        Parameters: `layers` when every layer has one shape (Gemma 1-3), a stack of them all;
        otherwise `groups[g][j]`, the stack of position j of group g's period over its repeats."""
        self.cfg, self.remat, self.scan_unroll, self.attention = cfg, loop.remat, loop.unroll, attention
        self.rules, self.parallel = rules, parallel
        self.quantized_base = lora is not None and lora.base_quantization is not BaseQuantization.none
        D, V, L = cfg.embed_dim, cfg.vocab_size, cfg.num_layers
        self.embedding_VD = param(rngs, (V, D), ("vocab", "embed"), D)
        self.layer_groups = layer_groups(cfg)
        keys = jax.random.split(rngs.params(), L)
        # after the base's keys, so the base is the same with adapters or without
        adapter_keys = keys if lora is None else jax.random.split(rngs.params(), L)
        stacks = [
            [
                stacked_blocks(
                    cfg, shape, keys[group.layers(j)], adapter_keys[group.layers(j)], rules, lora, experts
                )
                for j, shape in enumerate(group.period)
            ]
            for group in self.layer_groups
        ]
        self.homogeneous = one_stack(cfg)  # whether every layer has one shape: one stack, `layers`
        if self.homogeneous:
            self.layers, self.groups = stacks[0][0], None
        else:
            self.layers, self.groups = None, nnx.List([nnx.List(blocks) for blocks in stacks])
        self.final_norm = RMSNorm(D, cfg.rms_norm_eps, cfg.norm_weight_offset)
        P = cfg.gemma4.per_layer_input_dim
        if P:
            self.per_layer_embedding_VLP = param(
                rngs, (cfg.gemma4.per_layer_input_vocab_size or V, L, P), ("vocab", None, None), P
            )
            self.per_layer_proj_DLP = param(rngs, (D, L, P), ("embed", None, None), D)
            self.per_layer_proj_norm = RMSNorm(P, cfg.rms_norm_eps, cfg.norm_weight_offset)
        # drawn last: the other parameters are the same tied or not
        self.output_VD = None if cfg.tie_embeddings else param(rngs, (V, D), ("vocab", "embed"), D)
        # its own stream, from a key drawn before the adapters': the text model's parameters are the
        # same with a tower or without, the tower's the same with adapters or without
        self.vision = (
            None
            if cfg.vision is None
            else TOWERS[cfg.vision.encoder](
                cfg.vision,
                D,
                nnx.Rngs(jax.random.fold_in(keys[0], 1)),
                rules,
                kernels.remat_policy(loop.remat, quantized_base=False),
                lora,
            )
        )
        # a reward model's or PPO's scalar head, from a stream of its own: the other parameters are
        # the same; under LoRA it trains beside the adapters (an Adapter: PEFT's modules_to_save)
        score = (
            param(nnx.Rngs(jax.random.fold_in(keys[0], 2)), (D, 1), ("embed", None), D)
            if cfg.score_head
            else None
        )
        under_lora = score is not None and lora is not None
        self.score_DO = Adapter(score.get_value(), axes=("embed", None)) if under_lora else score
        # the images' embeddings carry gradient into the tower when it trains or has adapters
        self.tower_learns = cfg.vision is not None and (
            cfg.vision.trainable or (lora is not None and any(t.startswith("vision_") for t in lora.targets))
        )

    def stacks(self) -> list[tuple[LayerGroup, list[Block]]]:
        """Each group and the stacked Block of each position of its period."""
        if self.homogeneous:
            return [(self.layer_groups[0], [self.layers])]
        return [(group, list(blocks)) for group, blocks in zip(self.layer_groups, self.groups)]

    def layer_blocks(self) -> list[tuple[Block, int]]:
        """For each layer in order: the stacked Block holding it and its index in the stack."""
        where = {}
        for group, blocks in self.stacks():
            for j, stack in enumerate(blocks):
                for r, layer in enumerate(group.layers(j)):
                    where[int(layer)] = (stack, r)
        return [where[i] for i in range(self.cfg.num_layers)]

    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None, token_index_BT=None, images=None):
        """positions restart at 0 and segment ids change at each packed document; by default one
        document per row. Attention never crosses documents or looks ahead. token_index: where each
        token stands in its row (default 0, 1, ...); the masks read it, so a row may come reordered.
        images: each row's images [B, I, C, H, W] (model.vision), in the order of the row's image
        placeholders (model.vision.image_token_id), whose embeddings they become."""
        x_BTD = self.hidden(tokens_BT, positions_BT, segment_ids_BT, token_index_BT, images)
        return output_logits(x_BTD, self.output_table(), self.cfg.final_logit_softcap, self.rules)

    def output_table(self):
        """The output layer [V, D] (the embedding table when tied), gathered over fsdp: the one
        place the logits' weights come from (output_logits; the step's chunked loss; the engine)."""
        table = self.embedding_VD if self.output_VD is None else self.output_VD
        return constrain(table[...], ("act_vocab", None), self.rules)

    def embed(self, tokens_BT, images=None, slots_BT=None):
        """Token embeddings [B, T, D], scaled by sqrt(D) where the family does (scale_embeddings);
        with images [B, I, *image_shape], the image tower's embeddings at the image slots
        (vision.image_slots)."""
        table_VD = constrain(self.embedding_VD[...], ("act_vocab", None), self.rules)
        x_BTD = table_VD[tokens_BT]
        if self.cfg.scale_embeddings:
            x_BTD = x_BTD * jnp.sqrt(jnp.float32(self.cfg.embed_dim)).astype(table_VD.dtype)
        if images is not None:
            x_BTD = merged_embeddings(x_BTD, self.image_embeddings(images), slots_BT)
        return constrain(x_BTD, ("batch", "seq", "act_embed"), self.rules)

    def layer_inputs(self, tokens_BT, images=None, slots_BT=None):
        """embed's embeddings and Gemma 4's per-layer inputs [B, T, L, P] (None without). An image
        token's per-layer table row is the padding token's (id 0; transformers' Gemma4Model), its
        projection the image embedding's."""
        x_BTD = self.embed(tokens_BT, images, slots_BT)
        if not self.cfg.gemma4.per_layer_input_dim:
            return x_BTD, None
        rows_BT = tokens_BT if images is None else jnp.where(slots_BT >= 0, 0, tokens_BT)
        return x_BTD, self.per_layer_inputs(rows_BT, x_BTD)

    def image_embeddings(self, images_BI):
        """The images' embeddings [B, I x tokens_per_image, D], in the text model's dtype; without
        gradient unless model.vision.trainable or the tower has adapters."""
        if self.vision is None:
            raise ValueError("images given to a text-only model (model.vision is null)")
        B, per_row = images_BI.shape[:2]
        features = self.vision(images_BI.reshape(B * per_row, *images_BI.shape[2:]))
        features = features.reshape(B, per_row * features.shape[1], -1).astype(self.embedding_VD[...].dtype)
        return features if self.tower_learns else jax.lax.stop_gradient(features)

    def per_layer_inputs(self, tokens_BT, x_BTD):
        """Gemma 4's per-layer inputs [B, T, L, P]: the token's row of the per-layer table (scaled by
        sqrt(P)) and the normed projection of its embedding x (scaled by 1/sqrt(D)), averaged by 1/sqrt(2)."""
        cfg = self.cfg
        table_VLP = self.per_layer_embedding_VLP[...]
        token_BTLP = table_VLP[tokens_BT] * jnp.sqrt(jnp.float32(cfg.gemma4.per_layer_input_dim)).astype(
            table_VLP.dtype
        )
        proj_BTLP = jnp.einsum("btd,dlp->btlp", x_BTD, self.per_layer_proj_DLP[...])
        proj_BTLP = self.per_layer_proj_norm(proj_BTLP * jnp.asarray(cfg.embed_dim**-0.5, x_BTD.dtype))
        return ((proj_BTLP + token_BTLP.astype(x_BTD.dtype)) * jnp.asarray(2**-0.5, x_BTD.dtype)).astype(
            x_BTD.dtype
        )

    def rope_tables(self, positions_BT):
        """rope_table of global and of local layers at `positions_BT`."""
        cfg = self.cfg
        return (
            rope_table(
                positions_BT,
                cfg.rope_base_global,
                cfg.rope_scale_global,
                cfg.gemma4.global_head_dim or cfg.head_dim,
                cfg.gemma4.rope_partial_factor_global,
                cfg.rope_scaling,
            ),
            rope_table(positions_BT, cfg.rope_base_local, 1.0, cfg.head_dim),
        )

    def hidden(self, tokens_BT, positions_BT=None, segment_ids_BT=None, token_index_BT=None, images=None):
        """The final normed hidden states [B, T, D], from which output_logits computes the logits."""
        return self.hidden_and_stats(tokens_BT, positions_BT, segment_ids_BT, token_index_BT, images=images)[
            0
        ]

    def hidden_and_stats(
        self,
        tokens_BT,
        positions_BT=None,
        segment_ids_BT=None,
        token_index_BT=None,
        replay_BTLK=None,
        images=None,
    ):
        """hidden's states and the experts' statistics of every layer (moe.MoE, stacked [L, ...]; {}
        without experts). replay_BTLK: each token's experts in each layer to use instead of the
        router's choice (routing replay; -1 where the router chooses, moe.MoE.route). images: as
        __call__ takes them."""
        B, T = tokens_BT.shape
        index_1T = jnp.arange(T, dtype=jnp.int32)[None]
        rows = {
            "positions": jnp.broadcast_to(index_1T, (B, T)) if positions_BT is None else positions_BT,
            "segment_ids": jnp.ones((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT,
            "token_index": index_1T if token_index_BT is None else token_index_BT,
        }
        if replay_BTLK is not None:
            rows["replay"] = replay_BTLK
        slots_BT = None
        if images is not None:
            slots_BT, ids_BT = image_slots(tokens_BT, self.cfg.vision, images, token_index_BT)
            if ids_BT is not None:
                rows["image_ids"] = ids_BT
        x_BTD, per_layer_BTLP = self.layer_inputs(tokens_BT, images, slots_BT)
        if per_layer_BTLP is not None:
            rows["per_layer_inputs"] = per_layer_BTLP
        windows = jnp.asarray(layer_windows(self.cfg))
        if self.homogeneous:
            layer_xs = (nnx.split(self.layers)[1], windows)
        else:
            layer_xs = [
                (
                    [nnx.split(b)[1] for b in blocks],
                    windows[np.stack([group.layers(j) for j in range(len(blocks))], 1)],
                )
                for group, blocks in self.stacks()
            ]
        if self.parallel is None:
            x_BTD, stats = self._layers(layer_xs, x_BTD, rows, self._masked_attention)
        else:
            x_BTD, stats = self.parallel.run_layers(
                self._layers, layer_xs, x_BTD, rows, self._masked_attention
            )
        return self.final_norm(x_BTD), stats

    def _layers(self, layer_xs, x_BTD, rows, make_attend):
        """The layers of layer_xs applied in order, each group by a scan over its repeats, and the
        experts' statistics of every layer ([L, ...], in no particular order; {} without experts).
        layer_xs: (stacked parameters, windows [L]) of the one stack, or per group ([stacked
        parameters per position], windows [repeats, period]). In the scan body a period's windows
        are [period], or a scalar for the one stack.
        make_attend: rows -> window -> attend, the attention over the keys of this pass."""
        # the RoPE tables before the masks: the order the program was traced in before (same HLO)
        period = self._period_runner(rows["positions"], lambda window, layer: attend_within(window))
        attend_within = make_attend(rows)
        per_layer_BTLP, replay_BTLK = rows.get("per_layer_inputs"), rows.get("replay")
        if self.homogeneous:
            state, windows = layer_xs
            groups = [(self.layer_groups[0], [nnx.graphdef(self.layers)], [state], windows)]
        else:
            groups = [
                (group, [nnx.graphdef(b) for b in blocks], states, windows)
                for (group, blocks), (states, windows) in zip(self.stacks(), layer_xs)
            ]
        # keys and values each KV-sharing layer reuses: the latest of each layer type so far
        shared = (
            {}
            if not self.cfg.gemma4.num_kv_shared_layers
            else {kind: self._empty_kv(x_BTD, shape) for kind, shape in self._kv_producers().items()}
        )
        stats = []
        for group, graphdefs, states, windows in groups:
            repeats = jax.tree.leaves(states)[0].shape[0]
            if repeats != group.repeats:  # a pipeline stage's chunk: its repeats, its rows' layers
                group = dataclasses.replace(group, first=0, repeats=repeats)
            index = np.stack([group.layers(j) for j in range(len(group.period))], 1)

            def by_layer(a_BTL):  # [B, T, L, ...] -> this group's [repeats, period, B, T, ...]
                return None if a_BTL is None else jnp.moveaxis(a_BTL[:, :, index], (2, 3), (0, 1))

            def scanned(carry, xs, group=group, graphdefs=graphdefs):
                carry, layer_stats, _, _ = period(group, graphdefs, carry, *xs)
                return carry, layer_stats

            (x_BTD, shared), group_stats = jax.lax.scan(
                scanned,
                (x_BTD, shared),
                (states, windows, by_layer(per_layer_BTLP), by_layer(replay_BTLK)),
                unroll=self.scan_unroll,
            )
            stats += [s for s in group_stats if s]  # per position of the period: [repeats, ...]
        return x_BTD, (jax.tree.map(lambda *s: jnp.concatenate(s), *stats) if stats else {})

    def layer_states(self) -> list[nnx.State]:
        """Each layer's parameters, cut from the stacks, in order: what unrolled_layers takes."""
        return [jax.tree.map(lambda a: a[i], nnx.state(stack)) for stack, i in self.layer_blocks()]

    def unrolled_layers(
        self,
        layer_states,
        tokens_BT,
        positions_BT,
        attend_of_layer: Callable[[int], Callable],
        last_B=None,
        images=None,
        slots_BT=None,
        every_position: bool = False,
    ):
        """The final normed hidden state at index last_B of each row (default: the last) [B, D]
        (every_position: at each position, [B, T, D]), what each layer's attend returned beside
        its output (the engine: the layer's KV cache), and each token's experts in each layer
        [B, T, L, k] (None without experts). The
        periods of _layers run one after another instead of scanned, each layer with its own
        parameters (layer_states) and attend_of_layer(i): how the engine runs them, each layer
        reading and writing its own cache. images, slots_BT: as embed takes them."""
        cfg = self.cfg
        x_BTD, per_layer_BTLP = self.layer_inputs(tokens_BT, images, slots_BT)
        period = self._period_runner(positions_BT, lambda window, layer: attend_of_layer(layer))
        windows = layer_windows(cfg)
        carry, extras, routes = (x_BTD, dict.fromkeys(self._kv_producers())), [], {}
        for group, blocks in self.stacks():
            graphdefs = [nnx.graphdef(b) for b in blocks]
            for r in range(group.repeats):
                layers = [int(group.layers(j)[r]) for j in range(len(blocks))]
                carry, _, period_extras, period_routes = period(
                    group,
                    graphdefs,
                    carry,
                    [layer_states[i] for i in layers],
                    [int(windows[i]) for i in layers],
                    None if per_layer_BTLP is None else [per_layer_BTLP[:, :, i] for i in layers],
                    None,
                    layers,
                )
                extras += period_extras
                routes.update(zip(layers, period_routes))
        x_BTD = carry[0]
        if not every_position:
            x_BTD = x_BTD[:, -1:] if last_B is None else jnp.take_along_axis(x_BTD, last_B[:, None, None], 1)
            x_BTD = x_BTD[:, 0]  # [B, D]
        routes_BTLK = jnp.stack([routes[i] for i in sorted(routes)], 2) if self.cfg.moe.experts else None
        return self.final_norm(x_BTD), extras, routes_BTLK

    def _period_runner(self, positions_BT, attend_of: Callable):
        """The one layer loop, over the positions of a group's period; _layers scans it over the
        repeats, unrolled_layers calls it once per repeat. Returns
        period(group, graphdefs, (x, shared), states, windows, per_layer, replay, layers=None)
        -> ((x, shared), the experts' statistics, what attend returned and the experts chosen, per
        position), where
        `shared` holds the latest keys and values of each layer type that KV-sharing layers reuse,
        and attend_of(window, layer) gives a layer's attention (layer: its index, given when unrolled)."""
        rope_global, rope_local = self.rope_tables(positions_BT)

        def apply(graphdef, shape, layer, x_BTD, state, window, inputs):
            """One layer; inputs: its per-layer input, the keys and values it shares, its replayed experts."""
            rope = _layer_rope(shape, window, rope_global, rope_local)
            x_BTD, extra, side = nnx.merge(graphdef, state)(x_BTD, rope, attend_of(window, layer), *inputs)
            return x_BTD, extra, side["kv"], side.get("moe", {}), side.get("routes")

        policy = kernels.remat_policy(self.remat, self.quantized_base)
        if policy is not None:
            apply = jax.checkpoint(apply, policy=policy, prevent_cse=False, static_argnums=(0, 1, 2))

        def period(group, graphdefs, carry, states, windows, per_layer, replay, layers=None):
            x_BTD, shared = carry
            layer_stats, extras, routes = [], [], []
            for j, (graphdef, shape) in enumerate(zip(graphdefs, group.period)):
                x_BTD, extra, kv, moe, chosen = apply(
                    graphdef,
                    shape,
                    None if layers is None else layers[j],
                    x_BTD,
                    states[j],
                    windows if getattr(windows, "ndim", 1) == 0 else windows[j],
                    (
                        None if per_layer is None else per_layer[j],
                        shared[shape.layer_type] if shape.shares_kv else None,
                        None if replay is None else replay[j],
                    ),
                )
                shared = _with_latest_kv(shared, shape, kv)
                layer_stats.append(moe)
                extras.append(extra)
                routes.append(chosen)
            return (x_BTD, shared), layer_stats, extras, routes

        return period

    def _kv_producers(self) -> dict[str, LayerShape]:
        """The shape of the layers whose keys and values KV-sharing layers reuse, per layer type."""
        return {shape.layer_type: shape for shape in layer_shapes(self.cfg) if not shape.shares_kv}

    @staticmethod
    def _empty_kv(x_BTD, shape: LayerShape):
        B, T, _ = x_BTD.shape
        # zeros_like: where x varies over the devices of a manual mesh axis (cp), so must the scan's carry
        zeros = jnp.zeros_like(x_BTD, shape=(B, T, shape.num_kv_heads, shape.head_dim))
        return zeros, zeros

    def _masked_attention(self, rows):
        """rows -> window -> attend: attention over the keys of the pass that kernels.visible_keys
        allows, its window-independent part computed once per pass."""
        fused = None if self.attention is AttentionImpl.xla else self.attention.value
        index, segments, images = rows["token_index"], rows["segment_ids"], rows.get("image_ids")
        visible = kernels.visible_keys(
            index,
            segments,
            index,
            segments,
            images,
            images,
            images_on_global=images_on_global(self.cfg.vision),
        )
        return lambda window: (
            lambda q, k, v, softcap: (kernels.attention(q, k, v, visible(window), softcap, fused), None)
        )


def _layer_rope(shape: LayerShape, window, rope_global, rope_local):
    """A layer's RoPE table: by its static type where the code depends on it, by its window
    otherwise (a number, or in a scan over layers a traced value)."""
    if shape.layer_type is not None:
        return rope_global if shape.layer_type == "full_attention" else rope_local
    if isinstance(window, int):
        return rope_global if window == GLOBAL_WINDOW else rope_local
    return [jnp.where(window == GLOBAL_WINDOW, g, loc) for g, loc in zip(rope_global, rope_local)]


def _with_latest_kv(shared: dict, shape: LayerShape, kv) -> dict:
    """The keys and values KV-sharing layers reuse: the latest of each layer type that `shared`
    tracks (a scan's carry tracks them only when some layer shares)."""
    if shape.shares_kv or shape.layer_type not in shared:
        return shared
    return {**shared, shape.layer_type: kv}
