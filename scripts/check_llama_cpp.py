"""Our GGUF exports in llama.cpp itself: logits and greedy tokens against ours, per family.

    python scripts/check_llama_cpp.py [--families llama_rope qwen2 qwen3_moe gemma3 ...] [--dtype f16]

Builds llama-cpp-python from PyPI (LLAMA_CPP_PYTHON, which compiles its bundled llama.cpp: a few
minutes) into its own virtual environment (--venv, never this one). For each family, a seeded
random tiny transformers model (tests/hf_reference.py; the `reference` extra) with a byte-level BPE
tokenizer as its family ships one (tests/bpe_files.py; Gemma: tests/test_gguf_export.py's) is
loaded by our HF import and written by our GGUF export; then our GGUF import and llama.cpp each
load that file and evaluate the same token ids, llama.cpp's KV cache in float32 (its default f16
alone moves logits by 1e-3). Reported per family: the largest difference between
llama.cpp's logits and ours over every position (float32 export: rounding alone is expected), and
whether 16 greedy tokens agree. Ends with one JSON line. What it does not check: quantized types
other than f32/f16, llama.cpp's own tokenizer on text (transformers' GGUF loader covers the
vocabulary in tests/test_gguf_families.py), and the LoRA adapter files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS.parent / "tests"))
LLAMA_CPP_PYTHON = "0.3.36"
TOKENS = [5, 17, 42, 7, 99, 3, 64, 11, 28, 90, 13, 57]  # with GREEDY more: within the yarn model's 32
GREEDY = 16

WORKER = """
import json, sys
import numpy as np
from llama_cpp import Llama

path, tokens, greedy = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
# the KV cache in float32 (llama.cpp keeps it in f16 by default)
llm = Llama(
    model_path=path, n_ctx=128, n_batch=128, logits_all=True, verbose=False, n_threads=2, type_k=0, type_v=0
)
llm.eval(tokens)
logits = np.asarray(llm.scores[: len(tokens)], np.float32)
new = []
for _ in range(greedy):
    new.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    llm.eval([new[-1]])
np.save(sys.argv[4], logits)
print(json.dumps(new))
"""


def ensure_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"building llama-cpp-python=={LLAMA_CPP_PYTHON} into {venv} (once, a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "numpy"],
        check=True,
    )
    return python


def check(family: str, python: Path, dtype: str, workdir: Path) -> dict:
    import jax
    from bpe_files import byte_level_bpe
    from hf_reference import build

    from tunix_train import api

    directory = workdir / family
    if family.startswith("gemma"):  # the GGUF-readable Gemma and tests/test_gguf_export.py's tokenizer
        from test_gguf_export import _tokenizer

        build(family, directory / "hf", for_gguf=True)
        _tokenizer(directory / "hf")
    else:
        build(family, directory / "hf", vocab_size=320)
        byte_level_bpe(directory / "hf", "llama" if family.startswith("llama") else "qwen", vocab_size=300)
    model = api.load(directory / "hf", mesh_shape=[[1], ["fsdp"]], devices=jax.devices()[:1])
    model.export_gguf(directory / "model.gguf", dtype)
    # ours from the file too: both sides read the same (f16-rounded) weights
    model = api.load(directory / "model.gguf", mesh_shape=[[1], ["fsdp"]], devices=jax.devices()[:1])
    ours = np.asarray(model.logits([TOKENS]))[0]
    our_tokens = [int(t) for t in model.generate([TOKENS], max_new_tokens=GREEDY)[0]]
    result = subprocess.run(
        [
            str(python),
            "-c",
            WORKER,
            str(directory / "model.gguf"),
            json.dumps(TOKENS),
            str(GREEDY),
            str(directory / "theirs.npy"),
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode:
        return {"family": family, "error": (result.stderr.strip().splitlines() or ["?"])[-1]}
    theirs = np.load(directory / "theirs.npy")
    their_tokens = json.loads(result.stdout.strip().splitlines()[-1])
    return {
        "family": family,
        "max_logit_difference": float(np.abs(theirs - ours).max()),
        "logit_scale": float(np.abs(ours).max()),
        "greedy_equal": their_tokens == our_tokens,
        "ours": our_tokens,
        "llama_cpp": their_tokens,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--families",
        nargs="+",
        default=["llama_rope", "qwen2", "qwen3_yarn", "qwen3_moe", "gemma2", "gemma3"],
    )
    parser.add_argument("--dtype", choices=["f32", "f16"], default="f32")
    parser.add_argument(
        "--venv", type=Path, default=Path.home() / ".cache" / "tunix_train" / "llama-cpp-venv"
    )
    args = parser.parse_args()
    python = ensure_venv(args.venv)
    with tempfile.TemporaryDirectory() as workdir:
        rows = [check(family, python, args.dtype, Path(workdir)) for family in args.families]
    for row in rows:
        if "error" in row:
            print(f"{row['family']}: llama.cpp failed: {row['error']}")
        else:
            print(
                f"{row['family']}: max |logit difference| {row['max_logit_difference']:.2e} "
                f"(logits up to {row['logit_scale']:.2f}); greedy tokens equal: {row['greedy_equal']}"
            )
    print(json.dumps({"llama_cpp_python": LLAMA_CPP_PYTHON, "dtype": args.dtype, "families": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
