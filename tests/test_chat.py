"""Chat templates against transformers' apply_chat_template: token ids and the assistant's mask."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[reference]'")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from conftest import REPO, config, read_metrics, run_python, run_training  # noqa: E402
from flax import nnx  # noqa: E402
from test_tokenizers import _gguf_with_the_bundled_vocabulary  # noqa: E402

from tunix_train.compose import load_config  # noqa: E402
from tunix_train.config import ConfigError  # noqa: E402
from tunix_train.data import Data  # noqa: E402
from tunix_train.data.chat import GEMMA_TEMPLATE, ChatTemplate, find_template  # noqa: E402
from tunix_train.data.tokenizer import load_tokenizer  # noqa: E402
from tunix_train.model.decoder import Decoder  # noqa: E402
from tunix_train.parallel import model_graphdef  # noqa: E402
from tunix_train.train.loop import train  # noqa: E402
from tunix_train.train.objectives import make_objective  # noqa: E402
from tunix_train.train.program import Program  # noqa: E402
from tunix_train.train.step import eval_step  # noqa: E402

TURNS = ["<start_of_turn>", "<end_of_turn>"]
CONVERSATION = [
    {"role": "system", "content": "You answer in verse."},
    {"role": "user", "content": "Who is Romeo?"},
    {"role": "assistant", "content": "A Montague, and  Juliet's love. "},
    {"role": "user", "content": "  And Tybalt?\n"},
    {"role": "assistant", "content": "Her cousin, café-bred; 你好 🤗."},
]
# A ChatML-style template with generation markers, written here.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(ours, transformers') for a tokenizer.json of the bundled vocabulary with Gemma's turn tokens
    and ChatML's added as special tokens."""
    tmp = tmp_path_factory.mktemp("chat")
    _gguf_with_the_bundled_vocabulary(tmp / "vocab.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(tmp, gguf_file="vocab.gguf")
    reference.add_special_tokens({"additional_special_tokens": TURNS + ["<|im_start|>", "<|im_end|>"]})
    reference.save_pretrained(tmp / "hf")
    return load_tokenizer(tmp / "hf", 4103), transformers.AutoTokenizer.from_pretrained(tmp / "hf")


def _reference(reference, template, messages, **kwargs):
    out = reference.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, **kwargs
    )
    return out["input_ids"], [bool(m) for m in out.get("assistant_masks", [])]


@pytest.mark.parametrize("template", [GEMMA_TEMPLATE, CHATML], ids=["gemma", "chatml"])
@pytest.mark.parametrize("turns", [3, 5], ids=["one_answer", "two_answers"])
def test_ids_and_assistant_mask_equal_transformers(tokenizers, template, turns):
    ours, reference = tokenizers
    messages = CONVERSATION[:turns] if template is GEMMA_TEMPLATE else CONVERSATION[1:turns]
    ids, mask = ChatTemplate(template, "test", ours).encode(messages)
    want_ids, want_mask = _reference(reference, template, messages, return_assistant_tokens_mask=True)
    assert ids == want_ids and mask == want_mask
    assert sum(mask) > 10 and not all(mask)
    # Gemma's turn tokens are single ids; the answers and their end-of-turn are the masked tokens
    end = ours.encode("<end_of_turn>")
    assert template is not GEMMA_TEMPLATE or (len(end) == 1 and ids.count(end[0]) == turns - 1)
    prompt, _ = ChatTemplate(template, "test", ours).encode(messages[:-1], add_generation_prompt=True)
    assert prompt == _reference(reference, template, messages[:-1], add_generation_prompt=True)[0]
    assert ids[: len(prompt)] == prompt  # the generation prompt is the conversation's start


def test_a_template_without_generation_markers_masks_by_rendered_prefixes(tokenizers):
    """Gemma's format without its markers: each answer's span is what rendering it adds after the
    generation prompt, less the newline after <end_of_turn>: the marked template's mask."""
    ours, _ = tokenizers
    unmarked = GEMMA_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert ChatTemplate(unmarked, "test", ours).encode(CONVERSATION) == ChatTemplate(
        GEMMA_TEMPLATE, "test", ours
    ).encode(CONVERSATION)
    ids, mask = ChatTemplate(unmarked, "test", ours).encode(CONVERSATION, roles=("user", "assistant"))
    assert sum(mask) > sum(ChatTemplate(GEMMA_TEMPLATE, "test", ours).encode(CONVERSATION)[1])


def test_templates_are_found_beside_the_tokenizer_and_errors_are_one_line(tmp_path, tokenizers):
    ours, _ = tokenizers
    assert find_template(None, tmp_path) == (GEMMA_TEMPLATE, "Gemma's turn format")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    assert find_template(None, tmp_path / "tokenizer.json")[0] == CHATML
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert find_template(None, tmp_path)[0] == "{{ messages[0]['content'] }}"
    assert find_template(str(tmp_path / "tokenizer_config.json"), None)[1].endswith("tokenizer_config.json")
    with pytest.raises(ConfigError, match="data.chat_template: no such file"):
        find_template(str(tmp_path / "missing.jinja"), None)
    with pytest.raises(ConfigError, match="alternate user and assistant"):
        ChatTemplate(GEMMA_TEMPLATE, "test", ours).encode([{"role": "assistant", "content": "hi"}])
    with pytest.raises(ConfigError, match="not a Jinja template"):
        ChatTemplate("{% for %}", "test", ours)


def _conversation(question, answer, follow_up):
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": follow_up},
        ]
    }


def _first_batch(tmp_path, name, records):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg, _ = load_config(
        [
            "data=chat",
            f"data.train_files=[{path}]",
            "data.eval_fraction=0",
            "data.seq_len=256",
            "model.vocab_size=4096",
        ]
    )
    data = Data(cfg)
    batches = data.train_batches(global_micro_batch=2)
    try:
        return data, next(iter(batches))
    finally:
        batches.close()


def test_conversations_put_the_loss_on_the_assistant_only(tmp_path):
    """The bundled SentencePiece tokenizer in Gemma's turn format: the tokens with loss are the
    answers and their <end_of_turn>; the loss does not move when a later user turn changes (same
    token count, so the same packing) and moves when an answer does."""
    records = [
        _conversation("Who is there?", "Nay, answer me.", "Long live the king!"),
        _conversation("What light?", "It is the east.", "Arise, fair sun."),
    ]
    data, batch = _first_batch(tmp_path, "base", records)
    tok = data.tokenizer
    ids, mask = data.chat.encode(records[0]["messages"])
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "Nay, answer me.<end_of_turn>"
    answers = {i for r in records for i, m in zip(*data.chat.encode(r["messages"])) if m}
    with_loss = batch["targets"][batch["loss_mask"] > 0]
    assert len(with_loss) > 20 and set(with_loss.tolist()) <= answers
    graphdef = model_graphdef(config("model.vocab_size=4096").model, data.cfg.training.remat)
    params = nnx.state(Decoder(config("model.vocab_size=4096").model, nnx.Rngs(0)), nnx.Param)

    def loss(batch):
        sums = eval_step(Program(graphdef), params, jax.tree.map(jnp.asarray, batch))
        return float(sums["loss_sum"]) / float(sums["weight"])

    follow_up = [_conversation("Who is there?", "Nay, answer me.", "Long live the queen!"), records[1]]
    answer = [_conversation("Who is there?", "Nay, answer you.", "Long live the king!"), records[1]]
    for variant in (follow_up, answer):  # the same token count: the same packing
        assert len(data.chat.encode(variant[0]["messages"])[0]) == len(ids)
    base = loss(batch)
    assert loss(_first_batch(tmp_path, "follow_up", follow_up)[1]) == base
    assert abs(loss(_first_batch(tmp_path, "answer", answer)[1]) - base) > 1e-4


CONVERSATIONS = REPO / "tunix_train" / "data" / "corpus" / "conversations.jsonl"
STEPS = 150


@pytest.mark.slow  # a training run and the chat CLI in subprocesses
def test_sft_on_the_bundled_conversations_then_the_chat_cli_answers_as_trained(tmp_path):
    """gemma3_tiny learns the bundled conversations on fsdp2 x tp2; the chat CLI, fed turns on a
    pipe, streams the trained answers (greedy), keeps the conversation, and /reset forgets it."""
    run_dir = tmp_path / "run"
    trained = run_training(
        "model=gemma3_tiny",
        "model.vocab_size=4096",
        "data=chat",
        f"data.train_files=[{CONVERSATIONS}]",
        "data.eval_fraction=0",
        "data.seq_len=128",
        'model.mesh_shape=[[2,2],["fsdp","tp"]]',
        "training.micro_batch_size=4",
        f"training.max_steps={STEPS}",
        "training.learning_rate=0.01",
        "training.warmup_steps=10",
        f"hydra.run.dir={run_dir}",
        devices=4,
        timeout=600,
    )
    assert trained.returncode == 0, trained.stderr[-2000:]
    turns = (
        "Name a tragedy.\nAnd a comedy?\n/reset\nWho is Prospero's daughter?\n\n"
        "How many witches meet Macbeth?\n"
    )
    chat = run_python(
        "-m",
        "tunix_train.generate",
        str(run_dir),
        "--chat",
        "--max_new_tokens",
        "24",
        "--mesh_shape",
        '[[2],["fsdp"]]',
        input=turns,
        devices=2,
        timeout=300,
    )
    assert chat.returncode == 0, chat.stderr[-2000:]
    assert chat.stdout.splitlines() == ["Hamlet.", "Twelfth Night.", "Miranda.", "Three witches."]


def turn_reward(prompts, completions, **_):
    """A GRPO reward that checks it gets conversational prompts as messages: each completion's length."""
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts)
    return [float(len(c)) for c in completions]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_dpo_pairs_and_grpo_prompts_in_messages_are_rendered_with_the_template(tmp_path, tokenizers):
    """A DPO pair's rows: the prompt with the generation prompt, then the answer through
    <end_of_turn>, the loss on the answer only; a GRPO run on user turns samples after the
    generation prompt, stops at <end_of_turn>, and hands the rewards the messages."""
    ours, _ = tokenizers
    hf = ours.path.parent
    question = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Romeo?"}]
    pairs = _jsonl(
        tmp_path / "pairs.jsonl",
        [
            {
                "prompt": question,
                "chosen": "A Montague.",
                "rejected": [{"role": "assistant", "content": "A Capulet."}],
            }
        ]
        * 4,
    )
    cfg, _ = load_config(
        [
            "model=gemma3_tiny",
            "model.vocab_size=4103",
            "objective=dpo",
            "data=jsonl",
            f"data.train_files=[{pairs}]",
            "data.eval_fraction=0.25",
            "data.seq_len=64",
            f"data.tokenizer={hf}",
        ]
    )
    data = Data(cfg, make_objective(cfg).record_fields)
    objective = make_objective(cfg)
    objective.read(data)
    rows = objective._pairs["train"][0]
    template = ChatTemplate(GEMMA_TEMPLATE, "test", ours)
    prompt, _ = template.encode(question, add_generation_prompt=True)
    for row, answer in enumerate(("A Montague.", "A Capulet.")):
        full, mask = template.encode([*question, {"role": "assistant", "content": answer}])
        # without the newline after the turn
        n = len(full) - 1 if ours.decode(full[-1:]) == "\n" else len(full)
        np.testing.assert_array_equal(rows["inputs"][row][: n - 1], full[: n - 1])
        with_loss = rows["targets"][row][rows["loss_mask"][row] > 0].tolist()
        assert with_loss == [i for i, m in zip(full[:n], mask[:n]) if m][-len(with_loss) :]
        assert ours.decode(with_loss) == answer + "<end_of_turn>" and len(prompt) + len(with_loss) == n

    prompts = _jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(8)],
    )
    cfg, _ = load_config(
        [
            "model=gemma3_tiny",
            "model.vocab_size=4103",
            "objective=grpo",
            "data=jsonl",
            f"data.train_files=[{prompts}]",
            "data.seq_len=32",
            f"data.tokenizer={hf}",
            "data.eval_fraction=0",
            "training.micro_batch_size=4",
            "training.rollout.num_generations=4",
            "training.rollout.max_new_tokens=6",
            "training.rollout.reward=[test_chat:turn_reward]",
            "training.max_steps=2",
            "training.log_every=1",
        ]
    )
    cfg.model.mesh_shape = [[1], ["fsdp"]]
    train(cfg, tmp_path / "grpo", devices=jax.devices()[:1])
    samples = [json.loads(line) for line in (tmp_path / "grpo" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(
        s["prompt"].startswith(ours.token(ours.bos_id) + "<start_of_turn>user\nCount to ")
        and s["prompt"].endswith("<end_of_turn>\n<start_of_turn>model\n")
        for s in samples
    )
    assert len([m for m in read_metrics(tmp_path / "grpo") if "loss" in m]) == 2
    grpo = make_objective(cfg)
    grpo.read(Data(cfg, grpo.record_fields))
    assert grpo.sampler.stop_ids == [ours.eos_id, *ours.encode("<end_of_turn>")]
