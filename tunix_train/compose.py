"""The configuration as a run gets it: composed by hydra, validated once at start-up.

`load_config(overrides)` composes the package's `configs/config.yaml` (package data, found through
importlib.resources) with command-line overrides into the schema's dataclasses (tunix_train.config);
`--config-dir DIR` puts a directory of the user's own configs before the package's, as hydra's own
command line does.
OmegaConf rejects unknown keys and wrongly typed values against the schema;
the semantic checks that need no devices live in `validate`, which asks each concern to check its
own keys (the model's: model.layout.validate_model; the mesh's: tunix_train.sharding and
parallel.for_run, at set-up). Every failure is a `ConfigError` whose message is one line naming
the key.
"""

from __future__ import annotations

import contextlib
from importlib import resources
from pathlib import Path
from typing import Any

from tunix_train.config import (
    CHAT_ROLES,
    LORA_TARGETS,
    VISION_LORA_TARGETS,
    AttentionImpl,
    BaseQuantization,
    Config,
    ConfigError,
    DataConfig,
    DataSource,
    LoraConfig,
    MixedPrecision,
    ModelConfig,
    Objective,
    TrainingConfig,
    deprecated,
    reads_text,
)
from tunix_train.config.fields import require_positive
from tunix_train.model.layout import validate_model

CONFIG_DIR = resources.files("tunix_train") / "configs"


def validate(cfg: Config) -> None:
    """Checks that need no devices; mesh checks live in tunix_train.sharding."""
    m, t, d, c = cfg.model, cfg.training, cfg.data, cfg.checkpoint
    steps = (
        "micro_batch_size",
        "gradient_accumulation_steps",
        "max_steps",
        "log_every",
        "profile_steps",
        "scan_unroll",
        "sync_gradients_every",
        "pipeline_microbatches",
        "pipeline_repeats",
    )
    require_positive({"data.seq_len": d.seq_len, **{f"training.{k}": getattr(t, k) for k in steps}})
    validate_model(m)
    if t.learning_rate < 0 or t.weight_decay < 0 or t.grad_clip_norm < 0:
        raise ConfigError("training.learning_rate, weight_decay and grad_clip_norm must be >= 0")
    if t.warmup_steps < 0:
        raise ConfigError(f"training.warmup_steps={t.warmup_steps} must be >= 0")
    if t.eval_every < 0 or t.eval_batches <= 0:
        raise ConfigError("training.eval_every must be >= 0 and training.eval_batches positive")
    _validate_data(d)
    if c.every_steps < 0 or c.every_seconds < 0 or c.keep < 1:
        raise ConfigError("checkpoint.every_steps and every_seconds must be >= 0 and checkpoint.keep >= 1")
    _validate_step(t, d, m)
    _validate_images(d, m)
    _validate_post_training(t, d, cfg.model)


def _validate_data(d: DataConfig) -> None:
    """Where the data comes from and which fields it reads."""
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
    file_sources = (DataSource.text, DataSource.jsonl, DataSource.parquet, DataSource.array_record)
    records = d.source in (DataSource.jsonl, DataSource.parquet)
    if d.hf_dataset is not None and (not records or d.train_files):
        raise ConfigError(
            "data.hf_dataset is read instead of data.train_files, under data.source=jsonl or parquet"
        )
    if d.source in file_sources and not d.train_files and d.hf_dataset is None:
        raise ConfigError(f"data.train_files is empty: data.source={d.source.value} reads the files it lists")
    if (d.prompt_field is None) != (d.completion_field is None):
        raise ConfigError("data.prompt_field and data.completion_field must be set together")
    if d.prompt_field is not None and not records:
        raise ConfigError("data.prompt_field is for records: data.source=jsonl or parquet")
    if d.messages_field is not None and (not records or d.prompt_field is not None):
        raise ConfigError(
            "data.messages_field reads conversations from records (data.source=jsonl or parquet), "
            "without data.prompt_field"
        )
    g = d.reasoning_gym
    if d.source is DataSource.reasoning_gym and (not g.tasks or g.size < 1 or g.eval_size < 1):
        raise ConfigError(
            "data.reasoning_gym needs tasks (reasoning-gym dataset names) and a positive size and eval_size"
        )
    if unknown := sorted(set(g.settings) - set(g.tasks)):
        raise ConfigError(
            f"data.reasoning_gym.settings names {unknown[0]!r}, which is not in data.reasoning_gym.tasks"
        )
    if not d.train_on_roles or not set(d.train_on_roles) <= set(CHAT_ROLES):
        raise ConfigError(
            f"data.train_on_roles={list(d.train_on_roles)} must name some of {', '.join(CHAT_ROLES)}"
        )


def _validate_step(t: TrainingConfig, d: DataConfig, m: ModelConfig) -> None:
    """The step's settings that depend on each other: logit chunks, gradient syncs, attention,
    offloading, samples."""
    if t.loss_chunk_size < 0 or (0 < t.loss_chunk_size < d.seq_len and d.seq_len % t.loss_chunk_size):
        raise ConfigError(
            f"training.loss_chunk_size={t.loss_chunk_size} must divide data.seq_len={d.seq_len} "
            f"(or be 0 or at least data.seq_len)"
        )
    if t.gradient_accumulation_steps % t.sync_gradients_every:
        raise ConfigError(
            f"training.sync_gradients_every={t.sync_gradients_every} must divide "
            f"training.gradient_accumulation_steps={t.gradient_accumulation_steps}"
        )
    if t.attention is AttentionImpl.cudnn:
        if t.mixed_precision is not MixedPrecision.bf16:
            raise ConfigError(
                "training.attention=cudnn needs training.mixed_precision=bf16 (cuDNN's flash "
                "attention has no float32 kernel)"
            )
        if m.attn_logit_softcap is not None:
            raise ConfigError(
                "training.attention=cudnn cannot soft-cap attention logits: set "
                "model.attn_logit_softcap=null or training.attention=xla"
            )
    if t.offload_master_weights and t.mixed_precision is not MixedPrecision.bf16:
        raise ConfigError(
            "training.offload_master_weights=true keeps the float32 master copy on the host while "
            "the step computes in bf16: set training.mixed_precision=bf16 (under fp32 the "
            "parameters have no second copy)"
        )
    if t.sample_every < 0 or t.sample_max_new_tokens < 1:
        raise ConfigError("training.sample_every must be >= 0 and training.sample_max_new_tokens positive")
    if t.eval_tasks and (
        not t.eval_every or not reads_text(d) or t.eval_tasks_limit is not None and t.eval_tasks_limit < 1
    ):
        raise ConfigError(
            "training.eval_tasks runs every training.eval_every steps (not 0) on text data with a tokenizer; "
            "training.eval_tasks_limit must be positive or null"
        )
    if t.sample_every and (not t.sample_prompts or not reads_text(d)):
        raise ConfigError(
            "training.sample_every needs training.sample_prompts and text data with a tokenizer "
            "(not data=synthetic, nor array_record without data.tokenizer): set it to 0"
        )


def _validate_images(d: DataConfig, m: ModelConfig) -> None:
    """How rows hold images, and the read-ahead."""
    if d.images_per_row < 1:
        raise ConfigError(f"data.images_per_row={d.images_per_row} must be positive")
    if d.pan_and_scan_crops < 0 or d.pan_and_scan_crops == 1:
        raise ConfigError(f"data.pan_and_scan_crops={d.pan_and_scan_crops} must be 0 (off) or at least 2")
    if d.pan_and_scan_crops and (m.vision is None or not m.vision.traits.pan_and_scan):
        raise ConfigError("data.pan_and_scan_crops is Gemma 3's (model.vision.encoder=siglip); set it to 0")
    if d.prefetch_batches < 0:
        raise ConfigError(f"data.prefetch_batches={d.prefetch_batches} must be >= 0")


def _validate_post_training(t: TrainingConfig, d: DataConfig, m: ModelConfig) -> None:
    """LoRA's settings, and what every objective but lm needs of the data; the objectives' own
    sections check themselves (config/objectives.py: DpoConfig.check, GrpoConfig.check, ...)."""
    _validate_lora(t.lora, m)
    objective = t.objective
    if objective is Objective.distill:
        t.distill.check(m.vocab_size)
    name = f"training.objective={objective.value}"
    paired = objective.preference_loss is not None or objective is Objective.reward
    if d.padding_free and m.vision is not None:
        raise ConfigError(
            "data.padding_free: rows with images are not packed (model.vision): set it to false"
        )
    if d.padding_free and not (paired or objective.on_policy):
        raise ConfigError(
            f"data.padding_free packs preference pairs and rollouts (the preference, reward and "
            f"on-policy objectives); {name} always packs its documents: set it to false"
        )
    if objective in (Objective.lm, Objective.distill):  # both read the data's tokens
        return
    records = d.source in (DataSource.jsonl, DataSource.parquet)
    if not (records or d.source is DataSource.reasoning_gym and objective.on_policy):
        fields = (
            "prompt, chosen and rejected"
            if paired
            else "prompt, completion and label"
            if objective is Objective.kto
            else "prompt (and what the rewards read)"
        )
        raise ConfigError(
            f"{name} reads records with {fields}: set data=jsonl (or parquet) data.train_files=[...]"
        )
    if d.prompt_field is not None:
        raise ConfigError(
            f"data.prompt_field and data.completion_field are for training.objective=lm; {name} "
            f"reads the fields it names"
        )
    if paired or objective is Objective.kto:  # two rows a record
        if t.micro_batch_size % 2 and not d.padding_free:
            raise ConfigError(
                f"training.micro_batch_size={t.micro_batch_size} must be even under {name}: each "
                f"{'pair' if paired else 'record'} is two rows "
                f"({'chosen, rejected' if paired else 'its own, a mismatched one'}) kept on one device"
            )
        if objective.preference_loss is not None:
            t.dpo.check(objective)
        elif objective is Objective.kto:
            t.kto.check()
        return
    _validate_on_policy(t, m)  # the on-policy objectives, the ones left


def _validate_lora(lora: LoraConfig, m: ModelConfig) -> None:
    """LoRA's adapters and how its frozen base is held."""
    if lora.rank is not None:
        if lora.rank <= 0:
            raise ConfigError(f"training.lora.rank={lora.rank} must be positive (or null for no adapters)")
        known = LORA_TARGETS + (VISION_LORA_TARGETS if m.vision is not None else ())
        unknown = [x for x in lora.targets if x not in known]
        if unknown or not lora.targets:
            raise ConfigError(
                f"training.lora.targets={list(lora.targets)}: "
                f"{'unknown projection ' + repr(unknown[0]) if unknown else 'empty'}; "
                f"choose from {', '.join(known)}"
            )
        if "vision_gate" in lora.targets and not m.vision.traits.gated_mlp:
            raise ConfigError(
                "training.lora.targets: vision_gate is Gemma 4's tower's; SigLIP's MLP has no gate"
            )
    elif lora.base_quantization is not BaseQuantization.none:
        raise ConfigError(
            f"training.lora.base_quantization={lora.base_quantization.value} quantizes LoRA's frozen "
            f"base: set training.lora.rank too"
        )
    if lora.base_quantization is BaseQuantization.gguf and not str(m.init_from or "").endswith(".gguf"):
        raise ConfigError(
            "training.lora.base_quantization=gguf trains on a GGUF file's blocks: set model.init_from "
            f"to a .gguf file (it is {m.init_from!r})"
        )
    if (
        lora.base_quantization is BaseQuantization.nf4
    ):  # its blocks of 64 run along head_dim and the MLP width
        for name, axis, size in (
            ("layers.attn.q_DNH", "head_dim", m.head_dim),
            ("layers.mlp.gate_DF", "mlp", m.hidden_dim),
            ("a global layer's q_DNH", "global_head_dim", m.gemma4.global_head_dim or 64),
        ):
            if size % 64:
                raise ConfigError(
                    f"training.lora.base_quantization=nf4: {name} has {axis} {size}, not a multiple of "
                    f"the block size 64; use int8 or none"
                )


def _validate_on_policy(t: TrainingConfig, m: ModelConfig) -> None:
    """The rollout's and the policy loss's sections, and what on-policy distillation, GKD and PPO need."""
    objective, r = t.objective, t.rollout
    r.check(objective, t.micro_batch_size)
    t.grpo.check(objective)
    correction = t.grpo.off_policy_correction
    if correction is not None and not (r.asynchronous or r.max_staleness or r.iterations > 1):
        raise ConfigError(
            f"training.grpo.off_policy_correction={correction.value} corrects tokens other weights drew: "
            f"set training.rollout.asynchronous, max_staleness or iterations, or leave it null"
        )
    name = f"objective={objective.value}"
    teaching = objective in (Objective.distill_on_policy, Objective.gkd)  # a live teacher
    if objective is Objective.distill_on_policy and not t.distill.teacher:
        raise ConfigError(
            f"{name} needs training.distill.teacher: the checkpoint whose log-probabilities of the "
            f"sampled tokens make the advantages"
        )
    if teaching and t.distill.teacher_logits:
        raise ConfigError(
            f"training.distill.teacher_logits is objective=distill's stored teacher; {name} scores the "
            f"sampled tokens with the live training.distill.teacher: unset teacher_logits"
        )
    if objective is Objective.gkd:
        t.distill.check_gkd()
        t.distill.check(m.vocab_size)
        if t.grpo.beta:
            raise ConfigError(
                f"training.grpo.beta={t.grpo.beta}: GKD's loss has no KL to a reference; set it to 0"
            )
        if r.tools or r.environment is not None:
            raise ConfigError(
                "training.rollout.tools and environment: GKD's completions are one turn (the records' "
                "or the student's); set them to [] and null"
            )
    if teaching and (r.dynamic_sampling or r.routing_replay):
        raise ConfigError(
            f"training.rollout.dynamic_sampling and routing_replay are for rewards and the student's "
            f"experts; under {name} set them to false"
        )
    if t.rloo.normalize_advantages and objective is not Objective.rloo:
        raise ConfigError(
            f"training.rloo.normalize_advantages is objective=rloo's; {name} "
            f"{'whitens its advantages' if objective is Objective.reinforce_pp else 'has its own advantages'}"
        )
    if not t.reinforce_pp.baseline and objective is not Objective.reinforce_pp:
        raise ConfigError(f"training.reinforce_pp.baseline is objective=reinforce_pp's; {name} has none")
    if objective is Objective.ppo:
        _check_ppo(t, m)
    if r.routing_replay:
        _check_routing_replay(m)


def _check_ppo(t: TrainingConfig, m: ModelConfig) -> None:
    """What PPO needs: its critic, the value head, trained with the policy."""
    t.ppo.check()
    if not m.score_head:
        raise ConfigError(
            "objective=ppo reads a critic: set model.score_head=true, the value head on the policy's "
            "trunk (the objective=ppo config sets it)"
        )
    if t.rollout.dynamic_sampling:
        raise ConfigError(
            "training.rollout.dynamic_sampling replaces groups whose rewards are equal; PPO's critic "
            "learns from them: set it to false under objective=ppo"
        )


def _check_routing_replay(m: ModelConfig) -> None:
    """What training.rollout.routing_replay needs: experts, each recorded in a byte."""
    if not m.moe.experts:
        raise ConfigError(
            f"training.rollout.routing_replay replays the experts the engine chose: model {m.name} has "
            f"none (model.moe.experts=0); set it to false"
        )
    if m.moe.experts > 256:
        raise ConfigError(
            f"training.rollout.routing_replay records each expert in a byte: model.moe.experts="
            f"{m.moe.experts} is more than 256"
        )


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=Config)


def _describe_omegaconf_error(exc: BaseException) -> str:
    """One line from hydra/OmegaConf's multi-line composition errors. Under a tracer (a debugger,
    coverage) or OC_CAUSE=1, OmegaConf chains its unformatted cause ('$VALUE', no key): skipped."""
    from omegaconf.errors import OmegaConfBaseException

    causes = [exc]  # hydra raises a user config's error during its own handling (__context__)
    while (causes[-1].__cause__ or causes[-1].__context__) is not None and len(causes) < 20:
        causes.append(causes[-1].__cause__ or causes[-1].__context__)
    for err in reversed(causes):
        if isinstance(err, OmegaConfBaseException) and getattr(err, "_initialized", True):
            key = getattr(err, "full_key", None)
            msg = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
            if key in deprecated.MOVED:
                return f"config key '{key}' moved to {deprecated.MOVED[key]}: set that instead"
            if "not in struct" in msg or "Key '" in msg and "not" in msg:
                return f"unknown config key '{key}': check its spelling against tunix_train/configs/"
            return f"config key '{key}': {msg}" if key else msg
    return str(exc).strip().splitlines()[0]


def _user_config_dir(args: list[str]) -> tuple[Path | None, list[str]]:
    """`--config-dir DIR` (or `--config-dir=DIR`) taken out of the arguments: (DIR, the rest)."""
    rest, found = list(args), None
    for i, arg in enumerate(rest):
        if arg == "--config-dir" or arg.startswith("--config-dir="):
            value = arg.partition("=")[2] if "=" in arg else (rest[i + 1] if i + 1 < len(rest) else "")
            del rest[i : i + (1 if "=" in arg else 2)]
            found = Path(value).expanduser().resolve()
            if not value or not found.is_dir():
                raise ConfigError(
                    f"--config-dir {value!r} is not a directory: name a folder of hydra configs"
                )
            break
    return found, rest


@contextlib.contextmanager
def _hydra(user_dir: Path | None):
    """Hydra's global state for one composition: the package's configs, after `user_dir` if given.
    The search path is built as hydra.main builds it for --config-dir (hydra._internal: hydra is
    pinned below 1.4)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup()
    try:
        search_path = create_config_search_path(f"file://{CONFIG_DIR}")
        if user_dir is not None:
            search_path.prepend("command-line", f"file://{user_dir}", anchor=SearchPathQuery(provider="main"))
        GlobalHydra.instance().clear()
        Hydra.create_main_hydra2(task_name="app", config_search_path=search_path)
        yield
    finally:
        restore_gh_from_backup(backup)


def load_config(args: list[str]) -> tuple[Config, dict[str, Any]]:
    """Composes configs/config.yaml with hydra overrides (and `--config-dir DIR`, the user's configs).

    Returns the validated Config and the run's hydra facts: `run_dir` and `overrides`.
    """
    import yaml
    from hydra import compose
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    _register_schema()
    user_dir, overrides = _user_config_dir(args)
    overrides = deprecated.rewritten(overrides)
    try:
        with _hydra(user_dir):
            raw = compose("config", overrides=overrides, return_hydra_config=True)
        run_info = {
            "run_dir": str(raw.hydra.run.dir),
            "overrides": list(raw.hydra.overrides.task),
        }
        OmegaConf.set_struct(raw, False)
        del raw["hydra"]
        cfg = OmegaConf.to_object(raw)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_describe_omegaconf_error(exc)) from None
    except yaml.YAMLError as exc:  # a config file that is not YAML (--config-dir's are the user's)
        raise ConfigError(f"not a YAML config: {' '.join(str(exc).split())}") from None
    validate(cfg)
    return cfg, run_info
