"""The verifier: torch reference vs Triton kernels at batch 1..256, chains and trees, greedy and rejection sampling.

    python benchmarks/bench_verifier.py [--json PATH] [--batches 1,4,16,64,256] [--num-draft 8] [--vocab V]
                                        [--modes greedy-chain,...] [--repeats 20]

On CUDA both backends are timed on the same inputs and their results compared. On CPU the reference is timed, and the
kernels (which need the Triton interpreter there, ~1 ms per program instance) are only checked against it at small
sizes.
Per (mode, batch, backend): median milliseconds of
  e2e    verify_batch() on a padded [B, 1 + N, V] logits tensor: logits processing, random draws and the rules;
  rules  the rule functions alone (greedy_walk, or rejection_walk + race_sample) on prepared inputs: the part the
         kernels implement.
Inputs are synthetic (timing does not depend on the values): random target logits; drafts that agree with the target
often enough that paths are long (greedy: the target's argmax 80% of the time; sampling: draft logits = target logits
plus noise, tokens drawn from the draft, or its argmax for the one-hot modes).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import: the kernels run on CPU tensors

from tqdm import tqdm  # noqa: E402

from common import machine_info, median_ms, write_json  # noqa: E402
from hybridspec.proposal import Proposal  # noqa: E402
from hybridspec.verifier import process_logits, reference, verify_batch  # noqa: E402

CHAIN = list(range(-1, 15))
TREE = [-1, -1, 0, 0, 1, 2, 2, 3, 5, 5, 7, 8, 8, 10, 11, 13]  # a bushy suffix-tree-like draft
MODES = {  # name: (parents source, temperature, draft has logits)
    "greedy-chain": ("chain", 0.0, False), "greedy-tree": ("tree", 0.0, False),
    "sample-chain": ("chain", 1.0, True), "sample-chain-onehot": ("chain", 1.0, False),
    "sample-tree": ("tree", 1.0, True), "sample-tree-onehot": ("tree", 1.0, False),
}


@dataclass
class Case:
    logits: torch.Tensor  # [B, 1 + N, V]
    proposals: list[Proposal]
    temperature: float
    draft_tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor


def make_case(mode: str, batch: int, num_draft: int, vocab: int, device: str, seed: int = 0) -> Case:
    shape, temperature, with_logits = MODES[mode]
    parents = (CHAIN if shape == "chain" else TREE)[:num_draft]
    g = torch.Generator(device).manual_seed(seed)
    logits = torch.randn(batch, 1 + num_draft, vocab, generator=g, device=device) * 3
    rows = torch.tensor(parents, device=device) + 1
    if temperature == 0:
        tokens = logits[:, rows].argmax(-1)
        noise = torch.randint(0, vocab, tokens.shape, generator=g, device=device)
        tokens = torch.where(torch.rand(tokens.shape, generator=g, device=device) < 0.8, tokens, noise)
        draft_logits = None
    else:
        draft_logits = logits[:, rows] + torch.randn(batch, num_draft, vocab, generator=g, device=device)
        if with_logits:
            probs = process_logits(draft_logits, temperature).view(-1, vocab)
            tokens = torch.multinomial(probs, 1, generator=g).view(batch, num_draft)
        else:
            tokens = draft_logits.argmax(-1)
    proposals = [Proposal(token_ids=t, parents=list(parents), draft_logits=draft_logits[b] if with_logits else None)
                 for b, t in enumerate(tokens.tolist())]
    return Case(logits, proposals, temperature, tokens.to(torch.int32),
                torch.tensor([parents] * batch, dtype=torch.int32, device=device),
                torch.full((batch,), num_draft, dtype=torch.int32, device=device))


def rules_fn(case: Case, impl) -> Callable[[], object]:
    """The rule functions alone, on inputs prepared as verify_batch would prepare them."""
    if case.temperature == 0:
        target_argmax = case.logits.argmax(-1)
        return lambda: impl.greedy_walk(target_argmax, case.draft_tokens, case.parents, case.num_nodes)
    target_probs = process_logits(case.logits, case.temperature)
    draft_probs = (process_logits(torch.stack([p.draft_logits for p in case.proposals]), case.temperature)
                   if case.proposals[0].draft_logits is not None else None)
    batch, num_rows, vocab = target_probs.shape
    g = torch.Generator(case.logits.device).manual_seed(1)
    uniforms = torch.rand(batch, num_rows - 1, generator=g, device=case.logits.device)
    race = torch.empty(batch, vocab, device=case.logits.device).exponential_(generator=g).reciprocal_()

    def run():
        walk = impl.rejection_walk(target_probs, draft_probs, case.draft_tokens, case.parents, case.num_nodes, uniforms)
        return impl.race_sample(target_probs, walk[2], walk[3], walk[4], race)
    return run


def verify_fn(case: Case, backend: str) -> Callable[[], list]:
    return lambda: verify_batch(case.logits, case.proposals, case.temperature,
                                generator=torch.Generator(case.logits.device).manual_seed(2), backend=backend)


def check_kernels(modes: list[str], num_draft: int, device: str, batch: int, vocab: int) -> list[dict]:
    """Kernels vs reference on the same inputs and random draws: identical results expected."""
    rows = []
    for mode in modes:
        case = make_case(mode, batch, num_draft, vocab, device, seed=3)
        torch_results, triton_results = verify_fn(case, "torch")(), verify_fn(case, "triton")()
        rows.append({"mode": mode, "batch": batch, "vocab": vocab, "match": torch_results == triton_results,
                     "mean_accepted": statistics.mean(len(r.accepted) for r in torch_results)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    parser.add_argument("--batches", type=str, default="1,4,16,64,256")
    parser.add_argument("--num-draft", type=int, default=8, help="draft nodes per sequence (chain length / tree size)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="default: 128256 on CUDA (Llama 3), 49152 on CPU (SmolLM2)")
    parser.add_argument("--modes", type=str, default=",".join(MODES))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if ON_GPU else "cpu"
    vocab = args.vocab or (128256 if ON_GPU else 49152)
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; choose from {list(MODES)}")
    if not 1 <= args.num_draft <= len(CHAIN):
        parser.error(f"--num-draft must be in 1..{len(CHAIN)}")
    backends = ["torch", "triton"] if ON_GPU else ["torch"]
    sync = torch.cuda.synchronize if ON_GPU else None

    from hybridspec.verifier import kernels

    timings = []
    configs = [(m, b) for m in modes for b in batches]
    for mode, batch in tqdm(configs, desc="verifier", disable=not sys.stderr.isatty()):
        case = make_case(mode, batch, args.num_draft, vocab, device)
        repeats = max(3, args.repeats if batch <= 16 or ON_GPU else args.repeats // 4)
        results = {}
        for backend in backends:
            impl = kernels if backend == "triton" else reference
            results[backend] = verify_fn(case, backend)()
            timings.append({"mode": mode, "batch": batch, "backend": backend,
                            "e2e_ms": median_ms(verify_fn(case, backend), repeats, sync=sync),
                            "rules_ms": median_ms(rules_fn(case, impl), repeats, sync=sync),
                            "mean_accepted": statistics.mean(len(r.accepted) for r in results[backend])})
        if ON_GPU:
            timings[-1]["matches_torch"] = results["triton"] == results["torch"]
        del case
    # The interpreter is too slow for real sizes: on CPU the kernels are checked at a small batch and vocabulary.
    checks = (check_kernels(modes, args.num_draft, device, batch=4, vocab=64) if not ON_GPU
              else check_kernels(modes, args.num_draft, device, batch=max(batches), vocab=vocab))

    print(f"\nverifier on {torch.cuda.get_device_name() if ON_GPU else f'CPU ({torch.get_num_threads()} threads)'}: "
          f"V={vocab}, N={args.num_draft} draft nodes, torch {torch.__version__}")
    header = f"{'mode':<20}{'B':>5}  " + "".join(f"{b + ' e2e':>12}{b + ' rules':>13}" for b in backends)
    if ON_GPU:
        header += f"{'rules x':>9}{'e2e x':>8}{'match':>7}"
    print(header + f"{'accepted':>10}")
    by_key = {(t["mode"], t["batch"], t["backend"]): t for t in timings}
    for mode, batch in configs:
        rows = [by_key[(mode, batch, b)] for b in backends]
        line = f"{mode:<20}{batch:>5}  " + "".join(f"{r['e2e_ms']:>10.3f}ms{r['rules_ms']:>11.3f}ms" for r in rows)
        if ON_GPU:
            line += (f"{rows[0]['rules_ms'] / rows[1]['rules_ms']:>8.1f}x{rows[0]['e2e_ms'] / rows[1]['e2e_ms']:>7.2f}x"
                     f"{str(rows[1]['matches_torch']):>7}")
        print(line + f"{rows[0]['mean_accepted']:>10.2f}")
    print("\nkernels vs reference (same inputs and random draws):"
          + ("" if ON_GPU else " Triton interpreter on CPU, small sizes only"))
    for c in checks:
        print(f"  {c['mode']:<20} B={c['batch']:<4} V={c['vocab']:<7} {'identical' if c['match'] else 'DIFFERENT'}")
    write_json(args.json, {"device": torch.cuda.get_device_name() if ON_GPU else "cpu", "torch": torch.__version__,
                           "triton_interpreter": not ON_GPU, "cpu_threads": torch.get_num_threads(), "vocab": vocab,
                           "num_draft": args.num_draft, "timings": timings, "kernel_checks": checks,
                           "machine": machine_info()})
    if not all(c["match"] for c in checks):
        sys.exit("kernels and reference disagree")


if __name__ == "__main__":
    main()
