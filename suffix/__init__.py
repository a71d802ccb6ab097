"""hybridspec.suffix: model-free proposers (suffix tree, n-gram). No torch here."""
