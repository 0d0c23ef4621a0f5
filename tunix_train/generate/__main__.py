"""Generate text from a checkpoint (Hugging Face directory, GGUF file or tunix_train run):

    python -m tunix_train.generate PATH --prompt "To be, or not" [--prompt ...] --max_new_tokens 64 \
        [--temperature 0.7 --top_k 64 --top_p 0.95 --seed 0] [--mesh_shape '[[2,2],["fsdp","tp"]]']
    python -m tunix_train.generate PATH --prompt "<start_of_image>What is it?" --image cat.png
    python -m tunix_train.generate PATH --chat [--system "..."] [sampling flags]
    python -m tunix_train.generate PATH --prompt "..." --draft DRAFT_PATH [--speculative_tokens 4]
    python -m tunix_train.generate PATH --prompt "..." --prompt_lookup 3 [--speculative_tokens 4]
        [--adaptive_speculation]

One prompt streams its continuation as it is produced; several print each continuation when all are
done. --image (repeatable, a model with an image tower): each <start_of_image> of the one prompt
takes an image in order (with none, the images go in front). --chat talks with the model in its chat
template: each line read is a user turn, the reply streams, the conversation is kept (/image PATH
adds an image to the next turn, /reset forgets it, /exit or end of input ends). --draft (a smaller
model sharing the tokenizer) or --prompt_lookup (n-grams of the prompt) decodes speculatively: the
same tokens greedily, the same distribution sampled (docs/generation.md); --adaptive_speculation
drafts only as many as pay; the acceptance is printed to stderr at the end. Bad input is a one-line
error and exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from tunix_train import exit_codes
from tunix_train.cpu_devices import mesh_shape_argument


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tunix_train.generate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "path", help="a Hugging Face Gemma directory or a tunix_train run (or one checkpoint)"
    )
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    parser.add_argument(
        "--chat", action="store_true", help="a conversation on the terminal (or one turn a line)"
    )
    parser.add_argument(
        "--system", default=None, help="with --chat: a system message opening the conversation"
    )
    parser.add_argument("--image", action="append", default=[], help="an image file for the prompt (repeat)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft", default=None, help="a draft model's checkpoint: speculative decoding")
    parser.add_argument(
        "--prompt_lookup", type=int, default=0, help="speculative decoding by n-grams up to N of the context"
    )
    parser.add_argument(
        "--draft_mesh_shape",
        default=None,
        help="the draft's own split of the devices, JSON [[sizes], [axis names]] (default: the model's mesh)",
    )
    parser.add_argument("--speculative_tokens", type=int, default=4, help="tokens drafted a round")
    parser.add_argument(
        "--adaptive_speculation",
        action="store_true",
        help="each chunk drafts as many of up to --speculative_tokens as pay (none when none do)",
    )
    parser.add_argument(
        "--mesh_shape",
        default=None,
        help='JSON [[sizes], [axis names]], e.g. \'[[2,2],["fsdp","tp"]]\' (default: all devices on fsdp)',
    )
    args = parser.parse_args(argv)
    if bool(args.prompt) == args.chat:
        parser.error("give --prompt (one or more) or --chat")
    if args.image and (args.chat or len(args.prompt) != 1):
        parser.error("--image goes with one --prompt (in --chat, /image PATH)")
    if args.draft and args.prompt_lookup:
        parser.error("give --draft or --prompt_lookup, not both")
    if args.adaptive_speculation and not (args.draft or args.prompt_lookup):
        parser.error("--adaptive_speculation needs a drafter: give --draft or --prompt_lookup")
    if args.draft_mesh_shape and not args.draft:
        parser.error("--draft_mesh_shape is a draft model's: give --draft")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    try:
        mesh_shape = mesh_shape_argument(args.mesh_shape)
        draft_mesh_shape = mesh_shape_argument(args.draft_mesh_shape, "--draft_mesh_shape")
    except ValueError as err:
        print(f"tunix_train.generate: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR

    from tunix_train.config import ConfigError
    from tunix_train.generate import loaded, speculative
    from tunix_train.generate.speculative import Speculation

    try:
        model = loaded.load(args.path, mesh_shape)
        sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        draft = model.load_draft(args.draft, draft_mesh_shape) if args.draft else None
        if args.prompt_lookup:
            draft = Speculation(
                args.speculative_tokens, lookup=args.prompt_lookup, adaptive=args.adaptive_speculation
            )
        sampling.update(
            draft=draft,
            speculative_tokens=args.speculative_tokens,
            adaptive_speculation=args.adaptive_speculation,
        )
        engine = model.engine_for(draft, args.speculative_tokens, args.adaptive_speculation)[0]
        if args.chat:
            _chat(model, args.system, args.max_new_tokens, sampling)
        elif len(args.prompt) == 1:
            _stream(model, args.prompt[0], args.max_new_tokens, sampling, args.image)
        else:
            for i, text in enumerate(model.generate_text(args.prompt, args.max_new_tokens, **sampling)):
                print(f"[{i}] {args.prompt[i]}{text}")
        if engine.speculation is not None:
            print(f"tunix_train.generate: {speculative.summary(engine.stats)}", file=sys.stderr)
    except ConfigError as err:
        print(f"tunix_train.generate: error: {err}", file=sys.stderr)
        return exit_codes.CONFIG_ERROR
    return exit_codes.OK


def _stream(model, prompt: str, max_new_tokens: int, sampling: dict, images: list[str]) -> None:
    """Prints the prompt, then the continuation as each chunk of tokens arrives."""
    ids: list[int] = []
    shown = ""
    request = prompt
    kwargs = {}
    if images:
        request, pixels = model.image_prompt(prompt, images)
        kwargs = {"images": pixels}
    print(prompt, end="", flush=True)
    for new in model.stream(request, max_new_tokens, **kwargs, **sampling):
        ids.extend(new)
        text = model.tokenizer.decode(ids)
        print(text[len(shown) :], end="", flush=True)
        shown = text
    print()


def _chat(model, system: str | None, max_new_tokens: int, sampling: dict) -> None:
    """Reads user turns line by line and streams each reply; the conversation grows as it goes."""
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    images: list[dict] = []  # /image PATH: parts for the next user turn
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            messages, images = list(opening), []
            continue
        if line.strip().startswith("/image "):
            images.append({"type": "image", "image": line.strip()[len("/image ") :].strip()})
            continue
        if not line.strip():
            continue
        text = line.rstrip("\n")
        messages.append(
            {"role": "user", "content": [*images, {"type": "text", "text": text}] if images else text}
        )
        images = []
        reply = ""
        for piece in model.reply(messages, max_new_tokens, **sampling):
            print(piece, end="", flush=True)
            reply += piece
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
