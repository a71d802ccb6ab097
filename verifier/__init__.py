"""hybridspec.verifier"""
