"""lm-eval two ways on one model (a random gemma3_tiny on the bundled tokenizer): the native model
(evaluate/lm.py) and `local-completions` against our server give the same accuracy, on a local
multiple-choice task and a local generation task, and both equal a direct computation with
the model's logits and generate. The tasks are YAML and JSON lines written here (--include_path)."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="needs lm-eval: pip install -e '.[eval]'")
pytest.importorskip("fastapi", reason="needs FastAPI and uvicorn: pip install -e '.[serve]'")
from conftest import run_python  # noqa: E402
from test_serve_abuse import KEY, MAX_LEN, Live, _model  # noqa: E402

from tunix_train.evaluate import headline  # noqa: E402

pytestmark = pytest.mark.xdist_group("serve_scores")

QUESTIONS = [
    ("To be, or not to", [" be", " see", " go"], 0),
    ("Who is", [" there", " here", " gone"], 0),
    ("Speak the speech, I pray", [" you", " thee", " me"], 1),
    ("The lady doth protest too", [" much", " little", " long"], 0),
    ("Now is the winter of our", [" discontent", " summer", " making"], 0),
    ("A horse! a horse! my kingdom for a", [" horse", " crown", " song"], 0),
    ("All the world's a", [" stage", " play", " field"], 0),
    ("Friends, Romans,", [" countrymen", " lend", " ears"], 0),
]


def _tasks(folder: Path, answers: list[str]) -> Path:
    """local_mc (QUESTIONS) and local_gen (each question, its answer one of `answers`)."""
    rows = [{"question": q, "choices": [c.strip() for c in cs], "answer": a} for q, cs, a in QUESTIONS]
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "gen.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": t}) + "\n" for (q, _, _), t in zip(QUESTIONS, answers))
    )
    common = "dataset_path: json\ntest_split: test\ndoc_to_text: '{{question}}'\n"
    (folder / "local_mc.yaml").write_text(
        f"task: local_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "local_gen.yaml").write_text(
        f"task: local_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n', '.']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


@pytest.fixture(scope="module")
def live():
    server = Live()
    yield server
    server.stop()


def _greedy(model) -> list[str]:
    """Each question's greedy continuation of up to 6 tokens, cut at the first newline or period."""
    new = model.generate([model.tokenizer.encode(q) for q, _, _ in QUESTIONS], 6)
    return [model.tokenizer.decode(ids).split("\n")[0].split(".")[0] for ids in new]


def _direct(model, answers: list[str]):
    """The tasks' scores from model.logits and model.generate, as lm-eval defines them (a
    continuation is " " + choice, the context's trailing space moved to it; no BOS)."""
    tokenizer = model.tokenizer
    right = 0
    for question, choices, answer in QUESTIONS:
        context = tokenizer.encode(question)
        scores = []
        for choice in choices:
            whole = tokenizer.encode(question + " " + choice.strip())
            logits = np.asarray(model.logits(np.asarray([whole])), np.float64)[0]
            logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
            scores.append(sum(logp[j - 1, whole[j]] for j in range(len(context), len(whole))))
        right += int(np.argmax(scores)) == answer
    matched = sum(text == answer for text, answer in zip(_greedy(model), answers))
    return right / len(QUESTIONS), matched / len(QUESTIONS)


@pytest.mark.slow  # about a minute, most of it lm-eval's own (tasks, datasets, HTTP)
def test_native_and_local_completions_score_as_the_logits_do(live, tmp_path, monkeypatch):
    """The generation task's answers are the model's own greedy text for half the questions (else
    the truth): exact_match 0.5 if every path generates as the engine does."""
    answers = [
        t if i % 2 == 0 else cs[a].strip()
        for i, (t, (_, cs, a)) in enumerate(zip(_greedy(live.model), QUESTIONS))
    ]
    folder = _tasks(tmp_path, answers)
    direct = _direct(live.model, answers)
    assert 0 < direct[0] < 1 and 0.5 <= direct[1] < 1
    live.model.export(tmp_path / "hf")  # the CLI loads it as a Hugging Face checkpoint
    ran = run_python(
        "-m", "tunix_train.evaluate", tmp_path / "hf", "--tasks", "local_mc,local_gen",
        "--include_path", folder, "--add_bos_token", "false", "--batch_size", "4",
        "--mesh_shape", '[[2],["fsdp"]]', devices=2, timeout=600,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    native = json.loads(ran.stdout.strip().splitlines()[-1])
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    served = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": f"http://127.0.0.1:{live.port}/v1/completions",
            "model": "tiny",
            "tokenizer_backend": "remote",
            "auth_token": KEY,
            "max_length": MAX_LEN,
            "max_retries": 1,
        },
        tasks=["local_mc", "local_gen"],
        task_manager=lm_eval.tasks.TaskManager(include_path=str(folder), include_defaults=False),
    )
    served = headline(served)
    for results in (native, served):
        assert results["results"]["local_mc"]["acc,none"] == direct[0]
        assert results["results"]["local_gen"]["exact_match,none"] == direct[1]
    assert "|local_mc|" in ran.stdout.replace(" ", "")  # lm-eval's table before the line


def test_rolling_loglikelihood_is_the_sum_over_windows():
    """A text longer than max_length (16 tokens here) is scored in windows; the total equals the
    logits' log-likelihood of each window's new tokens, the first after prefix_token_id."""
    from lm_eval.api.instance import Instance

    from tunix_train.evaluate.lm import TunixLM

    model = _model()
    lm = TunixLM(model, max_length=16)
    text = "Speak the speech, I pray you, as I pronounced it to you, trippingly on the tongue."
    ids = model.tokenizer.encode(text)
    assert len(ids) > 16
    (got,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    rows = [([lm.prefix_token_id, *ids[:16]], 16)]  # the first window predicts its 16 tokens after BOS
    rows += [
        (ids[max(end - 17, 0) : end], end - start)
        for start in range(16, len(ids), 16)
        for end in [min(start + 16, len(ids))]
    ]
    want = 0.0
    for row, new in rows:  # the next windows: 17 tokens, their last `new` predicted
        logits = np.asarray(model.logits(np.asarray([row])), np.float64)[0]
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        want += sum(logp[j - 1, row[j]] for j in range(len(row) - new, len(row)))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow  # a 20-step run with three lm-eval evaluations, about a minute
def test_training_logs_lm_eval_metrics_at_its_evaluations(tmp_path):
    """training.eval_tasks on a 20-step run of the default corpus: eval_local_mc_acc at the start
    and at steps 10 and 20 beside the held-out loss, each equal to lm-eval's own accuracy of that
    step's checkpoint (the native model on the same parameters). A task lm-eval does not know is
    a one-line error before the run starts, and so is a quantized LoRA base (not taken yet)."""
    from conftest import config, read_metrics

    from tunix_train import api
    from tunix_train.config import ConfigError
    from tunix_train.evaluate import run_tasks
    from tunix_train.train.loop import train

    folder = _tasks(tmp_path, [cs[a].strip() for _, cs, a in QUESTIONS])
    common = ["model.vocab_size=4096", "data=shakespeare", f"training.eval_tasks_include_path={folder}"]
    unknown = config(*common, "training.eval_tasks=[local_mc,no_such_task]")
    with pytest.raises(ConfigError, match=f"^lm-eval knows no task 'no_such_task' \\(nor in {folder}\\)$"):
        train(unknown, tmp_path / "unknown", devices=jax.devices()[:1])
    assert not (tmp_path / "unknown").exists()
    qlora = config(
        *common,
        "training.eval_tasks=[local_mc]",
        "training.lora.rank=4",
        "training.lora.base_quantization=int8",
    )
    with pytest.raises(
        ConfigError, match="^training.eval_tasks reads merged parameters: .* quantized LoRA base"
    ):
        train(qlora, tmp_path / "qlora", devices=jax.devices()[:1])
    assert not (tmp_path / "qlora").exists()
    cfg = config(
        *common,
        "data.seq_len=32",
        "training.max_steps=20",
        "training.eval_every=10",
        "training.log_every=10",
        "training.learning_rate=3e-3",
        "training.eval_tasks=[local_mc]",
        "checkpoint.every_steps=10",
    )
    train(cfg, tmp_path / "run", devices=jax.devices()[:1])
    logged = [m for m in read_metrics(tmp_path / "run") if "eval_local_mc_acc" in m]
    assert [m["step"] for m in logged] == [0, 10, 20] and all("eval_loss" in m for m in logged[1:])
    last = api.load(tmp_path / "run" / "checkpoints" / "20", devices=jax.devices()[:1])
    accuracy = run_tasks(last, ["local_mc"], str(folder))["results"]["local_mc"]["acc,none"]
    assert logged[-1]["eval_local_mc_acc"] == accuracy
