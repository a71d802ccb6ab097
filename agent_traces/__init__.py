"""hybridspec.agent_traces"""
