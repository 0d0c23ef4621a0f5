"""The preference losses beyond DPO (objective=ipo, orpo, simpo) against TRL 1.16's own
code on the same per-token log-probabilities, exact under accumulation, and trained end to end."""

import collections
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import accumulated_loss, random_logits_and_labels, token_nlls
from test_cli import run_cli
from test_dpo import _write_pairs, dpo_cli, dpo_on

from tunix_train.config import Config, DpoConfig, Objective, PreferenceLoss, TrainingConfig
from tunix_train.train.objectives.dpo import DirectPreference

torch = pytest.importorskip("torch")
pytest.importorskip("trl")

P, T, V = 4, 12, 11  # pairs, positions, vocabulary
BETA, GAMMA = 0.7, 0.3


def _pairs(seed: int = 0):
    """Random logits and labels of P pairs (rows chosen, rejected, ...)."""
    return random_logits_and_labels(2 * P, T, V, seed)


def _ours(kind, logits, ref_logits, labels, label_smoothing=0.0, accumulation=1):
    """Our objective's loss on the per-token NLL of the same logits (targets are labels shifted by one)."""
    mask, nll_BT, ref_nll_BT = token_nlls(labels, logits, ref_logits)
    objective = DirectPreference(
        Config(
            training=TrainingConfig(
                objective=Objective("dpo" if kind is PreferenceLoss.sigmoid else kind.value),
                dpo=DpoConfig(beta=BETA, label_smoothing=label_smoothing, simpo_gamma=GAMMA),
            )
        )
    )
    batch = {
        "inputs": np.zeros((accumulation, 2 * P // accumulation, T - 1), np.int32),
        "loss_mask": mask.reshape(accumulation, -1, T - 1),
    }
    weight = jax.tree.map(lambda w: jnp.maximum(w, 1.0), objective.weight(batch))
    return accumulated_loss(objective, nll_BT, ref_nll_BT, {"loss_mask": mask}, weight, accumulation)


def _cpo_trainer(kind, label_smoothing):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    return types.SimpleNamespace(
        alpha=0.0,
        loss_type=kind,
        simpo_gamma=GAMMA,
        beta=BETA,
        label_smoothing=label_smoothing,
        accelerator=types.SimpleNamespace(device="cpu"),
        get_batch_logps=CPOTrainer.get_batch_logps,
        cpo_loss=CPOTrainer.cpo_loss,
    )


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_simpo_equals_trl_cpo_trainer(label_smoothing):
    """SimPO is TRL's CPOTrainer with loss_type="simpo" and cpo_alpha=0 (no NLL term)."""
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    logits, ref_logits, labels = _pairs()
    trl = _cpo_trainer("simpo", label_smoothing)
    avg = CPOTrainer.get_batch_logps(torch.tensor(logits), torch.tensor(labels), average_log_prob=True)
    losses, chosen, rejected = CPOTrainer.cpo_loss(trl, avg[0::2], avg[1::2])
    ours, metrics = _ours(PreferenceLoss.simpo, logits, ref_logits, labels, label_smoothing)
    assert ours == pytest.approx(float(losses.mean()), abs=1e-6)
    assert metrics["reward_margin"] == pytest.approx(float((chosen - rejected).mean()), abs=1e-6)


def test_orpo_equals_trl_orpo_trainer():
    """ORPO: TRL's odds_ratio_loss and its cross-entropy of the chosen rows, on the answer's tokens
    (TRL's own NLL also counts the prompt's; ours is the paper's L_SFT)."""
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    logits, ref_logits, labels = _pairs(1)
    trl = types.SimpleNamespace(beta=BETA, accelerator=types.SimpleNamespace(device="cpu"))
    avg = ORPOTrainer.get_batch_logps(torch.tensor(logits), torch.tensor(labels), average_log_prob=True)
    ratio_terms = ORPOTrainer.odds_ratio_loss(trl, avg[0::2], avg[1::2])[0]
    chosen = torch.tensor(logits[0::2, :-1]).reshape(-1, V), torch.tensor(labels[0::2, 1:]).reshape(-1)
    nll = torch.nn.CrossEntropyLoss()(*chosen)
    expected = float(nll - ratio_terms.mean())
    for accumulation in (1, 2, 4):  # the NLL's token mean is the whole batch's under accumulation
        ours, metrics = _ours(PreferenceLoss.orpo, logits, ref_logits, labels, accumulation=accumulation)
        assert ours == pytest.approx(expected, abs=1e-6), accumulation
        assert metrics["nll"] == pytest.approx(float(nll), abs=1e-6)


def _trl_dpo_loss(kind, logits, ref_logits, labels) -> float:
    """TRL DPOTrainer._compute_loss itself, its model and reference forwards replaced by the
    per-token log-probabilities of the same logits."""
    from trl import DPOTrainer

    halves = np.r_[0 : 2 * P : 2, 1 : 2 * P : 2]  # TRL's batch: every chosen row, then every rejected row
    logits, ref_logits, labels = logits[halves], ref_logits[halves], labels[halves]

    def logp(x):
        return torch.log_softmax(torch.tensor(x[:, :-1]), -1).gather(
            -1, torch.tensor(np.maximum(labels[:, 1:], 0))[..., None]
        )[..., 0] * torch.tensor(labels[:, 1:] != -100)

    ref_logps = logp(ref_logits).sum(-1)

    class Model:
        training = True

        def __call__(self, **_):
            zero = torch.zeros(2 * P, T - 1)
            return types.SimpleNamespace(
                log_probs=logp(logits), entropy=zero, mean_logits=zero, aux_loss=None, is_top1=zero.bool()
            )

    completion_mask = torch.tensor(labels != -100).long()
    inputs = {
        "input_ids": torch.zeros(2 * P, T, dtype=torch.long),
        "attention_mask": torch.ones(2 * P, T),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_logps[:P],
        "ref_rejected_logps": ref_logps[P:],
    }
    accelerator = types.SimpleNamespace(device="cpu", gather_for_metrics=lambda x: x, gather=lambda x: x)
    trainer = types.SimpleNamespace(
        model=Model(),
        accelerator=accelerator,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[kind],
        loss_weights=[1.0],
        beta=BETA,
        use_weighting=False,
        label_smoothing=0.0,
        _metrics={"train": collections.defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        args=types.SimpleNamespace(),
    )
    return float(DPOTrainer._compute_loss(trainer, trainer.model, inputs, False))


@pytest.mark.parametrize("kind", [PreferenceLoss.ipo, PreferenceLoss.sigmoid])
def test_ipo_and_sigmoid_equal_trl_dpo_trainer(kind):
    logits, ref_logits, labels = _pairs(2)
    expected = _trl_dpo_loss(kind.value, logits, ref_logits, labels)
    for accumulation in (1, 4):
        assert _ours(kind, logits, ref_logits, labels, accumulation=accumulation)[0] == pytest.approx(
            expected, abs=1e-6
        )


@pytest.mark.slow  # three training runs in subprocesses
@pytest.mark.parametrize("loss", ["orpo", "simpo", "ipo"])
def test_each_loss_trains_and_the_reference_free_ones_keep_no_copy(tmp_path, loss):
    run_dir, metrics = dpo_cli(
        tmp_path,
        f"training.objective={loss}",
        "training.dpo.beta=0.5",
        "training.eval_every=6",
        "training.eval_batches=1",
    )
    steps = [m for m in metrics if "loss" in m]
    assert (
        steps[-1]["loss"] < steps[0]["loss"] - 0.05 and steps[-1]["reward_margin"] > steps[0]["reward_margin"]
    )
    evals = [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert len(evals) == 3 and all(np.isfinite(evals))
    assert ("frozen reference copy" in (run_dir / "train.log").read_text()) == (loss == "ipo")


def test_label_smoothing_without_a_meaning_is_refused(tmp_path):
    _write_pairs(tmp_path / "pairs.jsonl")
    result = run_cli(
        *dpo_on(tmp_path / "pairs.jsonl"),
        "training.objective=orpo",
        "training.dpo.label_smoothing=0.1",
        f"hydra.run.dir={tmp_path}/run",
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and len(lines) == 1, result.stderr
    assert "training.dpo.label_smoothing=0.1: objective=orpo has none" in lines[0]
