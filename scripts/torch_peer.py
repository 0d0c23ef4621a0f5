"""The same train step in PyTorch + transformers, as a peer for scripts/benchmark.py on one GPU.

    python scripts/torch_peer.py [--model gemma3_1b] [--seq-len 4096] [--batch 2] [--steps 10]
        [--attention sdpa] [--compile] [--json out.json]

Builds our model config's Hugging Face twin (interop/hf.hf_config) with random weights, float32
parameters under bf16 autocast (what `training.mixed_precision=bf16` does), AdamW (fused on a GPU),
random token rows, the loss over every position. Times each step to the device's completion: the
median, tokens/s, and MFU against the data sheet with the FLOP count benchmark.py uses, so that the
two are read side by side. Peak memory is torch's largest allocation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma3_1b")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--attention", default="sdpa", help="transformers' attn_implementation")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch
    import transformers

    from tunix_train.compose import load_config
    from tunix_train.interop import hf
    from tunix_train.observe.mfu import peak_flops_per_device, train_flops_per_token

    cfg, _ = load_config([f"model={args.model}", "data=synthetic", f"data.seq_len={args.seq_len}"])
    fields = hf.hf_config(cfg.model)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = args.attention
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    forward = torch.compile(model) if args.compile else model
    tokens = torch.randint(3, cfg.model.vocab_size, (args.batch, args.seq_len), device=device)

    def step() -> float:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def synchronize():
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    synchronize()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = step()
        synchronize()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    tokens_per_s = args.batch * args.seq_len / median
    kind = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = peak_flops_per_device(kind, "bf16")
    result = {
        "model": args.model,
        "device": kind,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention": args.attention,
        "compile": args.compile,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "step_time_s": median,
        "tokens_per_sec": tokens_per_s,
        "mfu_data_sheet": tokens_per_s * train_flops_per_token(cfg.model, args.seq_len) / peak
        if peak
        else None,
        "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
        "loss_after": float(loss),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
