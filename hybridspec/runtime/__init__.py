"""The runtime: the `Engine` API (`engine`), the one loop thread that runs every call (`loop`), the typed plan of a
step (`scheduler`), the step itself (`step`: propose -> grammar -> route -> verify -> commit), prefill in chunks with
prefix sharing (`prefill`), a call's options (`options`), its text (`text`) and its caller's handle (`handle`), and
the rules that commit tokens (`commit`). docs/architecture.md reads them in order.
"""
