"""Tools and environments (tunix_train/envs/): schemas as transformers makes them, both call
formats, calls that raise or hang, and the parse -> execute -> append -> continue loop on a
scripted engine, whose tokens equal the template's rendering of the final conversation with only
the model's own tokens under the loss; then GRPO with an environment end to end."""

import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import assert_resumes_alike, step_metrics

from tunix_train.config import ConfigError
from tunix_train.data.chat import GEMMA_TEMPLATE, ChatTemplate
from tunix_train.data.tokenizer import load_tokenizer
from tunix_train.envs import tools as t
from tunix_train.envs.environment import Environment
from tunix_train.envs.rollout import Turns
from tunix_train.rewards.calculator import call, multiply, write_tokenizer

transformers = pytest.importorskip("transformers")


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError("no luck")


def slow(x: int) -> int:
    """Takes its time.

    Args:
        x: Anything.
    """
    time.sleep(3)
    return x


def undocumented(x):
    return x


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(write_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.model"), 4102)


def test_schemas_are_transformers_and_bad_tools_are_one_line():
    from transformers.utils import get_json_schema

    assert t.schema(multiply) == get_json_schema(multiply) and t.schema(multiply)["type"] == "function"
    assert t.schema(multiply)["function"]["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "The first factor.",
    }
    with pytest.raises(ConfigError, match="'tests.test_tools:undocumented' cannot make a tool schema"):
        t.load_tools(["tests.test_tools:undocumented"])
    with pytest.raises(ConfigError, match="'json:JSONDecoder' is a type, not a function"):
        t.load_tools(["json:JSONDecoder"])
    with pytest.raises(ConfigError, match="training.rollout.tools: cannot import 'no_such:thing'"):
        t.load_tools(["no_such:thing"])


def test_both_call_formats_parse_and_a_call_written_wrong_is_an_error():
    text = (
        f"Let me see. {call(347, 812)} and "
        '<tool_call>{"name": "add", "arguments": {"x": [1, 2]}}</tool_call>'
    )
    assert t.parse_calls(text, "tagged") == [
        t.Call("multiply", {"a": 347, "b": 812}),
        t.Call("add", {"x": [1, 2]}),
    ]
    assert t.parse_calls("<tool_call>{oops}</tool_call>", "tagged")[0].error.startswith(
        "the call is not JSON"
    )
    assert t.parse_calls('<tool_call>{"arguments": {}}</tool_call>', "tagged")[0].error
    assert t.parse_calls("no call here", "tagged") == []
    gemma4 = (
        '<|tool_call>call:get_weather{location:<|"|>Paris, France<|"|>,'
        "days:3,units:{metric:true}}<tool_call|>"
        "<|tool_call>call:ping{}<tool_call|>"
    )
    assert t.parse_calls(gemma4, "gemma4") == [
        t.Call("get_weather", {"location": "Paris, France", "days": 3, "units": {"metric": True}}),
        t.Call("ping", {}),
    ]
    assert (
        t.parse_calls('<|tool_call>call:f{a:<|"|>open}<tool_call|>', "gemma4")[0].error
        == "a string is not closed"
    )
    assert t.call_style("...<|tool_call>...") == "gemma4" and t.call_style(GEMMA_TEMPLATE) == "tagged"


def test_a_tool_that_raises_or_hangs_is_an_error_message():
    toolbox = t.Toolbox({"broken": broken, "slow": slow, "multiply": multiply}, 1.0)
    assert toolbox.call(t.Call("multiply", {"a": 2, "b": 3})) == ("6", False)
    assert toolbox.call(t.Call("broken", {"x": 1})) == ("error: ValueError: no luck", True)
    start = time.perf_counter()
    toolbox.timeout_s = 0.2
    assert toolbox.call(t.Call("slow", {"x": 1})) == ("error: timed out after 0.2 s", True)
    assert time.perf_counter() - start < 1.0
    toolbox.timeout_s = 1.0
    assert toolbox.call(t.Call("nope", {}))[0].startswith("error: no tool named 'nope'")
    assert toolbox.call(t.Call("multiply", {"c": 1}))[1]  # wrong arguments: refused by the schema, reported


@dataclasses.dataclass
class Done:  # what the engine returns for a request
    tokens: list
    logprobs: list
    stop_token: int | None
    stop_logprob: float = -0.5
    routes: object = None  # record_routes: [positions fed, layers, k]
    versions: list = dataclasses.field(default_factory=list)  # the weights' of each token


def test_calls_run_and_their_results_continue_the_conversation(tokenizer):
    """Turn 1 calls multiply, turn 2 a tool that raises, turn 3 one that hangs, turn 4 answers: the
    trajectory's tokens are the template's rendering of the final conversation (tools offered),
    and the tokens under the loss are exactly the model's four turns."""
    chat = ChatTemplate(GEMMA_TEMPLATE, "Gemma's turn format", tokenizer)
    turns = Turns(
        chat,
        {"multiply": multiply, "broken": broken, "slow": slow},
        max_new_tokens=48,
        max_turns=5,
        max_len=512,
        timeout_s=0.3,
    )
    script = [
        call(347, 812),
        '<tool_call>{"name":"broken","arguments":{"x":1}}</tool_call>',
        '<tool_call>{"name":"slow","arguments":{"x":1}}</tool_call>',
        "281764",
    ]
    eot = tokenizer.encode("<end_of_turn>")[0]
    requests_seen = []

    def generate(requests):
        requests_seen.append(requests)
        out = []
        for ids, _, _ in requests:
            turn = len(requests_seen) - 1
            tokens = tokenizer.encode(script[turn])
            # the "experts" of every position this turn fed: the prompt's and its tokens (not the stop)
            routes = np.full((len(ids) + len(tokens), 2, 1), turn)
            out.append(Done(tokens, [-0.1] * len(tokens), eot, routes=routes))
        return out

    trajectory = turns.start(Environment(), {"prompt": "What is 347 times 812?"}, "Environment")
    prompt = list(trajectory.prompt)
    [trajectory] = turns.roll_out(generate, [trajectory], [Environment()])
    assert [m["role"] for m in trajectory.messages] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    assert [m["content"] for m in trajectory.messages if m["role"] == "tool"] == [
        "281764",
        "error: ValueError: no luck",
        "error: timed out after 0.3 s",
    ]
    assert (trajectory.turns, trajectory.tool_calls, trajectory.tool_errors) == (4, 3, 2)
    assert trajectory.last_turn == "281764" and not trajectory.open
    # every request continues the whole conversation so far
    assert [len(r) for r in requests_seen] == [1, 1, 1, 1]
    assert all(
        requests_seen[k + 1][0][0][: len(requests_seen[k][0][0])] == requests_seen[k][0][0] for k in range(3)
    )
    rendered = tokenizer.encode_with_offsets(turns.render(trajectory.messages))[0]
    assert prompt + trajectory.tokens == rendered[: len(prompt) + len(trajectory.tokens)]
    # after the last end of turn
    assert rendered[len(prompt) + len(trajectory.tokens) :] == tokenizer.encode("\n")
    own = [tok for tok, mine in zip(trajectory.tokens, trajectory.own) if mine]
    assert tokenizer.decode(own) == "<end_of_turn>".join(script) + "<end_of_turn>"
    others = tokenizer.decode([tok for tok, mine in zip(trajectory.tokens, trajectory.own) if not mine])
    assert "<tool_response>281764</tool_response>" in others and "281764<end_of_turn>" not in others
    mine = [lp for lp, m in zip(trajectory.logprobs, trajectory.own) if m]
    assert all(lp == 0.0 for lp, m in zip(trajectory.logprobs, trajectory.own) if not m)
    assert mine.count(-0.5) == 4 and mine.count(-0.1) == len(mine) - 4  # the engine's, the stop token's last
    # routing replay: each position keeps the experts of the turn that first fed it, every position
    # but the final stop token's
    ends = [len(r[0][0]) + len(tokenizer.encode(text)) for r, text in zip(requests_seen, script)]
    expected = np.concatenate(
        [np.full(end - start, k) for k, (start, end) in enumerate(zip([0, *ends], ends))]
    )
    assert len(expected) == len(prompt) + len(trajectory.tokens) - 1
    np.testing.assert_array_equal(trajectory.routes[:, 0, 0], expected)
    np.testing.assert_array_equal(trajectory.routes[:, 1, 0], expected)


class Countdown(Environment):
    """A game without tools: the model is told a number and each turn the next one down; the
    environment's reward is 1 per turn, the conversation ends after three."""

    def step(self, messages):
        turns = sum(m["role"] == "assistant" for m in messages)
        return [{"role": "user", "content": f"{3 - turns}"}], 1.0, turns >= 3


class Raises(Environment):
    def step(self, messages):
        raise RuntimeError("board on fire")


def test_an_environment_steps_and_one_that_raises_is_an_error_message(tokenizer):
    chat = ChatTemplate(GEMMA_TEMPLATE, "Gemma's turn format", tokenizer)
    turns = Turns(chat, {}, max_new_tokens=8, max_turns=6, max_len=256, timeout_s=1.0)
    eot = tokenizer.encode("<end_of_turn>")[0]

    def generate(requests):
        return [Done(tokenizer.encode("ok"), [-1.0], eot) for _ in requests]

    games = [Countdown(), Raises()]
    trajectories = turns.roll_out(generate, [turns.start(g, {"prompt": "3"}, "g") for g in games], games)
    assert trajectories[0].turns == 3 and trajectories[0].reward == 3.0 and trajectories[0].tool_errors == 0
    assert trajectories[1].turns == 6 and trajectories[1].tool_errors == 5 and trajectories[1].reward is None
    assert (
        trajectories[1].messages[2]["content"]
        == "error: the environment's step failed: RuntimeError: board on fire"
    )


def test_a_cut_off_turn_or_a_full_context_ends_the_conversation(tokenizer):
    chat = ChatTemplate(GEMMA_TEMPLATE, "Gemma's turn format", tokenizer)
    turns = Turns(chat, {"multiply": multiply}, max_new_tokens=8, max_turns=4, max_len=256, timeout_s=1.0)

    def cut(requests):
        return [Done(tokenizer.encode("12345678"), [-1.0] * 8, None) for _ in requests]

    [tr] = turns.roll_out(cut, [turns.start(Environment(), {"prompt": "x"}, "e")], [Environment()])
    assert tr.turns == 1 and tr.own == [1] * len(tr.tokens)
    tight = Turns(chat, {"multiply": multiply}, max_new_tokens=48, max_turns=4, max_len=150, timeout_s=1.0)
    eot = tokenizer.encode("<end_of_turn>")[0]

    def calls(requests):  # as the engine does, at most max_new_tokens, cut off without a stop token
        tokens = tokenizer.encode(call(1, 2))
        return [
            Done(tokens[:n], [-1.0] * min(n, len(tokens)), eot if n > len(tokens) else None)
            for _, n, _ in requests
        ]

    [tr] = tight.roll_out(calls, [tight.start(Environment(), {"prompt": "x"}, "e")], [Environment()])
    assert len(tr.prompt) + len(tr.tokens) == 150 and tr.turns == 2  # the second turn ran into the context


def test_gemma_template_with_tools_renders_as_transformers_does(tokenizer, tmp_path):
    """Our renderer and transformers' apply_chat_template(tools=[function]) give the same text."""
    messages = [
        {"role": "user", "content": "What is 2 times 3?"},
        {"role": "assistant", "content": call(2, 3)},
        {"role": "tool", "name": "multiply", "content": "6"},
        {"role": "assistant", "content": "6"},
    ]
    ours = ChatTemplate(GEMMA_TEMPLATE, "g", tokenizer).render(messages, tools=[t.schema(multiply)])[0]
    from transformers.utils.chat_template_utils import render_jinja_template

    theirs = render_jinja_template(
        [messages],
        tools=[multiply],
        chat_template=GEMMA_TEMPLATE,
        bos_token=tokenizer.token(tokenizer.bos_id),
    )[0][0]
    assert ours == theirs and "multiply(a: integer, b: integer): Multiplies" in ours
    assert "<tool_response>6</tool_response>" in ours


def test_the_loss_mask_covers_the_model_tokens_only(tmp_path):
    """A rollout's rows: the tokens the model did not write (tool results) carry no loss, and the
    engine's log-probabilities sit under the model's tokens."""
    from tunix_train.compose import load_config
    from tunix_train.train.objectives.grpo import OnPolicy
    from tunix_train.train.rollouts import Rollout

    (tmp_path / "p.jsonl").write_text('{"prompt": "x", "answer": "1"}\n')
    cfg, _ = load_config(
        [
            "objective=grpo",
            "data=jsonl",
            f"data.train_files=[{tmp_path}/p.jsonl]",
            "data.seq_len=16",
            "training.rollout.num_generations=2",
            "training.micro_batch_size=2",
            "training.rollout.reward=[tunix_train.rewards.calculator:exact_answer]",
            "training.rollout.tools=[tunix_train.rewards.calculator:multiply]",
        ]
    )
    objective = OnPolicy(cfg)
    objective.sampler.rows = range(0, 2)
    rollout = Rollout(
        0,
        0,
        1,
        [0],
        [[5, 6, 7, 8, 9], [5, 6]],
        [[-1.0, -2.0, 0.0, 0.0, -3.0], [-1.0, -2.0]],
        [[1.0, 0.0]],
        0.0,
        prompt_ids=[[2, 3, 4], [2, 3, 4]],
        own=[[1, 1, 0, 0, 1], [1, 1]],
    )
    rows = objective._rows_of(rollout)
    # targets[i] = ids[i + 1]: the completion's tokens are targets 2.. of a 3-token prompt
    assert rows["targets"][0, 0, 2:7].tolist() == [5, 6, 7, 8, 9]
    assert rows["loss_mask"][0, 0].tolist() == [0, 0, 1, 1, 0, 0, 1] + [0] * 9
    assert rows["loss_mask"][0, 1].tolist() == [0, 0, 1, 1] + [0] * 12
    assert rows["behaviour_logp"][0, 0, 2:7].tolist() == [-1.0, -2.0, 0.0, 0.0, -3.0]


class Checker(Environment):
    """After the model's answer (a turn without a tool call): one more turn, the environment's reward
    1 when the answer was a number."""

    def step(self, messages):
        if sum(m["role"] == "user" for m in messages) > 1:
            return [], None, True
        return [{"role": "user", "content": "Sure?"}], float(messages[-1]["content"].strip().isdigit()), False


def qwen_call(a: int, b: int) -> str:
    """The calculator's call as Qwen 2.5's template writes a call."""
    return (
        "<tool_call>\n" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "\n</tool_call>"
    )


def llama_call(a: int, b: int) -> str:
    """The calculator's call as Llama 3.1's template writes a call: the turn is the JSON object."""
    return json.dumps({"name": "multiply", "parameters": {"a": a, "b": b}})


def bpe_tokenizer(directory, sft, kind: str, template: str, added: tuple[str, ...] = ()) -> Path:
    """A byte-level BPE tokenizer of `kind` (qwen, llama), trained with the task's conversations as
    `template` (TRL's copy) renders them, with `added` tokens of their own, and that template."""
    from bpe_files import byte_level_bpe, trl_template

    from tunix_train.data.jinja_sandbox import compiled_template as _compiled

    pytest.importorskip("trl")
    render = _compiled(trl_template(template))[0].render  # compiled as transformers compiles it
    texts = tuple(render(**json.loads(line)) for line in sft.read_text().splitlines())
    return byte_level_bpe(directory, kind, vocab_size=1024, texts=texts, added=added, template=template)


# family: (model config, vocabulary, seq_len, tokenizer kind, TRL template, tokens added to it)
TOOL_FAMILIES = {
    "qwen3": (
        "qwen3_tiny",
        1032,
        320,
        "qwen",
        "qwen2_5",
        ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
    ),
    "llama3": ("llama_tiny", 1024, 384, "llama", "llama3_1", ()),
}


@pytest.mark.slow  # llama3's calls: test_llama3_1_calls_parse_as_its_template_writes_them
@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_grpo_with_tools_and_an_environment_trains_and_resumes_bit_identically(tmp_path, family):
    """A tiny model (Gemma 3 with the bundled template; Qwen 3 with Qwen 2.5's ChatML and its
    <tool_call> format; Llama 3 with Llama 3.1's template, whose call is a turn of bare JSON and whose
    results come back as ipython turns), warmed up on the calculator's conversations, then GRPO on
    fsdp2 x tp2 with the multiply tool and an environment: calls happen and run, turns follow, and a
    resumed run equals the straight one."""

    from tunix_train.compose import load_config
    from tunix_train.export import main as export
    from tunix_train.rewards.calculator import write_task
    from tunix_train.train.loop import train

    if family == "gemma3":
        prompts, sft = write_task(tmp_path / "task", count=256, seed=0)
        tok = write_tokenizer(tmp_path / "tok" / "tokenizer.model")
        model = ["model=gemma3_tiny", "model.vocab_size=4102", f"data.tokenizer={tok}", "data.seq_len=192"]
    else:
        name, vocab, seq_len, kind, template, added = TOOL_FAMILIES[family]
        prompts, sft = write_task(
            tmp_path / "task", count=256, seed=0, call=qwen_call if kind == "qwen" else llama_call
        )
        tok = bpe_tokenizer(tmp_path / "tok", sft, kind, template, added)
        model = [
            f"model={name}",
            f"model.vocab_size={vocab}",
            f"data.tokenizer={tok}",
            f"data.seq_len={seq_len}",
        ]
    cfg, _ = load_config(
        [
            *model,
            "data=chat",
            f"data.train_files=[{sft}]",
            "training.max_steps=50",  # the loss is flat after 40 steps
            "training.micro_batch_size=8",
            "training.learning_rate=1e-2",
            "training.eval_every=0",
            "training.warmup_steps=10",
            "checkpoint.every_steps=0",
        ]
    )
    train(cfg, tmp_path / "sft", devices=jax.devices()[:1])
    assert export([str(tmp_path / "sft"), str(tmp_path / "sft_hf")]) == 0
    cfg, _ = load_config(
        [
            *model,
            "objective=grpo",
            "data=jsonl",
            f"data.train_files=[{prompts}]",
            f"model.init_from={tmp_path / 'sft_hf'}",
            "training.micro_batch_size=4",
            "training.rollout.num_generations=4",
            "training.rollout.max_new_tokens=48",
            "training.rollout.max_turns=4",
            "training.rollout.tools=[tunix_train.rewards.calculator:multiply]",
            "training.rollout.environment=tests.test_tools:Checker",
            "training.log_every=1",
            "training.rollout.reward=[tunix_train.rewards.calculator:exact_answer]",
            "training.lr_schedule=constant",
            "checkpoint.every_steps=2",
            "training.learning_rate=1e-3",
        ]
    )
    cfg.model.mesh_shape = [[2, 2], ["fsdp", "tp"]]
    keys = ("loss", "grad_norm", "reward", "tool_calls", "tool_errors", "turns", "reward_environment")
    straight = assert_resumes_alike(cfg, tmp_path, 4, 2, jax.devices()[:4], keys)
    steps = step_metrics(straight)
    assert sum(m["tool_calls"] for m in steps) > 0 and max(m["turns"] for m in steps) > 2
    # it learns
    assert sum(m["reward_environment"] for m in steps) > 0 and max(m["grad_norm"] for m in steps) > 0.01
    samples = [json.loads(line) for line in (straight / "samples.jsonl").read_text().splitlines()]
    response = "<|start_header_id|>ipython<|end_header_id|>" if family == "llama3" else "<tool_response>"
    assert any(response in s["text"] for s in samples)


def test_the_parser_bounds_what_the_model_writes():
    """100k-deep nesting, a 1 MB argument and wrong types are error observations, not exceptions."""
    deep = (
        '<tool_call>{"name": "multiply", "arguments": {"a": '
        + "[" * 100_000
        + "]" * 100_000
        + "}}</tool_call>"
    )
    assert "characters long; at most 65536" in t.parse_calls(deep, "tagged")[0].error
    deep = (
        '<tool_call>{"name": "multiply", "arguments": {"a": ' + "[" * 20_000 + "]" * 20_000 + "}}</tool_call>"
    )
    assert "nested more than 32" in t.parse_calls(deep, "tagged")[0].error  # json's RecursionError
    # a turn runs max_calls
    assert len(t.parse_calls("".join(call(i, 2) for i in range(300)), "tagged")) == 300
    deep33 = '<tool_call>{"name": "multiply", "arguments": {"a": ' + "[" * 33 + "]" * 33 + "}}</tool_call>"
    assert "nested more than 32" in t.parse_calls(deep33, "tagged")[0].error
    gemma4_deep = "<|tool_call>call:f{a:" + "[" * 20_000 + "]" * 20_000 + "}<tool_call|>"
    assert "nested more than 32" in t.parse_calls(gemma4_deep, "gemma4")[0].error
    big = '<tool_call>{"name": "multiply", "arguments": {"a": "' + "x" * (1 << 20) + '"}}</tool_call>'
    assert "characters long; at most 65536" in t.parse_calls(big, "tagged")[0].error
    toolbox = t.Toolbox({"multiply": multiply}, 1.0)
    text, failed = toolbox.call(t.Call("multiply", {"a": "1", "b": "2"}))
    assert failed and text.startswith(
        "error: the arguments of multiply do not fit its schema: 'a': '1' is not of type 'integer'"
    )
    assert "'c' was unexpected" in toolbox.call(t.Call("multiply", {"a": 1, "b": 2, "c": 3}))[0]
    assert "'b' is a required property" in toolbox.call(t.Call("multiply", {"a": 1}))[0]
    assert toolbox.call(t.Call("multiply", {"a": 6, "b": 7})) == ("42", False)


def test_a_turn_runs_at_most_max_calls_and_long_results_are_cut(tokenizer):
    from rewards_for_tests import echo

    chat = ChatTemplate(GEMMA_TEMPLATE, "Gemma's turn format", tokenizer)
    limits = dict(max_new_tokens=48, max_turns=2, max_len=4096, timeout_s=1.0)
    turns = Turns(chat, {"multiply": multiply, "echo": echo}, **limits, max_calls=8, max_result_tokens=20)
    script = [
        "".join(call(i, 2) for i in range(40)),
        '<tool_call>{"name":"echo","arguments":{"text":"' + "Speak the speech " * 100 + '"}}</tool_call>',
    ]
    eot = tokenizer.encode("<end_of_turn>")[0]
    for text in script:
        turns.max_turns = 2
        trajectory = turns.start(Environment(), {"prompt": "Go"}, "Environment")
        [trajectory] = turns.roll_out(
            lambda requests: [Done(tokenizer.encode(text), [-0.1] * len(tokenizer.encode(text)), eot)],
            [trajectory],
            [Environment()],
        )
        results = [m["content"] for m in trajectory.messages if m["role"] == "tool"]
        if text is script[0]:
            assert results[:8] == [str(2 * i) for i in range(8)] and len(results) == 9
            assert results[8] == "error: the turn wrote 40 calls and at most 8 run in a turn: the first 8 ran"
            assert (trajectory.tool_calls, trajectory.tool_errors) == (8, 1)
        else:
            [result] = results
            assert result.startswith(tokenizer.decode(tokenizer.encode("Speak the speech " * 100)[:20]))
            assert result.endswith("[cut: the result was 1700 characters, more than 20 tokens]")


def test_a_hanging_tool_is_killed_in_a_process_and_counted_in_a_thread(tmp_path, monkeypatch):
    import os

    from rewards_for_tests import hang

    monkeypatch.setenv("TUNIX_TEST_HANG_PIDS", str(tmp_path / "pids"))
    in_process = t.Toolbox({"hang": hang}, 30.0, processes=True)
    assert in_process.call(t.Call("hang", {"seconds": 0})) == ("awake", False)  # the pool's start: not timed
    in_process.timeout_s = 1.0
    text, failed = in_process.call(t.Call("hang", {"seconds": 60}))
    assert failed and text == "error: timed out after 1 s (its process was killed)" and in_process.hung == 1
    pid = int((tmp_path / "pids").read_text().split()[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # gone
    in_process.timeout_s = 30.0
    assert in_process.call(t.Call("hang", {"seconds": 0})) == ("awake", False)  # a new pool
    in_process.close()
    in_thread = t.Toolbox({"hang": hang}, 0.2)
    assert in_thread.call(t.Call("hang", {"seconds": 2})) == ("error: timed out after 0.2 s", True)
    assert in_thread.hung == 1


def test_llama3_1_calls_parse_as_its_template_writes_them():
    """Llama 3.1's template (TRL's copy of the model's own) writes a call as the whole turn,
    {"name": ..., "parameters": {...}}; what it renders parses back to the call."""
    trl = pytest.importorskip("trl", reason="needs TRL (its chat templates): pip install -e '.[reference]'")
    from pathlib import Path

    from tunix_train.data.chat import ChatTemplate

    template = (Path(trl.__file__).parent / "chat_templates" / "llama3_1.jinja").read_text()
    assert t.call_style(template) == "llama3"

    class Tokens:  # what ChatTemplate reads of a tokenizer to name its special tokens
        bos_id = eos_id = pad_id = -1

    chat = ChatTemplate(template, "llama3_1.jinja", Tokens())
    arguments = {"a": 347, "b": 812}
    call_turn = {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": arguments}}],
    }
    before, _ = chat.render([{"role": "user", "content": "347 * 812?"}], add_generation_prompt=True)
    through, _ = chat.render([{"role": "user", "content": "347 * 812?"}, call_turn])
    written = through[len(before) :].removesuffix("<|eot_id|>")
    assert t.parse_calls(written, "llama3") == [t.Call("multiply", arguments)]
    assert t.parse_calls("<|python_tag|>" + written, "llama3") == [t.Call("multiply", arguments)]
    assert t.parse_calls("The answer is 281,764.", "llama3") == []
    assert t.parse_calls('{"name": "multiply", "arguments": {"a": 1}}', "llama3") == [
        t.Call("multiply", {"a": 1})
    ]
    assert t.parse_calls('{"name": "multiply", "parameters": [1]}', "llama3")[0].error == (
        'a call is {"name": "...", "parameters": {...}}'
    )
    assert t.parse_calls("{" + "[" * 20_000 + "]" * 20_000 + "}", "llama3")[0].error
