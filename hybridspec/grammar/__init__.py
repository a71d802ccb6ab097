"""hybridspec.grammar: structured output and tool calls. `constraint` turns `response_format` / `tools` /
`tool_choice` into an xgrammar grammar and keeps one sequence's grammar state (`Constraint`: drafts checked and cut,
grammar-forced tokens, the masks of a verification pass); `tool_calls` parses the Hermes-style `<tool_call>` blocks
the grammar constrains (no torch: the server's streaming imports it alone); `templates/` holds the tool-capable chat
template. xgrammar is imported only when a call asks for a grammar.
"""
