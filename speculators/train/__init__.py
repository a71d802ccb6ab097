"""hybridspec.speculators.train: recipes, the feature cache and the training loop for P-EAGLE, EAGLE-3 and the LSTM."""
from hybridspec.speculators.train.data import FeatureStore, build_features, features_complete
from hybridspec.speculators.train.recipe import Recipe, load_recipe, recipe_from_dict
from hybridspec.speculators.train.text import load_items
from hybridspec.speculators.train.trainer import Trainer, build_drafter

__all__ = ["FeatureStore", "Recipe", "Trainer", "build_drafter", "build_features", "features_complete", "load_items",
           "load_recipe", "recipe_from_dict"]
