"""KTO (training.objective=kto): the loss equals TRL 1.16's KTOTrainer._compute_loss on a fixed
batch (its forwards replaced by the per-token log-probabilities of the same logits; with the
reference as a model of its own and as the LoRA base alike, TRL's reference enters as its
log-probabilities) within 1e-6, under accumulation too; a run on fsdp2 x tp2 trains 20 steps and
resumes bit-identically; bad records are one line."""

import collections
import json
import types

import jax
import numpy as np
import pytest
from conftest import accumulated_loss, config, random_logits_and_labels, token_nlls

from tunix_train.config import Config, ConfigError, KtoConfig, TrainingConfig
from tunix_train.train.objectives.kto import KahnemanTversky

R, T, V = 6, 12, 11  # records, positions, vocabulary
LABELS = np.array([True, False, True, True, False, False])


def _records(seed: int):
    """Random logits of the policy and the reference for R records, each its own row then its
    mismatched one, and labels (-100 off the completion)."""
    return random_logits_and_labels(2 * R, T, V, seed)


def _ours(cfg: KtoConfig, logits, ref_logits, labels, accumulation=1):
    mask, nll_BT, ref_nll_BT = token_nlls(labels, logits, ref_logits)
    desirable = np.repeat(LABELS, 2)[:, None] * np.ones((1, T - 1), np.float32)
    objective = KahnemanTversky(Config(training=TrainingConfig(kto=cfg)))
    weight = objective.weight({"loss_mask": mask.reshape(accumulation, -1, T - 1)})
    micro = {"loss_mask": mask, "desirable": desirable}
    return accumulated_loss(objective, nll_BT, ref_nll_BT, micro, weight, accumulation)


def _trl(cfg: KtoConfig, logits, ref_logits, labels, records=slice(None)) -> tuple[float, float]:
    """(TRL's KTOTrainer._compute_loss, its kl) on the same records: its rows are each record's own,
    its KL rows the mismatched ones, its reference log-probabilities precomputed from ref_logits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl")
    from trl import KTOTrainer

    own, mismatched = np.arange(2 * R)[records][0::2], np.arange(2 * R)[records][1::2]

    def logp(x, rows):
        return torch.log_softmax(torch.tensor(x[rows, :-1]), -1).gather(
            -1, torch.tensor(np.maximum(labels[rows, 1:], 0))[..., None]
        )[..., 0] * torch.tensor(labels[rows, 1:] != -100)

    class Model:
        training = True

        def __call__(self, input_ids, **_):  # the KL rows come with input_ids of ones
            rows = mismatched if bool(input_ids[0, 0]) else own
            zero = torch.zeros(len(rows), T - 1)
            return types.SimpleNamespace(
                log_probs=logp(logits, rows), entropy=zero, mean_logits=zero, aux_loss=None
            )

    def mask(rows):
        return torch.tensor(labels[rows] != -100).long()

    n = len(own)
    inputs = {
        "input_ids": torch.zeros(n, T, dtype=torch.long),
        "attention_mask": torch.ones(n, T),
        "completion_mask": mask(own),
        "KL_input_ids": torch.ones(n, T, dtype=torch.long),
        "KL_attention_mask": torch.ones(n, T),
        "KL_completion_mask": mask(mismatched),
        "label": torch.tensor(LABELS[own // 2]),
        "ref_logps": logp(ref_logits, own).sum(-1),
        "ref_KL_logps": logp(ref_logits, mismatched).sum(-1),
    }
    trainer = types.SimpleNamespace(
        model=Model(),
        accelerator=types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x),
        calculate_KL=True,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=cfg.beta,
        desirable_weight=cfg.desirable_weight,
        undesirable_weight=cfg.undesirable_weight,
        aux_loss_enabled=False,
        _metrics={"train": collections.defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    trainer._compute_kl_logps = lambda model, batch: KTOTrainer._compute_kl_logps(trainer, model, batch)
    loss = float(KTOTrainer._compute_loss(trainer, trainer.model, inputs, False))
    return loss, trainer._metrics["train"]["kl"][-1]


@pytest.mark.parametrize(
    "cfg", [KtoConfig(beta=0.1), KtoConfig(beta=0.5, desirable_weight=1.33, undesirable_weight=0.75)]
)
@pytest.mark.parametrize("seed", [0, 3])
def test_loss_equals_trls_kto_trainer(cfg, seed):
    logits, ref_logits, labels = _records(seed)
    expected, kl = _trl(cfg, logits, ref_logits, labels)
    loss, metrics = _ours(cfg, logits, ref_logits, labels)
    assert loss == pytest.approx(expected, abs=1e-6)
    assert metrics["kl"] == pytest.approx(kl, abs=1e-5)
    # under accumulation each micro-batch has its own reference point, as TRL's steps do
    halves = [_trl(cfg, logits, ref_logits, labels, slice(h * R, (h + 1) * R)) for h in (0, 1)]
    assert _ours(cfg, logits, ref_logits, labels, accumulation=2)[0] == pytest.approx(
        sum(loss for loss, _ in halves) / 2, abs=1e-6
    )


def test_the_reference_point_is_floored_at_zero_and_moves_the_loss():
    """A policy far less likely than the reference on the mismatched rows: z = 0 (TRL's clamp); a
    policy more likely there: z > 0, and the loss differs from the one with z = 0."""
    logits, ref_logits, labels = _records(5)
    mismatched = (np.arange(2 * R) % 2 == 1)[:, None, None]
    target = np.zeros_like(logits)  # 1 on each position's target (logits at t predict labels at t + 1)
    target[:, :-1] = np.eye(V)[np.maximum(labels[:, 1:], 0)]
    below = np.where(mismatched, ref_logits - 30 * target, logits)
    assert _ours(KtoConfig(), below, ref_logits, labels)[1]["kl"] == 0.0
    above = np.where(mismatched, ref_logits + 3 * target, logits)
    loss, metrics = _ours(KtoConfig(), above, ref_logits, labels)
    assert metrics["kl"] > 0.1 and loss == pytest.approx(
        _trl(KtoConfig(), above, ref_logits, labels)[0], abs=1e-6
    )


def _records_file(path, n=32):
    rng = np.random.default_rng(0)
    words = ["king", "queen", "night", "day", "love", "sword", "crown", "horse"]
    with open(path, "w") as f:
        for i in range(n):
            prompt = " ".join(rng.choice(words, 3)) + ":"
            f.write(
                json.dumps(
                    {
                        "prompt": prompt,
                        "completion": " " + " ".join(rng.choice(words, 3)),
                        "label": i % 3 != 0,
                    }
                )
                + "\n"
            )
    return path


KTO = (
    "objective=kto",
    "data=jsonl",
    "data.seq_len=32",
    "model.vocab_size=4096",  # the bundled tokenizer's
    "training.eval_every=0",
    "training.log_every=1",
)


@pytest.mark.slow  # 20 steps and a stopped-and-resumed run on fsdp2 x tp2
@pytest.mark.parametrize("lora", [(), ("training.lora.rank=4", "training.lora.targets=[q,k,v,o]")])
def test_twenty_steps_on_fsdp2_tp2_then_a_bit_identical_resume(tmp_path, lora):
    """A full fine-tune (its reference a frozen copy) and LoRA (its reference the base: no second
    model, TRL's ref_model=None under PEFT)."""
    from conftest import assert_resumes_bit_identically, read_metrics

    from tunix_train.train.loop import train

    cfg = config(
        *KTO,
        f"data.train_files=[{_records_file(tmp_path / 'records.jsonl')}]",
        "training.micro_batch_size=4",
        "training.learning_rate=1e-3" if not lora else "training.learning_rate=1e-2",
        *lora,
        "training.lr_schedule=constant",
        "checkpoint.every_steps=2",
        'model.mesh_shape=[[2,2],["fsdp","tp"]]',
    )
    cfg.training.max_steps = 20
    train(cfg, tmp_path / "twenty", devices=jax.devices()[:4])
    logged = [m for m in read_metrics(tmp_path / "twenty") if "loss" in m]
    assert len(logged) == 20 and all(np.isfinite([m["loss"], m["kl"]]).all() for m in logged)
    assert logged[0]["loss"] == pytest.approx(0.5, abs=1e-6)  # policy = reference: 1 - sig(0) each
    assert logged[-1]["loss"] < 0.45  # it learns: the desirable completions up, the others down
    assert logged[-1]["reward_desirable"] > logged[-1]["reward_undesirable"]
    assert_resumes_bit_identically(cfg, tmp_path / "resume", ("loss", "kl"), jax.devices()[:4])


@pytest.mark.parametrize(
    "record, message",
    [
        (
            {"prompt": "a:", "completion": " b", "label": "yes"},
            "record 1's label is 'yes': write true",
        ),
        ({"prompt": "a:", "completion": " b"}, "record 1's label is None: write true"),
    ],
)
def test_a_bad_record_is_one_line(tmp_path, record, message):
    from tunix_train.train.loop import train

    good = {"prompt": "a:", "completion": " b", "label": True}
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [record] + [good] * 99))
    cfg = config(*KTO, f"data.train_files=[{tmp_path / 'records.jsonl'}]", "training.max_steps=1")
    with pytest.raises(ConfigError, match=message):
        train(cfg, tmp_path / "run", devices=jax.devices()[:1])
    with pytest.raises(ConfigError, match="training.kto.beta=0.0 must be positive"):
        train(
            config(*KTO, "training.kto.beta=0", f"data.train_files=[{tmp_path / 'records.jsonl'}]"),
            tmp_path / "r2",
            devices=jax.devices()[:1],
        )
