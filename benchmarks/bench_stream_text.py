"""The text work of a streamed reply: what turning committed tokens into text costs per step, with stop strings and a
stream reading every delta, as the reply grows to 4k tokens.

- whole-text: every step decodes the whole output twice, once to look for stop strings and once for the stream's
  delta (what the engine did before its text was built incrementally): O(n^2) over a reply of n tokens;
- incremental: `hybridspec.runtime.text.SequenceText`, each committed token decoded once with the few tokens before
  it, stop strings looked for in the new text, the delta released (what the engine does now): O(n).

The reply is real agent text (the logged responses of the trajectories in ../shared/agent_traces, SmolLM2's
tokenizer), committed a few tokens per step (1-4, 2.5 on average, as suffix speculation commits them); both ways
must produce the same text.

    python benchmarks/bench_stream_text.py --json out/bench_stream_text.json
"""
from __future__ import annotations

import argparse
import random
import time

from common import TRACES_DIR, machine_info, write_json

STOPS = ("\nObservation:", "</s>")  # as an agent framework sends them; they never occur in the replies here


def agent_reply_tokens(tokenizer, tokens: int) -> list[int]:
    """`tokens` tokens of logged agent responses, one after another."""
    from agent_calls import framework_dirs
    from hybridspec.agent_traces.formats import load_traces

    out: list[int] = []
    for folder in framework_dirs(TRACES_DIR):
        for trajectory in sorted(load_traces(folder).trajectories, key=lambda t: t.session_id):
            for call in trajectory.calls:
                out += tokenizer.encode(call.response + "\n", add_special_tokens=False)
                if len(out) >= tokens:
                    return out[:tokens]
    raise ValueError(f"the traces under {TRACES_DIR} hold fewer than {tokens} tokens of responses")


def steps_of(tokens: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    steps, i = [], 0
    while i < len(tokens):
        n = rng.randint(1, 4)
        steps.append(tokens[i:i + n])
        i += n
    return steps


def whole_text(decode, steps: list[list[int]]) -> str:
    """The engine's text work before: the stop-string check decoded the output with the step's tokens, the stream
    decoded the whole output again for its delta (held while it ended in an incomplete character)."""
    generated: list[int] = []
    sent = ""
    for new in steps:
        if any(s in decode(generated + new) for s in STOPS):
            raise AssertionError("a stop string in the reply")
        generated += new
        text = decode(generated)
        if not text.endswith("\ufffd") and len(text) > len(sent):
            sent = text
    return decode(generated)


def incremental(decode, steps: list[list[int]]) -> str:
    """The engine's text work now (`SequenceText`): each step's tokens added, the new text released."""
    from hybridspec.runtime.text import SequenceText

    text = SequenceText(decode, STOPS)
    sent = ""
    for new in steps:
        if text.add(new) is not None:
            raise AssertionError("a stop string in the reply")
        sent += text.release(finished=False)[0]
    return sent + text.release(finished=True)[0]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="512,1024,2048,4096", help="reply lengths in tokens")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each way; the fastest counts")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from hybridspec.model.loading import load_tokenizer

    tokenizer = load_tokenizer("smollm2")

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    lengths = [int(n) for n in args.lengths.split(",")]
    reply = agent_reply_tokens(tokenizer, max(lengths))
    rows = []
    print(f"{'tokens':>7}{'steps':>7}{'whole-text ms':>15}{'incremental ms':>16}{'ratio':>8}{'us/token now':>14}")
    for n in lengths:
        steps = steps_of(reply[:n])
        seconds = {}
        for name, way in (("whole_text", whole_text), ("incremental", incremental)):
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                text = way(decode, steps)
                best = min(best, time.perf_counter() - start)
            seconds[name] = best
            assert text == decode(reply[:n]), name  # the same text either way
        row = {"tokens": n, "steps": len(steps), "whole_text_ms": round(1e3 * seconds["whole_text"], 2),
               "incremental_ms": round(1e3 * seconds["incremental"], 2),
               "ratio": round(seconds["whole_text"] / seconds["incremental"], 1),
               "incremental_us_per_token": round(1e6 * seconds["incremental"] / n, 2)}
        rows.append(row)
        print(f"{n:>7}{len(steps):>7}{row['whole_text_ms']:>15.1f}{row['incremental_ms']:>16.1f}"
              f"{row['ratio']:>7.1f}x{row['incremental_us_per_token']:>14.1f}")
    result = {"benchmark": "bench_stream_text", "machine": machine_info(), "stops": list(STOPS),
              "repeats": args.repeats, "rows": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
