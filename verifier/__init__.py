"""hybridspec.verifier: lossless verification of draft chains and trees against the target's logits.

Greedy and rejection-sampling rules with a torch reference (`reference`) and Triton kernels (`kernels`, imported only
when used: on CUDA tensors or with backend="triton"). Knows tensors and `Proposal`s, not who proposed them.
"""
from hybridspec.verifier.reference import process_logits
from hybridspec.verifier.api import VerifyResult, verify, verify_batch

__all__ = ["VerifyResult", "process_logits", "verify", "verify_batch"]
