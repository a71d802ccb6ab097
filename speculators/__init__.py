"""hybridspec.speculators"""
