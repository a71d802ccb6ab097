"""hybridspec.agent_traces: read real agent logs, replay every LLM call through proposers with the logged response
as the oracle, and report what speculation would buy (tokens per step, acceptance, proposer time, projected speedup).

    from hybridspec.agent_traces import load_traces, TraceTokenizer, proposer_spec, replay, ReplayReport
    loaded = load_traces(["../shared/agent_traces"])
    tokenized = TraceTokenizer("smollm2").tokenize(loaded.sources)
    results = replay(tokenized, [proposer_spec("suffix", 16), proposer_spec("ngram", 16)], 16)
    print(ReplayReport(results, VerifyCost(), 16).format_table())
"""
from hybridspec.agent_traces.formats import (Call, LoadResult, TraceFormatError, TraceSource, Trajectory,
                                             UnknownFormatError, detect_format, discover, load_source, load_traces,
                                             write_jsonl)
from hybridspec.agent_traces.replay import (ProposerSpec, ReplayStats, proposer_spec,
                                            replay, session_links)
from hybridspec.agent_traces.report import ReplayReport
from hybridspec.agent_traces.tokenization import (ChatPieces, TokenizedCall, TokenizedTrajectory, TraceTokenizer,
                                                  tokenizer_dir)

__all__ = [
    "Call", "Trajectory", "TraceSource", "LoadResult", "TraceFormatError", "UnknownFormatError", "detect_format",
    "discover", "load_source", "load_traces", "write_jsonl", "TraceTokenizer", "TokenizedCall", "TokenizedTrajectory",
    "ChatPieces", "tokenizer_dir", "ReplayStats", "ProposerSpec", "proposer_spec",
    "replay", "session_links", "ReplayReport",
]
