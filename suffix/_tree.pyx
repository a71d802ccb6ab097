# cython: language_level=3
def _placeholder():
    return 0
