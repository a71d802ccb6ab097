"""`hybridspec serve`: an HTTP server on the engine that speaks the APIs agent clients speak: OpenAI's chat
completions (the `openai` client, litellm, mini-swe-agent, ...), OpenAI's Responses API (Codex CLI, the OpenAI Agents
SDK) and Anthropic's Messages API (Claude Code, the `anthropic` SDK).

    hybridspec serve                       # SmolLM2 on http://127.0.0.1:8000, suffix speculation
    hybridspec serve ~/models/my-llama --port 8080 --served-model-name my-llama --speculate ngram

Endpoints: POST /v1/chat/completions, /v1/completions, /v1/responses (GET / DELETE /v1/responses/{id}),
/v1/messages, /v1/messages/count_tokens (streaming or not); GET /v1/models, /v1/models/{id}, /health, /metrics
(Prometheus). Tools (Hermes-style <tool_call> blocks in the chat template, constrained by a grammar, returned as each
API's calls) and structured output (JSON, a JSON schema) in every API, with compact JSON by default. A request may
pick its proposer with the extra body field `speculate`. A field a request leaves out gets the API's default
(temperature 1; max_tokens up to --max-tokens), not the Python API's greedy 256 tokens: clients written against those
APIs expect their defaults (`hybridspec.serve.app.SERVER_DEFAULTS`). `create_app(engine)` builds the app for any
engine (tests, embedding in another ASGI server).
"""
from __future__ import annotations

import argparse
import os

__all__ = ["create_app", "register"]


def create_app(*args, **kwargs):
    from hybridspec.serve.app import create_app

    return create_app(*args, **kwargs)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="HTTP server: OpenAI's chat completions and Responses API, "
                                   "Anthropic's Messages API",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2",
                        help="'smollm2' (the embedded model, the default), a local Hugging Face model directory or "
                             "a GGUF file (the architectures: docs/models.md)")
    parser.add_argument("--model", dest="model_flag", default=None, metavar="MODEL",
                        help="the model, as the positional argument (vLLM's spelling)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for others, "
                             "with --api-key)")
    parser.add_argument("--api-key", default=os.environ.get("HYBRIDSPEC_API_KEY") or None,
                        help="the key every /v1 route and /metrics want (Authorization: Bearer KEY, or x-api-key); "
                             "default $HYBRIDSPEC_API_KEY, else none")
    parser.add_argument("--max-body-size", type=parse_size, default=None, metavar="BYTES",
                        help="the largest request body (default 16M); larger ones get a 413, unread")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model argument's last path component)")
    parser.add_argument("--speculate", default="suffix",
                        help="the proposer of requests that do not name one: suffix (default), ngram, peagle, lstm, "
                             "eagle3, suffix+peagle, ..., or none")
    parser.add_argument("--max-tokens", type=int, default=1024,
                        help="the limit of requests that set no max_tokens (default 1024: OpenAI's defaults where a "
                             "request leaves a field out, temperature 1 included)")
    parser.add_argument("--default-temperature", type=float, default=1.0, metavar="T",
                        help="the temperature of requests that set none (default 1, the APIs' own; 0: greedy, for "
                             "clients that send none, e.g. Claude Code, on a small model)")
    parser.add_argument("--max-model-len", type=int, default=None, help="the context (default: the model's)")
    parser.add_argument("--prefix-cache-bytes", type=int, default=None,
                        help="the KV budget of automatic prefix caching (default 2 GiB; 0: off)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="prompt tokens a request runs per decode step while others decode (chunked prefill; "
                             "default 512)")
    parser.add_argument("--chat-template", default=None, metavar="PATH",
                        help="a Jinja chat template (a file, or the template itself) instead of the model's own; "
                             "default: the model's, or for requests with tools, where it ignores them, hybridspec's "
                             "ChatML tools template")
    parser.add_argument("--no-grammar-drafts", dest="grammar_drafts", action="store_false",
                        help="under a grammar (tools, response_format) do not draft the tokens it forces")
    parser.add_argument("--no-compact-json", dest="compact_json", action="store_false",
                        help="let tool calls' and json_schema replies' JSON hold any whitespace (default: none but "
                             "the one space json.dumps writes after ',' and ':')")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: the machine's physical cores)")
    parser.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                        help="requests running at once (vLLM's name; default 64); later ones wait in arrival order")
    parser.add_argument("--kv-cache-memory", type=parse_size, default=None, metavar="BYTES",
                        help="KV the running requests may hold together, e.g. 8G (default: what keeps the server "
                             "within about half of the machine's or container's memory)")
    parser.add_argument("--max-waiting", type=int, default=None, metavar="N",
                        help="requests that may wait for a place (default 1024); past them the server answers 429")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from pathlib import Path

    import prometheus_client
    import uvicorn

    from hybridspec.errors import InvalidParameter
    from hybridspec.model.machine import limit_allocator_arenas, set_threads
    from hybridspec.runtime.engine import PREFILL_CHUNK, Engine
    from hybridspec.runtime.prompts import load_chat_template
    from hybridspec.serve.app import SERVER_DEFAULTS

    if args.prefill_chunk is not None and args.prefill_chunk <= 0:
        raise SystemExit("--prefill-chunk must be positive")
    try:
        chat_template = None if args.chat_template is None else load_chat_template(args.chat_template)
    except (OSError, ValueError) as e:
        raise SystemExit(f"--chat-template: {e}")
    for flag in ("threads", "max_num_seqs", "max_waiting"):
        value = getattr(args, flag)
        if value is not None and value < (0 if flag == "max_waiting" else 1):
            raise SystemExit(f"--{flag.replace('_', '-')} must be {'>= 0' if flag == 'max_waiting' else 'positive'}")
    try:  # an unknown name fails here, at start, not at the first request
        defaults = SERVER_DEFAULTS.replace(max_new_tokens=args.max_tokens, speculate=args.speculate,
                                           temperature=args.default_temperature,
                                           grammar_drafts=args.grammar_drafts, compact_json=args.compact_json)
    except InvalidParameter as e:
        flags = {"max_new_tokens": "max-tokens", "temperature": "default-temperature"}
        raise SystemExit(f"--{flags.get(e.param, e.param.replace('_', '-'))}: {e}")
    if args.model_flag is not None:
        if args.model not in ("smollm2", args.model_flag):
            raise SystemExit(f"two models: {args.model!r} and --model {args.model_flag!r}; give one")
        args.model = args.model_flag
    threads = set_threads(args.threads)
    limit_allocator_arenas()
    try:  # a missing directory or an architecture the engine does not run: one line, not a traceback
        engine = Engine.from_pretrained(args.model, max_model_len=args.max_model_len,
                                        prefix_cache_bytes=args.prefix_cache_bytes,
                                        prefill_chunk=args.prefill_chunk or PREFILL_CHUNK, chat_template=chat_template,
                                        max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory,
                                        max_waiting=args.max_waiting)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"model {args.model!r}: {e}")
    try:  # a drafter that does not fit the model fails here too
        engine.proposers.get(defaults.speculate)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--speculate: {e}")
    prometheus_client.disable_created_metrics()  # no `_created` series beside every counter (as vLLM)
    name = args.served_model_name or Path(str(args.model).rstrip("/")).name
    app = create_app(engine, served_model_name=name, defaults=defaults, api_key=args.api_key,
                     **({"max_body_bytes": args.max_body_size} if args.max_body_size else {}))
    limits = engine.admission.limits
    print(f"hybridspec serve: {name} on http://{args.host}:{args.port}/v1 (speculate={args.speculate}; "
          f"{threads} threads; at most {limits.max_num_seqs} requests "
          f"running in {limits.kv_cache_memory / 2**30:.1f} GiB of KV, {limits.max_waiting} waiting"
          f"{'; an API key required' if args.api_key else ''})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def parse_size(text: str) -> int:
    """A size: bytes, or with a K / M / G / T suffix (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    number, unit = text.strip().upper().removesuffix("B").removesuffix("I"), ""
    if number and number[-1] in units:
        number, unit = number[:-1], number[-1]
    try:
        value = int(float(number) * units[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8G, 512M, 1073741824)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return value
