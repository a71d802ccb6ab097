"""The runtime: the `Engine` API, a call's state, the decode step (propose -> route -> verify -> update), prefill in
chunks with prefix sharing, the scheduler that lets concurrent calls share steps, and the rules that commit tokens.

The engine (`engine`) takes calls; each decode step is one function of `step`; a prompt's tokens go through `prefill`.
"""
