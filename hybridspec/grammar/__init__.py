"""hybridspec.grammar: structured output and tool calls. `constraint` turns `response_format` / `tools` /
`tool_choice` into an xgrammar grammar and keeps one sequence's grammar state (`Constraint`: drafts checked and cut,
grammar-forced tokens, the masks of a verification pass); `tool_calls` parses the Hermes-style `<tool_call>` blocks
the grammar constrains; `templates/` holds the tool-capable chat template.

xgrammar is imported only when a call asks for a grammar.
"""
from hybridspec.grammar.constraint import Constraint, GrammarCompiler, GrammarSpec, grammar_spec

__all__ = ["Constraint", "GrammarCompiler", "GrammarSpec", "grammar_spec"]
