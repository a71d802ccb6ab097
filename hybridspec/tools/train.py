"""`hybridspec train RECIPE.yaml`: build (or resume) the recipe's feature cache, then train (or resume) its drafter
and write the checkpoint to the recipe's output directory.

The face of hybridspec.speculators.train: it lives in the runtime because it wires the runtime's model loading and
Engine into the training library, which imports neither."""
from __future__ import annotations

import argparse
import json
import sys

from hybridspec.speculators.train.recipe import load_recipe


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("train", help="train a drafter (P-EAGLE, EAGLE-3, LSTM) from a YAML recipe",
                                   description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", help="path of the recipe YAML")
    parser.add_argument("--data-only", action="store_true", help="build the feature cache and stop")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many more steps (the run resumes from there next time)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for generation and training (default: the recipe's training.threads)")
    parser.add_argument("--no-resume", action="store_true", help="start training from scratch")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from hybridspec.speculators.train.data import build_features, features_complete
    from hybridspec.speculators.train.trainer import Trainer

    recipe = load_recipe(args.recipe)
    if args.no_resume:
        recipe.output.resume = False
    progress = not args.no_progress and sys.stderr.isatty()
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        recipe.training.threads = args.threads
    torch.set_num_threads(recipe.training.threads)
    if not features_complete(recipe):
        # The face wires the runtime (model resolution, the engine that writes responses); the training library takes
        # them as objects.
        from hybridspec.runtime.engine import Engine
        from hybridspec.model.loading import load_model, load_tokenizer
        from hybridspec.model.target import TargetModel

        model, tokenizer = load_model(recipe.target), load_tokenizer(recipe.target)
        # packed weights and a static KV cache: faster than transformers' generate
        engine = Engine(TargetModel(model), tokenizer) if any(s.mode == "generate" for s in recipe.data.sources) \
            else None
        build_features(recipe, model, tokenizer, progress=progress, engine=engine)
    if args.data_only:
        print(f"features ready in {recipe.feature_dir()}")
        return 0
    target_layers = None
    if recipe.architecture.layers_from_target:  # the target's last num_layers decoder layers, in order
        from hybridspec.model.loading import load_model

        layers = load_model(recipe.target).model.layers
        target_layers = [layer.state_dict() for layer in layers[max(0, len(layers) - recipe.architecture.num_layers):]]
    result = Trainer(recipe, recipe.feature_dir(), progress=progress,
                     target_layers=target_layers).run(max_steps=args.max_steps)
    print(json.dumps(result, indent=1))
    return 0
