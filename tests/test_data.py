"""The data pipeline: packing, determinism, resumable state, per-process shards, SFT masks, sources."""

import gzip
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import config
from flax import nnx

from tunix_train.compose import load_config
from tunix_train.config import ConfigError
from tunix_train.data import Data
from tunix_train.data.pipeline import DocumentFeatures, PackedBatches
from tunix_train.data.sources import read_documents, write_pretokenized
from tunix_train.model.decoder import Decoder
from tunix_train.parallel import model_graphdef
from tunix_train.train.forward import cross_entropy
from tunix_train.train.program import Program
from tunix_train.train.step import eval_step


@pytest.fixture(scope="module")
def shakespeare():
    cfg, _ = load_config(["data=shakespeare", "data.seq_len=64"])
    return Data(cfg)


def _packed(data, **kwargs):
    args = dict(seq_len=64, accumulation_steps=2, global_micro_batch=4, seed=0, prefetch=2) | kwargs
    return PackedBatches(data.train_docs, data.features, **args)


def _batches(data, n, **kwargs):
    batches = _packed(data, **kwargs)
    try:
        return [next(batches) for _ in range(n)]
    finally:
        batches.close()


def _equal(a, b):
    return all(np.array_equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)


def test_rows_are_packed_documents_with_restarting_positions(shakespeare):
    batches = _batches(shakespeare, 20)
    assert batches[0]["inputs"].shape == (2, 4, 64) and batches[0]["inputs"].dtype == np.int32
    batch = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
    starts = 0
    for seg, pos, inputs in zip(
        batch["segment_ids"].reshape(-1, 64),
        batch["positions"].reshape(-1, 64),
        batch["inputs"].reshape(-1, 64),
    ):
        assert seg[0] == 1 and np.all(np.diff(seg) >= 0)
        for t in range(1, 64):
            if seg[t] != seg[t - 1]:  # a new document: position 0, and it starts with BOS
                assert pos[t] == 0 and inputs[t] == shakespeare.tokenizer.bos_id
                starts += 1
            else:
                assert pos[t] == pos[t - 1] + 1
    assert starts > 0  # 64-token rows of ~900-token scenes: some rows hold a document boundary
    np.testing.assert_array_equal(
        batch["targets"][..., :-1][batch["segment_ids"][..., 1:] == batch["segment_ids"][..., :-1]],
        batch["inputs"][..., 1:][batch["segment_ids"][..., 1:] == batch["segment_ids"][..., :-1]],
    )


def test_a_document_in_a_packed_row_sees_only_itself(shakespeare):
    cfg = config("model.vocab_size=4096")
    rows = _batches(shakespeare, 20)
    flat = {k: np.concatenate([b[k].reshape(-1, 64) for b in rows]) for k in rows[0]}
    row = next(i for i in range(len(flat["inputs"])) if flat["segment_ids"][i].max() >= 2)
    inputs, segments, positions = (flat[k][row : row + 1] for k in ("inputs", "segment_ids", "positions"))
    first = segments == 1
    changed = np.where(first, (inputs + 7) % cfg.model.vocab_size, inputs)
    model = Decoder(cfg.model, nnx.Rngs(0))
    logits = [
        np.asarray(model(jnp.asarray(x), jnp.asarray(positions), jnp.asarray(segments)))
        for x in (inputs, changed)
    ]
    assert np.abs(logits[0][first] - logits[1][first]).max() > 1e-3
    np.testing.assert_array_equal(logits[0][~first], logits[1][~first])


def test_same_seed_same_batches_and_another_seed_others(shakespeare):
    assert _equal(_batches(shakespeare, 4), _batches(shakespeare, 4))
    assert not np.array_equal(
        _batches(shakespeare, 1)[0]["inputs"], _batches(shakespeare, 1, seed=1)[0]["inputs"]
    )


@pytest.mark.parametrize("k", [1, 5])
def test_restored_iterator_continues_exactly(shakespeare, k):
    reference = _batches(shakespeare, k + 4)
    batches = _packed(shakespeare)
    for _ in range(k):
        next(batches)
    state = json.loads(json.dumps(batches.get_state()))  # survives a round trip through JSON
    batches.close()
    restored = _packed(shakespeare)
    restored.set_state(state)
    try:
        assert _equal([next(restored) for _ in range(4)], reference[k:])
    finally:
        restored.close()


def test_a_slot_without_a_remainder_resumes_exactly_after_json():
    """Documents that fill rows exactly leave some packer slots with no remainder at a checkpoint;
    such a slot resumes where it stopped after the state's round trip through JSON (grain tests
    for "no remainder" with a tuple, and JSON gives back lists)."""
    rng = np.random.default_rng(0)
    docs = [{"tokens": rng.integers(3, 60, n).astype(np.int32)} for n in rng.choice([5, 9], 64)]
    features = DocumentFeatures(None, vocab_size=64)

    def batches():
        return PackedBatches(docs, features, seq_len=8, accumulation_steps=1, global_micro_batch=4, seed=0)

    straight = batches()
    reference = [next(straight) for _ in range(8)]
    straight.close()
    stopped = batches()
    for _ in range(3):
        next(stopped)
    state = json.loads(json.dumps(stopped.get_state()))
    stopped.close()
    slots = [slot["remainder_slices"] for slot in state["parents"]]
    assert any(all(s == [-1, -1] for s in slot.values()) for slot in slots), slots  # the case at hand
    restored = batches()
    restored.set_state(state)
    try:
        assert _equal([next(restored) for _ in range(5)], reference[3:])
    finally:
        restored.close()


def test_epochs_reshuffle_and_repeat():
    docs = [{"tokens": np.array([2, 10 + i, 1], np.int32)} for i in range(6)]
    features = DocumentFeatures(None, vocab_size=64)
    batches = PackedBatches(
        docs, features, seq_len=2, accumulation_steps=1, global_micro_batch=1, seed=0, prefetch=0
    )
    firsts = [int(next(batches)["inputs"][0, 0, 1]) for _ in range(12)]  # one document per row
    batches.close()
    assert sorted(firsts[:6]) == sorted(firsts[6:]) == list(range(10, 16)) and firsts[:6] != firsts[6:]


@pytest.mark.parametrize("processes", [2, 4])
def test_process_shards_union_to_the_single_process_batch(shakespeare, processes):
    single = _batches(shakespeare, 5, global_micro_batch=8)
    per_process = 8 // processes  # process p holds rows [p * per_process, (p + 1) * per_process)
    shards = [
        _batches(shakespeare, 5, global_micro_batch=8, rows=range(p * per_process, (p + 1) * per_process))
        for p in range(processes)
    ]
    for step, batch in enumerate(single):
        for name in batch:
            assert shards[0][step][name].shape[1] == 8 // processes
            np.testing.assert_array_equal(
                np.concatenate([s[step][name] for s in shards], axis=1), batch[name]
            )


def test_sft_puts_the_loss_on_the_completion_only(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"q": "Who is there?", "a": "Nay, answer me."}) + "\n")
    cfg, _ = load_config(
        [
            "data=jsonl",
            f"data.train_files=[{path}]",
            "data.prompt_field=q",
            "data.completion_field=a",
            "data.eval_fraction=0",
            "model.vocab_size=4096",
        ]
    )
    data = Data(cfg)
    tok = data.tokenizer
    prompt, completion = tok.encode("Who is there?"), tok.encode("Nay, answer me.")
    features = data.features(data.train_docs[0])
    np.testing.assert_array_equal(features["targets"], [*prompt, *completion, tok.eos_id])
    expected = [0.0] * len(prompt) + [1.0] * (len(completion) + 1)  # completion and EOS carry the loss
    np.testing.assert_array_equal(features["loss_mask"], expected)

    # The loss is the mean cross-entropy over completion tokens only.
    batch = next(iter(data.train_batches(global_micro_batch=2)))
    model_cfg = config("model.vocab_size=4096").model
    params = nnx.state(Decoder(model_cfg, nnx.Rngs(0)), nnx.Param)
    graphdef = model_graphdef(model_cfg, cfg.training.remat)
    sums = eval_step(Program(graphdef), params, jax.tree.map(jnp.asarray, batch))
    micro = {k: v[0] for k, v in batch.items()}
    logits = Decoder(model_cfg, nnx.Rngs(0))(
        jnp.asarray(micro["inputs"]), jnp.asarray(micro["positions"]), jnp.asarray(micro["segment_ids"])
    )
    token_loss = np.asarray(cross_entropy(logits, jnp.asarray(micro["targets"])))
    in_completion = micro["loss_mask"] > 0
    assert in_completion.sum() < micro["loss_mask"].size
    np.testing.assert_allclose(
        float(sums["loss_sum"]) / float(sums["weight"]), token_loss[in_completion].mean(), rtol=1e-5
    )


def test_text_units_and_compressed_files(tmp_path):
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"first line\nsecond line\n\nnext paragraph\n"))
    for unit, expected in [("line", 3), ("paragraph", 2), ("file", 1)]:
        cfg, _ = load_config(["data=text", f"data.train_files=[{tmp_path}/*.gz]", f"data.text_unit={unit}"])
        assert len(read_documents(cfg.data.train_files, cfg.data, "data.train_files")) == expected


def test_pretokenized_array_record_round_trips(tmp_path):
    docs = [np.arange(2, 2 + n, dtype=np.int32) for n in (3, 10, 1)]
    write_pretokenized(tmp_path / "tokens.array_record", docs)
    cfg, _ = load_config(["data=array_record", f"data.train_files=[{tmp_path}/tokens.array_record]"])
    read = read_documents(cfg.data.train_files, cfg.data, "data.train_files")
    assert [d["tokens"].tolist() for d in read] == [d.tolist() for d in docs]


def test_held_out_split_is_disjoint_and_fixed(shakespeare):
    train, held_out = shakespeare.train_docs, shakespeare.eval_docs
    assert len(held_out) == round(0.02 * (len(train) + len(held_out)))
    texts = {d["text"] for d in train}
    assert not any(d["text"] in texts for d in held_out)
    other_seed, _ = load_config(["data=shakespeare", "training.seed=5"])
    assert [d["text"] for d in Data(other_seed).eval_docs] == [d["text"] for d in held_out]


def test_bad_sources_name_the_file(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    cfg, _ = load_config(["data=jsonl", f"data.train_files=[{tmp_path}/bad.jsonl]"])
    with pytest.raises(ConfigError, match="bad.jsonl:2: not valid JSON"):
        read_documents(cfg.data.train_files, cfg.data, "data.train_files")


def _three_sources(tmp_path, records, *overrides):
    """Configs reading `records` from JSON lines, from Parquet, and from a saved datasets directory."""
    import datasets
    import pyarrow
    import pyarrow.parquet

    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), tmp_path / "records.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(tmp_path / "saved"))
    common = ["model.vocab_size=4096", "data.seq_len=48", *overrides]
    return [
        load_config(["data=jsonl", f"data.train_files=[{tmp_path / 'records.jsonl'}]", *common])[0],
        load_config(["data=parquet", f"data.train_files=[{tmp_path / 'records.parquet'}]", *common])[0],
        load_config(["data=jsonl", f"data.hf_dataset={tmp_path / 'saved'}", *common])[0],
    ]


@pytest.mark.parametrize("kind", ["text", "prompt_completion", "conversations"])
def test_parquet_and_a_saved_dataset_give_the_batches_of_the_same_json_lines(tmp_path, kind):
    """Same records, same seeded batches, and a resumed iterator continues each exactly."""
    lines = [
        f"{i} When shall we three meet again, in thunder, lightning, or in rain?"[: 20 + i] for i in range(40)
    ]
    records, overrides = {
        "text": ([{"text": t, "source": "witches"} for t in lines], []),
        "prompt_completion": (
            [{"q": t, "a": t[::-1]} for t in lines],
            ["data.prompt_field=q", "data.completion_field=a"],
        ),
        "conversations": (
            [
                {"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]}
                for t in lines
            ],
            ["data.messages_field=messages", "data.seq_len=128"],
        ),
    }[kind]
    results = []
    for cfg in _three_sources(tmp_path, records, *overrides):
        data = Data(cfg)
        batches = data.train_batches(global_micro_batch=2)
        first, state = next(batches), batches.get_state()
        rest = [next(batches) for _ in range(2)]
        batches.close()
        resumed = data.train_batches(global_micro_batch=2)
        resumed.set_state(state)
        assert all(
            np.array_equal(a[k], b[k]) for a, b in zip(rest, [next(resumed) for _ in range(2)]) for k in a
        )
        resumed.close()
        results.append([first, *rest])
        assert first["loss_mask"].sum() > 0
    for other in results[1:]:
        assert all(np.array_equal(a[k], b[k]) for a, b in zip(results[0], other) for k in a)


def test_an_objective_reads_its_records_from_parquet_and_a_saved_dataset(tmp_path):
    question = [{"role": "user", "content": "Who is there?"}]
    records = [
        {"prompt": question, "chosen": f"Nay {i}", "rejected": [{"role": "assistant", "content": "Stand."}]}
        for i in range(10)
    ]
    found = [
        read_documents(cfg.data.train_files, cfg.data, "data.train_files", ("prompt", "chosen", "rejected"))
        for cfg in _three_sources(tmp_path, records)
    ]
    assert found[0] == found[1] == found[2] == records
