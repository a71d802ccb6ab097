"""`hybridspec gpu-run`: the work that needs a GPU, in one command that fits one device call.

    hybridspec gpu-run pack                      # here: the target's weights in parts (.gpu/parts/NN), one a call
    python3 -m hybridspec.tools.gpu_run stage    # there: take the carried parts into .gpu/store
    python3 -m hybridspec.tools.gpu_run run      # there: stage, checks, data, training, heads into $OUT

`run`, within --budget-s of wall clock: stages the carried weight parts (`gpu_weights`); runs the GPU checks in a
subprocess (`gpu_checks`: Triton verifier kernels against the torch reference, the verification-cost curve, drafter
latency); has the target write training text in batches and builds the feature cache (`gpu_data`: the shipped
recipes' prompt items first, both splits as the recipes split them, carried in the payload: `gpu_items`; then
self-instruct requests and their greedy answers fill the rest of the share); trains each drafter (FastEagle and
P-EAGLE from their recipes, scaled by --scale) for as many steps as its share of the budget allows, resumably;
measures acceptance on the recipes' held-out items; writes each head (compact form) zipped, the log and figures.json
into the output folder ($OUT, else --out). Every phase stops at its share and a failed phase is recorded in
figures.json, the others still run. On a CPU --scale tiny runs the same path in seconds
(tests/test_gpu_run.py). docs/GPU.md is the runbook.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any, Callable

from hybridspec.tools.gpu_data import build_data
from hybridspec.tools.gpu_items import ITEMS_FILE, read_items
from hybridspec.tools.gpu_weights import GPU_DIR, checkout_imports, pack, sha256, stage, write_parts

ROOT = Path(__file__).resolve().parents[2]
RETURN_LIMIT = 16 * 2**20 - 64 * 1024  # a returned file's limit, with a margin
DRAFTERS = ("fasteagle", "peagle")
# Scale presets over the shipped *-smollm2 recipes. The data section is theirs (held-out fraction, prompt and response
# lengths) but for the batch sizes and the sources: the recipes' items come in the payload (`gpu_items`), and the
# target's own self-instruct requests fill the rest of the data share. Steps are set from the measured step time.
SCALES: dict[str, dict[str, Any]] = {
    "h100": {"data": {"generation_batch_size": 512, "shard_size": 512},
             "self_instruct": 100_000,
             "training": {"tokens_per_step": 2048, "warmup_steps": 100, "save_every": 500, "eval_every": 0,
                          "eval_max_sequences": 256, "steps": 200_000},
             "checks_s": 75, "reserve_s": 30, "data_share": 0.4, "requests_share": 0.3, "feature_tokens": 16384},
    "tiny": {"data": {"max_prompt_tokens": 32, "max_new_tokens": 12, "generation_batch_size": 8, "shard_size": 8,
                      "heldout_fraction": 0.25},
             "self_instruct": 8,
             "training": {"tokens_per_step": 48, "warmup_steps": 1, "save_every": 2, "eval_every": 0,
                          "eval_max_sequences": 4, "steps": 3, "eval_ks": [3]},
             "checks_s": 120, "reserve_s": 5, "data_share": 0.4, "requests_share": 0.3, "feature_tokens": 2048},
}


class Run:
    """One run's output folder, log and figures, written again after every phase."""

    def __init__(self, out: Path, budget_s: float) -> None:
        self.out, self.start = out, time.monotonic()
        self.deadline = self.start + budget_s
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = (out / "gpu_run.log").open("a")
        self.figures: dict[str, Any] = {"budget_s": budget_s, "phases": {}, "started": time.strftime("%F %T")}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, message: str) -> None:
        line = f"[{time.monotonic() - self.start:7.1f} s] {message}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def save(self) -> None:
        (self.out / "figures.json").write_text(json.dumps(self.figures, indent=1, default=str) + "\n")

    def phase(self, name: str, fn: Callable[[], Any]) -> Any:
        """Run fn as a phase: its time, status and error (with traceback) go into figures["phases"]."""
        start = time.monotonic()
        self.log(f"{name}: start ({self.left():.0f} s left)")
        record: dict[str, Any] = {}
        try:
            result = fn()
            record["status"] = "ok"
        except Exception as e:
            result = None
            record.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
            self.log(f"{name}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()}")
        record["seconds"] = round(time.monotonic() - start, 1)
        self.figures["phases"][name] = record
        self.log(f"{name}: {record['status']} in {record['seconds']} s")
        self.save()
        return result


# ---------------------------------------------------------------------------------------------------------------------
# phases


def run_checks(run: Run, target: str | None, tiny: bool, limit_s: float) -> dict[str, Any]:
    import torch

    # the shipped heads' latency on the GPU; at the tiny scale only the trained heads' (after training)
    heads = [] if tiny else [p for p in sorted((ROOT / "speculators" / "checkpoints").glob("*"))
                             if (p / "config.json").is_file()]
    out_json = run.out / "checks.json"
    cmd = [sys.executable, "-m", "hybridspec.tools.gpu_checks", "--json", str(out_json),
           "--heads", ",".join(map(str, heads))] + (["--tiny"] if tiny else []) + (["--target", target] if target
                                                                                   else [])
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"  # set before triton is imported: kernels run on CPU tensors
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=max(5.0, limit_s))
        run.log(f"checks output:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}")
        result = json.loads(out_json.read_text()) if out_json.is_file() else {"error": f"rc {proc.returncode}"}
    except subprocess.TimeoutExpired as e:
        run.log(f"checks: stopped at their share ({limit_s:.0f} s): {str(e.stdout or '')[-2000:]}")
        result = {"error": f"stopped at the phase's share of the budget, {limit_s:.0f} s"}
    out_json.unlink(missing_ok=True)
    return result


def scaled_recipes(kinds: list[str], scale: dict[str, Any], target: str, work: Path, prompts: str | None,
                   self_instruct: int | None, steps: int | None, vocab_size: int) -> dict[str, Any]:
    from hybridspec.speculators.train.recipe import PromptSource, load_recipe

    recipes = {}
    for kind in kinds:
        recipe = load_recipe(ROOT / "speculators" / "recipes" / f"{kind}-smollm2.yaml")
        recipe.target = target
        for key, value in scale["data"].items():
            setattr(recipe.data, key, value)
        recipe.data.sources = ([PromptSource(kind="jsonl", path=str(Path(prompts).resolve()), mode="generate")]
                               if prompts else
                               [PromptSource(kind="self_instruct", max_items=self_instruct or scale["self_instruct"])])
        for key, value in scale["training"].items():
            setattr(recipe.training, key, value)
        if steps:
            recipe.training.steps = steps
        recipe.training.max_depth = max(recipe.training.max_depth, max(recipe.training.eval_ks))
        recipe.architecture.draft_vocab_size = min(recipe.architecture.draft_vocab_size, vocab_size)
        recipe.data.cache_dir = str(work / "features")
        recipe.output.dir = str(work / "heads" / f"{kind}-smollm2")
        recipe.output.state_dir = str(work / "state" / kind)
        recipes[kind] = recipe
    return recipes


def train_one(run: Run, recipe: Any, device: Any, deadline: float, reserve_s: float) -> dict[str, Any]:
    """Train to the deadline (steps planned from the measured step time, so the cosine schedule ends there), evaluate,
    write the head. Resumes a state left by an earlier call while the machine stayed warm."""
    from hybridspec.speculators.train.trainer import Trainer

    start = time.monotonic()
    trainer = Trainer(recipe, recipe.feature_dir(), progress=False, device=device)
    plan_file = Path(recipe.output.state_dir) / "gpu_plan.json"
    if plan_file.is_file():
        recipe.training.steps = json.loads(plan_file.read_text())["steps"]
    limit = recipe.training.steps

    def plan(steps_run: int) -> dict[str, Any]:
        """Time `steps_run` steps and set the step count the rest of the share affords. The first plan's 10 steps
        carry CUDA's warm-up and a state save, so it is made again from the next fifth of the steps (the cosine
        schedule reads the count each step: moving it early barely bends the curve)."""
        t0, before = time.monotonic(), trainer.step
        result = trainer.run(max_steps=steps_run, deadline=deadline - reserve_s)
        per_step = (time.monotonic() - t0) / max(1, trainer.step - before)
        affordable = int(max(0.0, deadline - reserve_s - time.monotonic()) / max(per_step, 1e-6))
        recipe.training.steps = max(trainer.step, min(limit, trainer.step + affordable))
        plan_file.parent.mkdir(parents=True, exist_ok=True)
        plan_file.write_text(json.dumps({"steps": recipe.training.steps, "s_per_step": per_step}) + "\n")
        run.log(f"{recipe.drafter}: {per_step * 1000:.1f} ms a step, planned {recipe.training.steps} steps")
        return {**result, "s_per_step": per_step}

    if plan_file.is_file():  # a resumed run keeps its plan
        result = trainer.run(deadline=deadline - reserve_s)
        per_step = json.loads(plan_file.read_text())["s_per_step"]
    else:
        result = plan(min(10, recipe.training.steps))
        if not result.get("done"):
            result = plan(max(1, (recipe.training.steps - trainer.step) // 5))
        per_step = result["s_per_step"]
        if not result.get("done"):
            result = trainer.run(deadline=deadline - reserve_s)
    final_eval = result.get("final_eval") or trainer.evaluate()
    if not result.get("done"):
        trainer.write_output(final_eval)
    by_text = text_acceptance(trainer)
    head = Path(recipe.output_dir())  # compact: the shipped recipes' output.compact
    seconds = time.monotonic() - start
    return {"device": str(device), "steps": trainer.step, "planned_steps": recipe.training.steps,
            "ms_per_step": round(per_step * 1000, 2), "tokens_per_step": recipe.training.tokens_per_step,
            "slots_trained": trainer.slots, "train_tokens": trainer.train_tokens, "seconds": round(seconds, 1),
            "final_eval": final_eval, "heldout_by_text": by_text,
            "head_files": {p.name: p.stat().st_size for p in head.iterdir()}, "head_dir": str(head)}


TEXTS = {"chat": ("mt_bench", "humaneval"), "agent": ("agent_traces",), "self-instruct": ("self_instruct",),
         "prompts": ("jsonl",)}  # bench_drafters.py's texts (and --prompts)


def text_acceptance(trainer: Any) -> dict[str, Any]:
    """Held-out acceptance per text as bench_drafters.py splits it (chains and width-3 trees), on this run's features
    (generated in bfloat16 on the GPU: near, not equal to, the figures bench_drafters measures here)."""
    from hybridspec.speculators.train.evaluation import evaluate_acceptance, spread

    store, ks, out = trainer.heldout, trainer.recipe.training.eval_ks, {}
    for name, prefixes in TEXTS.items():
        indices = [i for i, s in enumerate(store.sources) if s.split(":")[0] in prefixes]
        if indices:
            indices = [indices[j] for j in spread(len(indices), trainer.recipe.training.eval_max_sequences)]
            r = evaluate_acceptance(trainer.drafter, store, ks, indices, slots_per_batch=256, tree_width=3)
            out[name] = {**{k: round(v, 4) for k, v in r.items() if k.startswith(("acceptance@", "tree_acceptance@"))},
                         "sequences": len(indices)}
    return out


def return_file(run: Run, path: Path) -> list[str]:
    """Move a file into the output folder, split into numbered parts when over the per-file limit."""
    if path.stat().st_size <= RETURN_LIMIT:
        if path.parent != run.out:
            shutil.move(str(path), run.out / path.name)
        return [path.name]
    data = path.read_bytes()
    manifest = write_parts(data, run.out / (path.name + ".parts"), RETURN_LIMIT, source=path.name)
    path.unlink()
    run.log(f"{path.name} is {len(data)} bytes: split into {len(manifest['parts'])} parts ({sha256(data)})")
    return [f"{path.name}.parts/{p['index']:02d}/part.bin" for p in manifest["parts"]]


def zip_head(run: Run, head: Path) -> list[str]:
    archive = run.out / f"{head.name}.zip"
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as z:
        for f in sorted(head.iterdir()):
            z.write(f, f"{head.name}/{f.name}")
    return return_file(run, archive)


# ---------------------------------------------------------------------------------------------------------------------
# the command


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out or os.environ.get("OUT") or ROOT / "out" / "gpu-run")
    run = Run(out, args.budget_s)
    scale = SCALES[args.scale]
    work = Path(args.work or ROOT / GPU_DIR / "work")
    os.environ.setdefault("HYBRIDSPEC_CACHE", str(work / "cache"))
    import torch

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    run.figures.update(device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", scale=args.scale,
                       torch=torch.__version__, command=sys.argv)
    run.log(f"gpu-run on {run.figures['device']}, budget {args.budget_s:.0f} s, scale {args.scale}, out {out}")
    target = args.target
    if target is None:
        status = run.phase("stage", lambda: stage(ROOT))
        run.figures["staging"] = status
        target = (status or {}).get("target")
        if target is None:
            run.log(f"weights not staged ({status}): carry the missing parts; the checks still run")
    if args.no_checks:
        run.figures["checks"] = {"skipped": "--no-checks"}
    else:
        share = min(scale["checks_s"], 0.25 * run.left())
        run.figures["checks"] = run.phase("checks", lambda: run_checks(run, target, args.scale == "tiny", share))
    if target is None:
        run.save()
        return 2
    torch.manual_seed(0)
    kinds = [k for k in args.drafters.split(",") if k]
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target).vocab_size
    recipes = scaled_recipes(kinds, scale, target, work, args.prompts, args.self_instruct, args.steps, vocab)
    recipe_items = run.phase("recipe-items", lambda: load_recipe_items(run, args.items, Path(target)))
    data_deadline = time.monotonic() + scale["data_share"] * (run.left() - scale["reserve_s"])
    first = recipes[kinds[0]]
    run.figures["data"] = run.phase("data", lambda: build_data(run, first, target, device, scale, data_deadline,
                                                               recipe_items))
    run.figures["training"] = {}
    outputs: list[str] = []
    for i, kind in enumerate(kinds):
        share = (run.left() - scale["reserve_s"]) / (len(kinds) - i)
        deadline = time.monotonic() + share
        result = run.phase(f"train-{kind}", lambda: train_one(run, recipes[kind], device, deadline, scale["reserve_s"]
                                                                 / len(kinds)))
        if result is None and device.type != "cpu" and deadline - time.monotonic() > 20:
            run.log(f"{kind}: training again on the CPU for what is left of its share")
            torch.set_num_threads(os.cpu_count() or 1)
            recipes[kind].output.state_dir = str(work / "state" / f"{kind}-cpu")
            result = run.phase(f"train-{kind}-cpu", lambda: train_one(run, recipes[kind], torch.device("cpu"),
                                                                      deadline, scale["reserve_s"] / len(kinds)))
        run.figures["training"][kind] = result
        if result:
            outputs += zip_head(run, Path(result["head_dir"]))
    heads = [Path(r["head_dir"]) for r in run.figures["training"].values() if r]
    if heads:
        from hybridspec.tools.gpu_checks import head_latencies

        run.figures["trained_head_latency"] = run.phase("trained-head-latency", lambda: head_latencies(
            heads, device, [16] if args.scale == "tiny" else [16, 256, 1024], 2 if args.scale == "tiny" else 20))
    files = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    run.figures["outputs"] = files
    run.figures["seconds"] = round(time.monotonic() - run.start, 1)
    run.log(f"done in {run.figures['seconds']} s; outputs {files}")
    run.save()
    big = {f: s for f, s in files.items() if s > 16 * 2**20}
    if big or len(files) > 8:
        run.log(f"WARNING: {len(files)} files, over the limit: {big}")
    return 0 if all(run.figures["training"].values()) else 1


def load_recipe_items(run: Run, option: str, target: Path) -> dict[str, list[Any]] | None:
    """The recipes' items: --items FILE, or (auto) the file staged beside the target; none with --items none."""
    path = None if option == "none" else target / ITEMS_FILE if option == "auto" else Path(option)
    if path is None or (option == "auto" and not path.is_file()):
        run.figures["recipe_items"] = {"file": None, "note": "no recipe items: the filler's own split is held out"}
        run.log("no recipe items (--items none, or none staged with the target): self-instruct / --prompts only")
        return None
    header, items = read_items(path)
    run.figures["recipe_items"] = {"file": str(path), "heldout_fraction": header["heldout_fraction"],
                                   "self_instruct": header.get("self_instruct"), "data_key": header.get("data_key"),
                                   **{split: len(rows) for split, rows in items.items()}}
    run.log(f"recipe items: {run.figures['recipe_items']}")
    return items


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("gpu-run", help="the GPU machine's work in one command (docs/GPU.md)",
                                   description=__doc__.split("\n\n")[0])
    add_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("pack", help="here: the target's weights in parts under .gpu/parts (one part a device call)")
    p.add_argument("--part-mib", type=float, default=None,
                   help="part size (default: what a device call leaves beside this checkout, less 2 MiB)")
    p.add_argument("--no-verify", action="store_true", help="skip the bit-for-bit check against the runtime's model")
    p.set_defaults(func=lambda a: _print(pack(ROOT, a.part_mib, verify=not a.no_verify)))
    p = sub.add_parser("stage", help="there: take the carried parts into .gpu/store, assemble once all are there")
    p.set_defaults(func=lambda a: _print(stage(ROOT)))
    p = sub.add_parser("run", help="stage, checks, data, training, heads and figures into $OUT / --out")
    p.add_argument("--out", default=None, help="output folder (default: $OUT, else out/gpu-run)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run (default 540)")
    p.add_argument("--scale", choices=sorted(SCALES), default="h100")
    p.add_argument("--target", default=None, help="a Hugging Face directory instead of the staged weights")
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="recipes trained (default fasteagle,peagle)")
    p.add_argument("--prompts", default=None, help="JSONL prompts ({'text': ...}) instead of self-instruct requests")
    p.add_argument("--items", default="auto",
                   help="the recipes' items (gpu_items' JSONL): auto (the one staged beside the target), FILE, none")
    p.add_argument("--self-instruct", type=int, default=None, help="cap on the target's own requests")
    p.add_argument("--steps", type=int, default=None, help="cap on training steps per drafter")
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--work", default=None, help="caches and training state (default .gpu/work)")
    p.add_argument("--no-checks", action="store_true", help="skip the kernel / cost / latency checks")
    p.set_defaults(func=run_all)


def _print(result: dict[str, Any]) -> int:
    print(json.dumps(result, indent=1))
    return 0 if result.get("complete", True) else 3


def main(argv: list[str] | None = None) -> int:
    checkout_imports()
    parser = argparse.ArgumentParser(prog="python -m hybridspec.tools.gpu_run", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
