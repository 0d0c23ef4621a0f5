"""DPO: the loss against a numpy transcription of the formula and against TRL's DPOTrainer, log 2
at the first step, pairs kept whole across meshes and accumulation, and bad input."""

import json
import math

import jax
import numpy as np
import pytest
from hf_reference import build
from test_cli import run_cli

from tunix_train.config import (
    Config,
    DataConfig,
    DataSource,
    DpoConfig,
    ModelConfig,
    Objective,
    TrainingConfig,
    with_fields,
)
from tunix_train.data.pipeline import padded_row
from tunix_train.interop import hf
from tunix_train.sharding import to_global_batch
from tunix_train.train.objectives.dpo import DirectPreference, pair_losses
from tunix_train.train.setup import setup

BETA, SMOOTHING = 0.1, 0.2


def numpy_dpo(c, r, ref_c, ref_r, beta, smoothing):
    z = beta * ((c - ref_c) - (r - ref_r))

    def log_sigmoid(x):
        return -np.log1p(np.exp(-x))

    return -(1 - smoothing) * log_sigmoid(z) - smoothing * log_sigmoid(-z)


def test_loss_equals_the_formula_on_a_hand_made_batch():
    rng = np.random.default_rng(0)
    P, T = 3, 7
    nll = rng.uniform(0.1, 5.0, (2 * P, T)).astype(np.float32)  # rows: chosen, rejected, chosen, ...
    ref_nll = rng.uniform(0.1, 5.0, (2 * P, T)).astype(np.float32)
    mask = (rng.random((2 * P, T)) < 0.6).astype(np.float32)
    objective = DirectPreference(
        Config(
            training=TrainingConfig(
                objective=Objective.dpo, dpo=DpoConfig(beta=BETA, label_smoothing=SMOOTHING)
            )
        )
    )
    loss, metrics = objective.loss(lambda: nll, lambda: ref_nll, {"loss_mask": mask}, float(P))

    logp = -(nll.astype(np.float64) * mask).sum(-1).reshape(P, 2)
    ref_logp = -(ref_nll.astype(np.float64) * mask).sum(-1).reshape(P, 2)
    expected = numpy_dpo(logp[:, 0], logp[:, 1], ref_logp[:, 0], ref_logp[:, 1], BETA, SMOOTHING)
    np.testing.assert_allclose(float(loss), expected.mean(), rtol=1e-6)
    chosen, rejected = BETA * (logp[:, 0] - ref_logp[:, 0]), BETA * (logp[:, 1] - ref_logp[:, 1])
    np.testing.assert_allclose(float(metrics["reward_margin"]), (chosen - rejected).mean(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["reward_accuracy"]), (chosen > rejected).mean(), rtol=1e-6)
    # the loss of a pair with equal log-ratios is log 2, whatever the smoothing
    assert float(pair_losses(-3.0, -4.0, -3.0, -4.0, BETA, SMOOTHING)[0]) == pytest.approx(
        math.log(2), abs=1e-7
    )


def _trl_reference(tmp_path, pairs):
    """transformers models (policy, reference), TRL's tokenized pairs and its loss for the first batch."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer

    words = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"w{i}" for i in range(124)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    policy = build("gemma3", tmp_path / "policy")
    reference = build("gemma3", tmp_path / "reference")
    with torch.no_grad():  # a reference unlike the policy, so the loss is not log 2
        torch.manual_seed(1)
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    reference.save_pretrained(tmp_path / "reference")
    # TRL 1.x's "sigmoid" loss has no label smoothing (its cDPO form moved to loss_type="robust", which
    # also rescales): compared without; the smoothed formula is checked against numpy above.
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        beta=BETA,
        report_to=[],
        bf16=False,
        per_device_train_batch_size=len(pairs),
        use_cpu=True,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=Dataset.from_list(pairs),
        processing_class=tokenizer,
    )
    tokenized = [trainer.train_dataset[i] for i in range(len(pairs))]
    with torch.no_grad():
        loss = trainer._compute_loss(policy.eval(), trainer.data_collator(tokenized), False)
    return tokenized, float(loss)


@pytest.mark.parametrize(
    "mesh_shape, devices, accumulation, sync_every",
    [
        ([[1], ["fsdp"]], 1, 1, 1),
        ([[2, 2], ["fsdp", "tp"]], 4, 1, 1),
        ([[8], ["fsdp"]], 8, 1, 1),
        ([[2, 2], ["fsdp", "tp"]], 4, 2, 1),
        ([[2, 2], ["fsdp", "tp"]], 4, 2, 2),
    ],
)
def test_first_step_loss_matches_trl_on_any_mesh(tmp_path, mesh_shape, devices, accumulation, sync_every):
    """sync_every 2: gradients reduced once per two micro-batches; the metrics still one number each."""
    rng = np.random.default_rng(0)

    def sentence(n):
        return " ".join(f"w{i}" for i in rng.integers(0, 124, n))

    pairs = [
        {
            "prompt": sentence(4),
            "chosen": " " + sentence(rng.integers(2, 6)),
            "rejected": " " + sentence(rng.integers(2, 6)),
        }
        for _ in range(8)
    ]
    tokenized, trl_loss = _trl_reference(tmp_path, pairs)

    T = 16
    model = with_fields(
        ModelConfig(name="policy", mesh_shape=mesh_shape),
        hf.model_fields_from_hf(hf.read_hf_config(tmp_path / "policy")),
    )
    pairs_per_micro = len(pairs) // accumulation
    cfg = Config(
        model=model,
        data=DataConfig(source=DataSource.jsonl, seq_len=T),
        training=TrainingConfig(
            objective=Objective.dpo,
            dpo=DpoConfig(beta=BETA),
            loss_chunk_size=0,
            micro_batch_size=2 * pairs_per_micro * devices // np.prod(mesh_shape[0]),
            gradient_accumulation_steps=accumulation,
            sync_gradients_every=sync_every,
        ),
    )
    run = setup(cfg, jax.devices()[:devices])
    state = run.plan.from_params(hf.load_params(tmp_path / "policy", model, run.plan.base))
    state = state.replace(frozen=hf.load_params(tmp_path / "reference", model, run.plan.base))
    rows = [
        padded_row(p["prompt_ids"], p[field], T)
        for p in tokenized
        for field in ("chosen_ids", "rejected_ids")
    ]
    batch = {k: np.stack([r[k] for r in rows]).reshape(accumulation, -1, T) for k in rows[0]}
    with jax.set_mesh(run.mesh):
        _, metrics = run.step_fn(state, to_global_batch(batch, run.mesh))
    assert float(metrics["loss"]) == pytest.approx(trl_loss, abs=1e-4)
    assert abs(trl_loss - math.log(2)) > 1e-2  # the comparison means something
    assert all(np.shape(value) == () for value in metrics.values()), {
        k: np.shape(v) for k, v in metrics.items()
    }


def dpo_on(pairs) -> tuple[str, ...]:
    """The overrides of a DPO run of gemma3_tiny on the pairs file `pairs`."""
    return (
        "model=gemma3_tiny",
        "model.vocab_size=4096",
        "objective=dpo",
        "data=jsonl",
        f"data.train_files=[{pairs}]",
    )


def dpo_cli(tmp_path, *overrides):
    """A 12-step DPO run of run_training.py on 32 pairs, on fsdp2 x tp2: its directory and metrics."""
    _write_pairs(tmp_path / "pairs.jsonl", n=32)
    run_dir = tmp_path / "run"
    result = run_cli(
        *dpo_on(tmp_path / "pairs.jsonl"),
        "data.seq_len=16",
        "training.max_steps=12",
        "training.log_every=1",
        "training.learning_rate=3e-3",
        "training.warmup_steps=0",
        'model.mesh_shape=[[2,2],["fsdp","tp"]]',
        f"hydra.run.dir={run_dir}",
        *overrides,
    )
    assert result.returncode == 0, result.stderr
    return run_dir, [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _write_pairs(path, n=64, drop=None):
    rng = np.random.default_rng(0)
    words = ["king", "queen", "night", "day", "love", "sword"]
    with open(path, "w") as f:
        for i in range(n):
            row = {
                "prompt": " ".join(rng.choice(words, 3)) + ":",
                "chosen": " " + " ".join(rng.choice(words, 2)),
                "rejected": " " + " ".join(rng.choice(words, 4)),
            }
            if i == n - 1 and drop:
                del row[drop]
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize(
    "lora",
    [
        (),
        ("training.lora.rank=8", "training.lora.targets=[q,v,up,down]"),
        pytest.param(
            (
                "training.lora.rank=8",
                "training.lora.targets=[q,v,up,down]",
                "training.lora.base_quantization=nf4",
                "model.head_dim=64",
            ),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_first_step_loss_is_log_2_and_training_separates_the_pairs(tmp_path, lora):
    """Without LoRA the reference is a frozen copy of the starting weights; with it, the base with
    the adapters off (no copy)."""
    run_dir, metrics = dpo_cli(tmp_path, *lora, "training.eval_every=0")
    steps = [m for m in metrics if "loss" in m]
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.05 and steps[-1]["reward_margin"] > 0
    log = (run_dir / "train.log").read_text()
    assert ("in LoRA adapters (rank 8" in log) == bool(lora) and ("frozen reference copy" in log) != bool(
        lora
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.train_files=[{tmp}/bad.jsonl]"],
            "{tmp}/bad.jsonl:64: no string or messages field 'rejected'",
        ),
        (
            ["data.train_files=[{tmp}/pairs.jsonl]", "training.micro_batch_size=3"],
            "training.micro_batch_size=3 must be even",
        ),
        (["data.train_files=[{tmp}/pairs.jsonl]", "data.seq_len=8"], "longer than data.seq_len=8"),
        (["data=synthetic"], "training.objective=dpo reads records with prompt, chosen and rejected"),
    ],
)
def test_bad_input_is_one_line(tmp_path, overrides, message):
    _write_pairs(tmp_path / "pairs.jsonl")
    _write_pairs(tmp_path / "bad.jsonl", drop="rejected")
    overrides = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    result = run_cli(
        "model=gemma3_tiny",
        "model.vocab_size=4096",
        "objective=dpo",
        *([] if "data=synthetic" in overrides else ["data=jsonl"]),
        *overrides,
        f"hydra.run.dir={tmp_path}/run",
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1 and lines[0].startswith("tunix_train: error:"), (
        result.stderr
    )
    assert message.replace("{tmp}", str(tmp_path)) in lines[0]
    assert not (tmp_path / "run").exists()
