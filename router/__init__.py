"""hybridspec.router"""
