"""hybridspec.speculators: model drafters that read the target's hidden states (P-EAGLE, EAGLE-3, FastEagle, the
Arctic LSTM), their checkpoint formats, and (in .train) the pipeline that trains them."""
from hybridspec.speculators.drafter import Drafter
from hybridspec.speculators.eagle import EagleConfig
from hybridspec.speculators.features import TargetFeatures, TargetInfo, build_draft_vocab, default_aux_layer_ids
from hybridspec.speculators.layers import LayerConfig
from hybridspec.speculators.proposer import DrafterProposer
from hybridspec.speculators.eagle3 import Eagle3Drafter
from hybridspec.speculators.fasteagle import FastEagleDrafter
from hybridspec.speculators.formats import load_drafter, save_drafter
from hybridspec.speculators.lstm import LSTMConfig, LSTMDrafter
from hybridspec.speculators.peagle import PEagleDrafter

__all__ = ["Drafter", "DrafterProposer", "Eagle3Drafter", "EagleConfig", "FastEagleDrafter", "LSTMConfig",
           "LSTMDrafter", "LayerConfig",
           "PEagleDrafter", "TargetFeatures", "TargetInfo", "build_draft_vocab", "default_aux_layer_ids",
           "load_drafter", "save_drafter"]
