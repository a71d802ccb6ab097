"""`hybridspec demo`: an agent-style session on SmolLM2, with and without speculation, side by side.

Sets itself up on first use (the embedded model is converted to a safetensors directory in the user cache and this
machine's costs are measured, each saying so as it goes), then runs the same multi-turn coding-agent conversation
twice, with plain greedy decoding and with suffix speculation, and prints the tokens/s of both, the speedup and
whether the outputs are identical. The two run on two engines over the same weights, each with its own prefix cache,
so each pays its own prompts and the ratio measures speculation alone; they take turns going first.
"""
from __future__ import annotations

import argparse
import sys
import time

SYSTEM = """You are a coding agent working in a Python repository. Think step by step, then reply with exactly one \
shell command in a ```bash block. The environment shows you the command's output after each of your replies.

Rules:
- Read the relevant files before you change anything.
- Change only non-test files.
- When you are done, reply with: ```bash
echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT
```"""

TASK = """<pr_description>
`parse_duration("1h30m")` returns 5400 but `parse_duration("90s")` raises ValueError: "unknown unit: s". Seconds \
should be supported, and the error message should list the supported units.
</pr_description>

Start by looking at the repository."""

OBSERVATIONS = [
    """<returncode>0</returncode>
<output>
README.md
setup.py
timeparse/__init__.py
timeparse/duration.py
tests/test_duration.py
</output>""",
    """<returncode>0</returncode>
<output>
import re

UNITS = {"h": 3600, "m": 60}
_TOKEN = re.compile(r"(\\d+)([a-z]+)")


def parse_duration(text: str) -> int:
    \"\"\"Parse a duration like "1h30m" into seconds.\"\"\"
    total = 0
    for amount, unit in _TOKEN.findall(text.strip().lower()):
        if unit not in UNITS:
            raise ValueError(f"unknown unit: {unit}")
        total += int(amount) * UNITS[unit]
    return total
</output>""",
    """<returncode>0</returncode>
<output>
</output>""",
]


LABELS = {"none": "plain", "suffix": "suffix"}


def _turns(messages_per_turn: int):
    yield [{"role": "user", "content": TASK}]
    for observation in OBSERVATIONS[: messages_per_turn - 1]:
        yield [{"role": "user", "content": observation}]


def run_demo(model: str = "smollm2", turns: int = 4, max_new_tokens: int = 96, threads: int | None = None,
             show: bool = False, out=None) -> dict:
    from hybridspec.model.machine import set_threads
    from hybridspec.runtime.engine import Engine

    out = out or sys.stdout

    threads = set_threads(threads)
    print(f"loading {model} ...", file=out, flush=True)
    start = time.perf_counter()
    plain = Engine.from_pretrained(model)
    engines = {"none": plain, "suffix": Engine(plain.target, plain.tokenizer)}  # the same weights, caches of its own
    for engine in engines.values():  # a few tokens each, so that neither method's first turn pays one-time set-up
        engine.generate("Hello", max_new_tokens=4, speculate="none")
    print(f"ready in {time.perf_counter() - start:.1f} s; {threads} CPU threads\n", file=out, flush=True)
    sessions = {mode: engine.session(system=SYSTEM, max_new_tokens=max_new_tokens, speculate=mode)
                for mode, engine in engines.items()}
    replies: dict[str, list] = {mode: [] for mode in sessions}
    for turn, messages in enumerate(_turns(turns)):
        order = list(sessions) if turn % 2 == 0 else list(sessions)[::-1]  # load from elsewhere hits both alike
        for mode in order:
            reply = sessions[mode].send(messages)
            replies[mode].append(reply)
            s = reply.stats
            print(f"  turn {turn + 1} [{LABELS[mode]:>6}]: {len(reply.token_ids):>4} tokens in {s.total_s:5.1f} s "
                  f"({s.tokens_per_s:5.1f} tok/s, {s.tokens_per_step:4.1f} tokens/step; {s.prefill_tokens:>5} prompt "
                  f"tokens run)", file=out, flush=True)
        if show:
            print("    " + replies["suffix"][-1].text.replace("\n", "\n    "), file=out)
    base, spec = sessions["none"].stats, sessions["suffix"].stats
    identical = all(a.token_ids == b.token_ids for a, b in zip(replies["none"], replies["suffix"]))
    speedup = spec.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0
    print(f"\n{'':<22}{'tokens':>8}{'seconds':>9}{'tok/s':>8}{'tokens/step':>13}", file=out)
    for label, stats in (("plain greedy", base), ("suffix speculation", spec)):
        print(f"{label:<22}{stats.new_tokens:>8}{stats.total_s:>9.1f}{stats.tokens_per_s:>8.1f}"
              f"{stats.tokens_per_step:>13.2f}", file=out)
    print(f"\nsuffix speculation: {speedup:.2f}x plain greedy decoding in tokens/s of whole calls (prompt and "
          f"generation; each method ran its own prompts), acceptance {spec.acceptance:.0%}, outputs identical: "
          f"{'yes' if identical else 'NO'}", file=out)
    return {"baseline_tok_s": base.tokens_per_s, "spec_tok_s": spec.tokens_per_s, "speedup": speedup,
            "tokens_per_step": spec.tokens_per_step, "identical": identical,
            "prompt_tokens_run": {mode: [r.stats.prefill_tokens for r in rs] for mode, rs in replies.items()}}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="agent-style session on SmolLM2 with and without speculation",
                                   description=__doc__)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a local Hugging Face model directory")
    parser.add_argument("--turns", type=int, default=len(OBSERVATIONS) + 1, choices=range(1, len(OBSERVATIONS) + 2),
                        metavar=f"1..{len(OBSERVATIONS) + 1}")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: the machine's physical cores)")
    parser.add_argument("--show", action="store_true", help="print the replies")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.max_new_tokens <= 0:
        raise SystemExit("--max-new-tokens must be positive")
    result = run_demo(args.model, args.turns, args.max_new_tokens, args.threads, args.show)
    return 0 if result["identical"] else 1
