"""Tools around the runtime: the demo, `hybridspec train`, the peers we measure against, the proposer conformance
checks and tiny models for tests."""
