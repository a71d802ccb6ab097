"""Model drafters (P-EAGLE, EAGLE-3, FastEagle, LSTM) against a tiny random Llama target: shapes, the one-pass
property of P-EAGLE and FastEagle, inference == training computation, KV-cache bookkeeping, checkpoint formats, mismatch
errors, and a few training steps per drafter raising acceptance above chance."""
from __future__ import annotations

import json

import pytest
import torch

from hybridspec.proposal import Proposal
from hybridspec.speculators import (DrafterProposer, Eagle3Drafter, EagleConfig, FastEagleDrafter, LayerConfig,
                                    LSTMConfig, LSTMDrafter, PEagleDrafter, TargetFeatures, TargetInfo,
                                    build_draft_vocab, default_aux_layer_ids, load_drafter, save_drafter)
from hybridspec.speculators.chains import ChainLayout, full_chain_origins, sample_chain_origins
from hybridspec.speculators.drafter import chain_proposal, widen_chain

K = 5
DRAFT_VOCAB = 96


@pytest.fixture(scope="module")
def target(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def sequence(target):
    return greedy_sequence(target)


def greedy_sequence(target):
    """A greedy continuation x_0..x_{T-1} of the tiny target and its features at positions 0..T-2 (row i produced
    x_{i+1}, so tokens[1:] are the aligned next tokens)."""
    torch.manual_seed(1)
    prompt = torch.randint(3, target.config.vocab_size, (1, 12))
    with torch.no_grad():
        tokens = target.generate(prompt, max_new_tokens=28, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
        hidden = target.model(tokens[None], output_hidden_states=True).hidden_states
    features = TargetFeatures.from_hidden_states(hidden, default_aux_layer_ids(target.config.num_hidden_layers))
    return tokens, features[:-1]


def eagle_config(target, *, num_layers=2, mask=True, independent_layers=False) -> EagleConfig:
    c = target.config
    return EagleConfig(layer=LayerConfig.like_target(c), num_layers=num_layers, target_hidden_size=c.hidden_size,
                       target_vocab_size=c.vocab_size, draft_vocab_size=DRAFT_VOCAB,
                       aux_layer_ids=default_aux_layer_ids(c.num_hidden_layers),
                       mask_token_id=c.vocab_size - 1 if mask else None, num_speculative_tokens=K,
                       independent_layers=independent_layers)


EAGLE_CLASSES = {"peagle": PEagleDrafter, "eagle3": Eagle3Drafter, "fasteagle": FastEagleDrafter}
NUM_LAYERS = {"peagle": 2, "eagle3": 1, "fasteagle": K}  # FastEagle: one layer per draft position


def make_drafter(kind: str, target, seed: int = 0, independent_layers: bool = False):
    torch.manual_seed(seed)
    c = target.config
    if kind == "lstm":
        return LSTMDrafter(LSTMConfig(input_hidden_dim=c.hidden_size, dim=24, vocab_size=c.vocab_size,
                                      num_speculative_tokens=K)).eval()
    drafter = EAGLE_CLASSES[kind](eagle_config(target, num_layers=NUM_LAYERS[kind],
                                               independent_layers=independent_layers),
                                  embed_tokens=target.get_input_embeddings().weight)
    counts = torch.rand(c.vocab_size, generator=torch.Generator().manual_seed(seed))
    drafter.set_draft_vocab(*build_draft_vocab(counts, DRAFT_VOCAB))
    with torch.no_grad():  # random weights give flat logits; sharpen so argmax comparisons mean something
        drafter.lm_head.weight.mul_(20)
    return drafter.eval()


KINDS = ["peagle", "eagle3", "fasteagle", "lstm"]


# ---------------------------------------------------------------------------------------------------------------------
# features and vocabulary


def test_features_from_hidden_states_picks_layer_inputs(target, sequence):
    tokens, features = sequence
    ids = default_aux_layer_ids(target.config.num_hidden_layers)
    assert ids == (2, 3, 3)
    captured = {}
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw, i=i: captured.__setitem__(i, kw.get("hidden_states",
                                                                                                 a[0] if a else None)),
                                             with_kwargs=True)
             for i, layer in enumerate(target.model.layers)]
    with torch.no_grad():
        final = target.model(tokens[None]).last_hidden_state[0]
    for h in hooks:
        h.remove()
    h = target.config.hidden_size
    for slot, layer_id in enumerate(ids):
        torch.testing.assert_close(features.aux[:, slot * h:(slot + 1) * h], captured[layer_id][0, :-1])
    torch.testing.assert_close(features.final, final[:-1])
    with pytest.raises(ValueError, match="outside the target"):
        TargetFeatures.from_hidden_states([torch.zeros(3, h)] * 4, (1, 2, 3))
    with pytest.raises(ValueError, match="same n"):
        TargetFeatures(torch.zeros(3, 6), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="at least 4 layers"):
        default_aux_layer_ids(3)


def test_draft_vocab_keeps_most_frequent_tokens_as_offsets():
    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 3])
    d2t, t2d = build_draft_vocab(counts, 4)
    target_ids = torch.arange(4) + d2t
    assert target_ids.tolist() == [0, 2, 3, 5]  # the 4 most frequent, ordered by target id
    assert t2d.nonzero().flatten().tolist() == [0, 2, 3, 5]
    # ties broken by the lower target id, deterministically
    assert (torch.arange(2) + build_draft_vocab(torch.ones(8), 2)[0]).tolist() == [0, 1]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(counts, 9)


# ---------------------------------------------------------------------------------------------------------------------
# proposals


@pytest.mark.parametrize("kind", KINDS)
def test_proposal_shapes(kind, target, sequence):
    tokens, features = sequence
    drafter = make_drafter(kind, target)
    state = drafter.begin(features, tokens[1:])
    proposal = drafter.propose(state, K)
    assert isinstance(proposal, Proposal) and proposal.source == kind
    assert len(proposal) == K and proposal.parents == [-1, 0, 1, 2, 3] and proposal.is_chain
    assert proposal.draft_logits.shape == (K, target.config.vocab_size)
    assert all(0 <= t < target.config.vocab_size for t in proposal.token_ids)
    # greedy: each token is the argmax of its logits; probs are cumulative and the score their sum
    assert proposal.token_ids == proposal.draft_logits.argmax(-1).tolist()
    assert all(a >= b for a, b in zip(proposal.probs, proposal.probs[1:]))
    assert proposal.score == pytest.approx(sum(proposal.probs))
    if kind != "lstm":  # tokens outside the draft vocabulary can never be proposed
        outside = ~drafter.t2d
        assert torch.isinf(proposal.draft_logits[:, outside]).all()
        assert all(drafter.t2d[t] for t in proposal.token_ids)


def count_layer_calls(drafter):
    calls = []
    hook = drafter.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: calls.append(a[0].shape[0]))
    return calls, hook


def test_peagle_drafts_k_tokens_in_one_forward_pass(target, sequence):
    tokens, features = sequence
    drafter = make_drafter("peagle", target)
    state = drafter.begin(features, tokens[1:])
    calls, hook = count_layer_calls(drafter)
    drafter.propose(state, 7)
    assert calls == [len(features) + 6]  # one pass: every pending real slot plus K-1 mask slots
    calls.clear()
    drafter.accept(state, features[-3:], [5, 6, 7])
    drafter.propose(state, 7)
    assert calls == [3 + 6]              # later passes: only the new real slots
    assert len(state.kv) == len(features) + 3  # mask slots never stay in the cache
    hook.remove()


@pytest.mark.parametrize("independent_layers", [False, True])
def test_fasteagle_drafts_one_token_per_layer_from_one_pass_over_the_real_slots(target, sequence, independent_layers):
    tokens, features = sequence
    drafter = make_drafter("fasteagle", target, independent_layers=independent_layers)
    inputs = [layer.self_attn.q_proj.in_features for layer in drafter.layers]
    hidden = target.config.hidden_size
    # the cascade: only layer 0 reads the fused features and the token (2H); without it every layer does
    assert inputs == [2 * hidden] * K if independent_layers else [2 * hidden] + [hidden] * (K - 1)
    state = drafter.begin(features, tokens[1:])
    calls, hook = count_layer_calls(drafter)
    assert len(drafter.propose(state, K + 3)) == K  # at most one draft per layer
    assert calls == [len(features)]                 # the real slots only: no mask or draft slots
    calls.clear()
    drafter.accept(state, features[-3:], [5, 6, 7])
    proposal = drafter.propose(state, 2)
    drafter.propose(state, K)
    assert calls == [3] and len(state.kv) == len(features) + 3
    hook.remove()
    # draft j is layer j's output at the last real slot
    full = drafter.propose(state, K)
    assert full.token_ids[:2] == proposal.token_ids
    layer_out = drafter.full_vocab_logits(drafter.lm_head(drafter.norm(state.last_hidden)))
    torch.testing.assert_close(full.draft_logits, layer_out.float())


def test_eagle3_drafts_with_k_sequential_passes(target, sequence):
    tokens, features = sequence
    drafter = make_drafter("eagle3", target)
    state = drafter.begin(features, tokens[1:])
    calls, hook = count_layer_calls(drafter)
    drafter.propose(state, 7)
    hook.remove()
    assert calls == [len(features)] + [1] * 6
    assert len(state.kv) == len(features)  # draft slots are dropped after proposing


@pytest.mark.parametrize("kind", KINDS)
def test_inference_matches_training_computation(kind, target, sequence):
    """Proposals from the KV-cached inference path equal the chains of the training forward (all chains at once)."""
    tokens, features = sequence
    drafter = make_drafter(kind, target)
    next_tokens = tokens[1:].clone()
    n = len(next_tokens)
    for origin in (4, 15):
        proposal = drafter.propose(drafter.begin(features[: origin + 1], next_tokens[: origin + 1]), K)
        # Teacher forcing with the drafted tokens reproduces the autoregressive drafters' chains.
        chain_tokens = next_tokens.clone()
        chain_tokens[origin + 1: origin + K] = torch.tensor(proposal.token_ids[: K - 1])
        layout = ChainLayout(seq_id=torch.zeros(n, dtype=torch.long), positions=torch.arange(n),
                             origins=full_chain_origins(torch.clamp(n - 1 - torch.arange(n), max=K - 1), K))
        with torch.no_grad():
            inputs = features.final[:n] if kind == "lstm" else features.aux[:n]
            logits = drafter.chain_logits(inputs, chain_tokens, layout)
        rows = torch.stack([logits[d][layout.rank_in_depth[d][origin]] for d in range(K)])
        expected = rows if kind == "lstm" else drafter.full_vocab_logits(rows)
        torch.testing.assert_close(proposal.draft_logits, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_accepts_equal_a_fresh_start(kind, target, sequence):
    tokens, features = sequence
    drafter = make_drafter(kind, target)
    next_tokens = tokens[1:]
    fresh = drafter.propose(drafter.begin(features, next_tokens), K)
    state = drafter.begin(features[:10], next_tokens[:10])
    first = drafter.propose(state, K)
    assert drafter.propose(state, K).token_ids == first.token_ids  # proposing again changes nothing
    for start, end in ((10, 11), (11, 19), (19, len(features))):
        drafter.accept(state, features[start:end], next_tokens[start:end])
        drafter.propose(state, 3)
    again = drafter.propose(state, K)
    assert again.token_ids == fresh.token_ids
    torch.testing.assert_close(again.draft_logits, fresh.draft_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_sampling_draws_from_the_given_distribution(kind, target, sequence):
    tokens, features = sequence
    drafter = make_drafter(kind, target)
    state = drafter.begin(features, tokens[1:])
    forced = int(drafter.propose(state, 1).token_ids[0])

    def one_hot(logits):  # a processing that keeps only one token
        p = torch.zeros_like(logits)
        p[forced] = 1.0
        return p

    proposal = drafter.propose(state, 4, probs_fn=one_hot)
    assert proposal.token_ids == [forced] * 4 and proposal.probs == [1.0] * 4
    soft = lambda logits: torch.softmax(logits / 2.0, dim=-1)  # noqa: E731
    a = drafter.propose(state, 4, soft, torch.Generator().manual_seed(3))
    b = drafter.propose(state, 4, soft, torch.Generator().manual_seed(3))
    assert a.token_ids == b.token_ids


def test_errors_on_misaligned_input(target, sequence):
    tokens, features = sequence
    for kind in KINDS:
        drafter = make_drafter(kind, target)
        with pytest.raises(ValueError, match="one token per row"):
            drafter.begin(features, tokens[1:4])
        with pytest.raises(RuntimeError, match="begin"):
            drafter.propose(drafter.new_state(), 3)
    with pytest.raises(ValueError, match="mask_token_id"):
        PEagleDrafter(eagle_config(target, mask=False))
    with pytest.raises(ValueError, match="target embedding"):
        PEagleDrafter(eagle_config(target), embed_tokens=torch.zeros(5, target.config.hidden_size))


def test_drafter_proposer_keeps_state_in_step_with_accepted_tokens(target):
    """Greedy speculative decoding driven through DrafterProposer exactly as an engine would: the output equals plain
    greedy decoding and after every step the drafter proposes what a fresh drafter over the same prefix proposes."""
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    prompt = torch.randint(3, target.config.vocab_size, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        reference = target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(prompt):].tolist()

    def forward(ids):
        with torch.no_grad():
            out = target(torch.tensor([ids]), output_hidden_states=True)
        return out.logits[0], TargetFeatures.from_hidden_states(out.hidden_states, aux_ids)

    for kind in KINDS:
        drafter = make_drafter(kind, target)
        proposer = DrafterProposer(drafter, num_speculative_tokens=4)
        logits, feats = forward(prompt)
        sequence = prompt + [int(logits[-1].argmax())]
        proposer.start_request("r", sequence, features=feats)
        steps = 0
        while len(sequence) - len(prompt) < 24:
            proposal = proposer.speculate("r")
            assert len(proposal) == 4
            logits, feats = forward(sequence + proposal.token_ids)
            base = len(sequence) - 1  # position of the last committed token
            accepted = 0
            while accepted < len(proposal) and proposal.token_ids[accepted] == int(logits[base + accepted].argmax()):
                accepted += 1
            new_tokens = proposal.token_ids[:accepted] + [int(logits[base + accepted].argmax())]
            proposer.append("r", new_tokens, features=feats[base: base + accepted + 1])
            sequence += new_tokens
            steps += 1
            fresh = make_drafter(kind, target)
            _, full = forward(sequence[:-1])
            fresh_proposal = fresh.propose(fresh.begin(full, sequence[1:]), 4)
            assert proposer.speculate("r").token_ids == fresh_proposal.token_ids
        proposer.finish_request("r")
        assert sequence[len(prompt):len(prompt) + 24] == reference
        assert proposer.live == {} and list(proposer.retained) == ["r"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_lazy_drafter_drafts_what_an_eager_one_drafts(kind, target):
    """Greedy decoding drives two proposers of one drafter with the same committed tokens and features: the eager one
    drafts every step, the lazy one every third step only. The drafter runs only when asked to draft, over every
    position it skipped in one pass; with a window covering the sequence, its drafts are the eager one's."""
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)

    def forward(ids):
        with torch.no_grad():
            out = target(torch.tensor([ids]), output_hidden_states=True)
        return out.logits[0], TargetFeatures.from_hidden_states(out.hidden_states, aux_ids)

    drafter = make_drafter(kind, target)
    eager = DrafterProposer(drafter, num_speculative_tokens=4)
    lazy = DrafterProposer(drafter, num_speculative_tokens=4, drafter_context=1000)
    prompt = torch.randint(3, target.config.vocab_size, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    logits, feats = forward(prompt)
    sequence = prompt + [int(logits[-1].argmax())]
    for proposer in (eager, lazy):
        proposer.start_request("r", sequence, features=feats)
    compared, skipped = 0, len(prompt)
    for step in range(12):
        draft = eager.speculate("r").token_ids
        if step % 3 == 0:
            assert lazy.pending("r") == skipped
            assert lazy.speculate("r").token_ids == draft
            assert lazy.pending("r") == 0
            compared, skipped = compared + 1, 0
        logits, feats = forward(sequence + draft)
        base, accepted = len(sequence) - 1, 0
        while accepted < len(draft) and draft[accepted] == int(logits[base + accepted].argmax()):
            accepted += 1
        new_tokens = draft[:accepted] + [int(logits[base + accepted].argmax())]
        for proposer in (eager, lazy):
            proposer.append("r", new_tokens, features=feats[base: base + accepted + 1])
        skipped += len(new_tokens)
        sequence += new_tokens
    assert compared == 4


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_features_given_late_draft_what_features_given_at_start_draft(kind, target, sequence):
    """start_request(features=None) then prompt_features(F) (the engine runs a prompt with its first step) is
    start_request(features=F): nothing is drafted before F comes, and the same drafts after it, extends included."""
    tokens, features = sequence
    drafter = make_drafter(kind, target)
    early, late = DrafterProposer(drafter, num_speculative_tokens=3), DrafterProposer(drafter, num_speculative_tokens=3)
    early.start_request("a", tokens[:8].tolist(), features=features[:7])
    late.start_request("a", tokens[:8].tolist(), features=None)
    assert len(late.speculate("a")) == 0 and late.pending("a") == 0 and late.context_length("a") == 8
    with pytest.raises(ValueError, match="prompt_features"):
        late.append("a", [int(tokens[8])], features=features[7:8])
    late.prompt_features("a", features[:7])
    with pytest.raises(ValueError, match="already has"):
        late.prompt_features("a", features[:7])
    for proposer in (early, late):
        assert len(proposer.speculate("a")) == 3  # the drafter has run: a state "b" can continue
        proposer.append("a", tokens[8:10].tolist(), features=features[7:9])
        proposer.finish_request("a")
        proposer.start_request("b", tokens[:14].tolist(), features=None if proposer is late else features[9:13],
                               extends="a")
    late.prompt_features("b", features[9:13])  # continues "a": the positions after the ones it had
    assert late.live["b"].state is not None and early.live["b"].state is not None  # the drafter state of "a"
    assert late.speculate("b").token_ids == early.speculate("b").token_ids
    assert late.live["b"].length == early.live["b"].length == 14


@pytest.mark.parametrize("kind", KINDS)
def test_a_drafter_that_skipped_more_than_its_window_restarts_from_the_window(kind, target, sequence):
    """Past `window` skipped positions the drafter starts afresh from the last `window`: it drafts what a drafter
    begun on those positions drafts."""
    tokens, features = sequence
    drafter = make_drafter(kind, target)
    proposer = DrafterProposer(drafter, num_speculative_tokens=3, drafter_context=6)
    proposer.start_request("w", tokens[:5].tolist(), features=features[:4])
    proposer.speculate("w")
    for i in range(4, 14):  # ten positions, none drafted from
        proposer.append("w", [int(tokens[i + 1])], features=features[i:i + 1])
    assert proposer.pending("w") == 6
    expected = drafter.propose(drafter.begin(features[8:14], tokens[9:15]), 3)
    assert proposer.speculate("w").token_ids == expected.token_ids and proposer.pending("w") == 0


# ---------------------------------------------------------------------------------------------------------------------
# formats


@pytest.mark.parametrize("kind", [*KINDS, "fasteagle-independent"])
def test_checkpoint_round_trip_gives_identical_proposals(kind, target, sequence, tmp_path):
    tokens, features = sequence
    drafter = make_drafter(kind.split("-")[0], target, independent_layers=kind.endswith("independent"))
    if kind == "peagle":
        with torch.no_grad():
            drafter.mask_hidden.normal_()
    save_drafter(drafter, tmp_path / kind, verifier_name_or_path="tiny")
    loaded = load_drafter(tmp_path / kind, target=target.config, embed_tokens=target.get_input_embeddings().weight)
    assert type(loaded) is type(drafter)
    for name, tensor in drafter.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    for k in (1, K):
        a = drafter.propose(drafter.begin(features, tokens[1:]), k)
        b = loaded.propose(loaded.begin(features, tokens[1:]), k)
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.draft_logits, b.draft_logits, rtol=0, atol=0)
    # bfloat16 halves the file and still loads
    save_drafter(drafter, tmp_path / "bf16", dtype=torch.bfloat16)
    size = {name: (tmp_path / name / "model.safetensors").stat().st_size for name in (kind, "bf16")}
    assert size["bf16"] < 0.6 * size[kind]
    load_drafter(tmp_path / "bf16", target=target.config, embed_tokens=target.get_input_embeddings().weight)


def test_speculators_config_has_the_keys_vllm_reads(target, tmp_path):
    from safetensors import safe_open
    from transformers import LlamaConfig

    for kind in ("peagle", "eagle3", "fasteagle"):
        save_drafter(make_drafter(kind, target), tmp_path / kind, verifier_name_or_path="tiny")
        config = json.loads((tmp_path / kind / "config.json").read_text())
        assert config["speculators_model_type"] == kind
        assert config["draft_vocab_size"] == DRAFT_VOCAB
        assert config["target_hidden_size"] == target.config.hidden_size
        assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 3]
        assert config["norm_before_residual"] is False  # explicit: vLLM defaults it to True for eagle3
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
        assert config["speculators_config"]["verifier"]["name_or_path"] == "tiny"
        assert ("mask_token_id" in config) == (kind == "peagle")
        assert config.get("independent_layers") is (False if kind == "fasteagle" else None)
        layer = LlamaConfig(**config["transformer_layer_config"])  # what vLLM builds the draft model config from
        assert layer.vocab_size == target.config.vocab_size
        assert layer.num_hidden_layers == NUM_LAYERS[kind]
        with safe_open(str(tmp_path / kind / "model.safetensors"), "pt") as f:
            names = set(f.keys())
        assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "layers.0.self_attn.q_proj.weight",
                "layers.0.hidden_norm.weight", "layers.0.input_layernorm.weight",
                "layers.0.mlp.down_proj.weight"} <= names
        assert ("mask_hidden" in names) == (kind == "peagle")
        assert not any(n.startswith("embed_tokens") for n in names)  # shared with the target
        with safe_open(str(tmp_path / kind / "model.safetensors"), "pt") as f:
            assert f.get_tensor("layers.0.self_attn.q_proj.weight").shape[1] == 2 * target.config.hidden_size
            if kind == "peagle":
                assert f.get_tensor("mask_hidden").shape == (1, 3 * target.config.hidden_size)
                assert f.get_tensor("layers.1.self_attn.q_proj.weight").shape[1] == target.config.hidden_size
            assert f.get_tensor("t2d").dtype == torch.bool and f.get_tensor("d2t").dtype == torch.int64


def test_arctic_lstm_config_and_weight_names(target, tmp_path):
    from safetensors import safe_open

    save_drafter(make_drafter("lstm", target), tmp_path / "lstm")
    config = json.loads((tmp_path / "lstm" / "config.json").read_text())
    assert config["model_type"] == "mlp_speculator" and config["method"] == "sum_lstm"
    assert config["tie_weights"] and config["tie_lstm_embs"]
    assert (config["inner_dim"], config["emb_dim"], config["proj_dim"]) == ("24", "24", "24")
    assert config["input_hidden_dim"] == target.config.hidden_size and config["n_predict"] == K
    with safe_open(str(tmp_path / "lstm" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {"forget_emb.0.weight", "projs.0.weight", "projs.1.weight", "cell_ln.0.weight",
                                 "cell_ln.0.bias", "state_ln.0.weight", "state_ln.0.bias", "head.0.weight"}
        assert f.get_tensor("projs.0.weight").shape == (4 * 24, target.config.hidden_size)


@pytest.mark.parametrize("kind", KINDS)
def test_loading_against_a_mismatched_target_fails_clearly(kind, target, tmp_path):
    save_drafter(make_drafter(kind, target), tmp_path / kind)
    embed = target.get_input_embeddings().weight
    c = target.config
    with pytest.raises(ValueError, match="vocabulary"):
        load_drafter(tmp_path / kind, target=TargetInfo(c.num_hidden_layers, c.hidden_size, c.vocab_size + 1),
                     embed_tokens=embed)
    with pytest.raises(ValueError, match="hidden size"):
        load_drafter(tmp_path / kind, target=TargetInfo(c.num_hidden_layers, c.hidden_size * 2, c.vocab_size),
                     embed_tokens=embed)
    if kind != "lstm":
        with pytest.raises(ValueError, match="layers"):  # trained on layer 3 of a 6-layer target; this one has 3
            load_drafter(tmp_path / kind, target=TargetInfo(3, c.hidden_size, c.vocab_size), embed_tokens=embed)
        with pytest.raises(ValueError, match=r"captures layers \[1, 2, 3\]"):
            load_drafter(tmp_path / kind, target=c, embed_tokens=embed, aux_layer_ids=[1, 2, 3])
        with pytest.raises(ValueError, match=r"captures layers \[1, 2, 3\]"):
            load_drafter(tmp_path / kind, embed_tokens=embed, aux_layer_ids=[1, 2, 3])
        with pytest.raises(ValueError, match="embed_tokens"):
            load_drafter(tmp_path / kind, target=c)
    else:  # the LSTM reads no aux layers: whatever the runtime captures is fine
        load_drafter(tmp_path / kind, aux_layer_ids=[1, 2, 3])
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "nothing")


# ---------------------------------------------------------------------------------------------------------------------
# chain sampling


def test_chain_sampling_keeps_complete_chains_per_depth():
    valid = torch.clamp(torch.arange(999, -1, -1), max=7)  # 1000 slots; chains near the end are short
    origins = sample_chain_origins(valid, 8, 0.7, 0.2, torch.Generator().manual_seed(0))
    assert origins[0].tolist() == list(range(1000))
    for d in range(1, 8):
        assert len(origins[d]) == min(round(1000 * max(0.7 ** d, 0.2)), int((valid >= d).sum()))
        assert set(origins[d].tolist()) <= set(origins[d - 1].tolist())  # nested: every chain is complete
        assert bool((valid[origins[d]] >= d).all())


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_proposer_accepts_a_window_of_the_prompt(kind, target, sequence):
    """An engine may hand over features of the prompt's last positions only: the drafter then drafts from that window
    (its positions are relative), exactly as a drafter begun on the same window."""
    tokens, features = sequence
    prompt, next_token = tokens[:-1].tolist(), int(tokens[-1])
    drafter = make_drafter(kind, target)
    proposer = DrafterProposer(drafter, num_speculative_tokens=3)
    proposer.start_request("w", prompt + [next_token], features=features[-8:])
    expected = drafter.propose(drafter.begin(features[-8:], tokens[-8:]), 3)
    assert proposer.speculate("w").token_ids == expected.token_ids
    assert proposer.speculate("w", num_speculative_tokens=0).token_ids == []
    assert len(proposer.speculate("w", num_speculative_tokens=2)) == 2


def test_chains_can_start_from_a_subset_of_slots(target, sequence):
    """The LSTM reads no context, so its training chains may start from some slots only: same logits per chain."""
    tokens, features = sequence
    drafter = make_drafter("lstm", target)
    n = len(features)
    valid = torch.clamp(n - 1 - torch.arange(n), max=K - 1)
    seq, pos = torch.zeros(n, dtype=torch.long), torch.arange(n)
    first = torch.tensor([3, 7, 20, n - 2])
    full = ChainLayout(seq, pos, full_chain_origins(valid, K))
    part = ChainLayout(seq, pos, full_chain_origins(valid, K, first))
    assert part.origins[1].tolist() == [3, 7, 20, n - 2] and part.origins[2].tolist() == [3, 7, 20]
    sampled = sample_chain_origins(valid, K, 0.7, 0.2, torch.Generator().manual_seed(1), first)
    assert sampled[0] is first and set(sampled[1].tolist()) <= set(first.tolist())
    with torch.no_grad():
        a = drafter.chain_logits(features.final, tokens[1:], full)
        b = drafter.chain_logits(features.final, tokens[1:], part)
    for d in range(K):
        torch.testing.assert_close(b[d], a[d][full.rank_in_depth[d][part.origins[d]]])


def test_widen_chain_adds_runner_ups_as_siblings_by_path_probability():
    # depth 0: 5 (0.6) then 2 (0.3); depth 1: 7 (0.5) then 1 (0.4); depth 2: 4 (0.9)
    probs = torch.tensor([[0.0, 0.05, 0.3, 0.0, 0.0, 0.6, 0.05, 0.0],
                          [0.0, 0.4, 0.05, 0.0, 0.0, 0.0, 0.05, 0.5],
                          [0.0, 0.02, 0.0, 0.0, 0.9, 0.0, 0.08, 0.0]])
    chain = chain_proposal([5, 7, 4], [0.6, 0.5, 0.9], probs.log(), "peagle")
    tree = widen_chain(chain, width=2, max_nodes=10)
    # chain 5 (.6) -> 7 (.3) -> 4 (.27); siblings 2 (.3) at depth 0, 1 (.6 * .4 = .24) under 5, 6 (.3 * .08) under 7
    nodes = {(t, tree.token_ids[p] if p >= 0 else None): pr for t, p, pr in zip(tree.token_ids, tree.parents,
                                                                                    tree.probs)}
    assert nodes.keys() == {(5, None), (2, None), (7, 5), (1, 5), (4, 7), (6, 7)}
    for key, want in {(5, None): .6, (2, None): .3, (7, 5): .3, (1, 5): .24, (4, 7): .27, (6, 7): .024}.items():
        assert nodes[key] == pytest.approx(want, rel=1e-5)
    assert all(p < i for i, p in enumerate(tree.parents)) and tree.draft_logits is None
    assert tree.score == pytest.approx(sum(tree.probs))
    # a budget keeps the most probable nodes, parents included
    small = widen_chain(chain, width=2, max_nodes=4)  # .6, .3, .3, .27: the chain and the root's sibling
    assert sorted(small.token_ids) == [2, 4, 5, 7]
    assert [small.token_ids[p] if p >= 0 else None for p in small.parents] == [None, None, 5, 7]
    assert widen_chain(chain, width=1, max_nodes=10).token_ids == [5, 7, 4]  # width 1: the chain itself
    assert len(widen_chain(Proposal.empty("peagle"), 3, 5)) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_drafter_proposer_drafts_trees_around_its_greedy_chain(kind, target, sequence):
    tokens, feats = sequence
    proposer = DrafterProposer(make_drafter(kind, target), tree_width=3)
    proposer.start_request("r", tokens.tolist(), features=feats)
    chain = proposer.speculate("r", num_speculative_tokens=3)
    tree = proposer.speculate("r", num_speculative_tokens=6, tree=True)
    assert len(tree) == 6 and not tree.is_chain and tree.source == kind
    # the tree holds the greedy chain's first token at the root and the chain's prefix under it
    path, parent = [], -1
    for token in chain.token_ids:
        match = [i for i, (t, p) in enumerate(zip(tree.token_ids, tree.parents)) if t == token and p == parent]
        if not match:
            break
        parent = match[0]
        path.append(token)
    assert path and path == chain.token_ids[:len(path)]
    roots = [t for t, p in zip(tree.token_ids, tree.parents) if p == -1]
    assert len(roots) <= 3 and len(set(roots)) == len(roots)  # at most tree_width distinct first tokens
    with pytest.raises(ValueError, match="tree_width"):
        DrafterProposer(make_drafter(kind, target), tree_width=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_drafting_several_requests_in_one_pass_drafts_what_each_drafts_alone(kind, target, tree):
    """speculate_many (the drafter's catch-ups and drafts for several requests in one pass) drafts what speculate
    drafts for each request alone, requests with different pending positions, budgets and a finished one's restart
    included."""
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)
    gen = torch.Generator().manual_seed(8)

    def started(proposer):
        for r, n in enumerate((7, 12, 4)):
            tokens = torch.randint(3, target.config.vocab_size, (n,), generator=torch.Generator().manual_seed(r))
            with torch.no_grad():
                hidden = target(tokens[None], output_hidden_states=True).hidden_states
            proposer.start_request(r, tokens.tolist(), features=TargetFeatures.from_hidden_states(hidden, aux_ids)[:-1])
        return proposer

    drafter = make_drafter(kind, target)
    together, alone = started(DrafterProposer(drafter)), started(DrafterProposer(drafter))
    for step, budgets in enumerate(([4, 2, 3], [3, 0, 4], [1, 4, 2])):
        many = together.speculate_many([0, 1, 2], budgets, tree=tree)
        each = [alone.speculate(r, k, tree=tree) for r, k in enumerate(budgets)]
        for a, b in zip(many, each):
            assert a.token_ids == b.token_ids and a.parents == b.parents
            assert a.drafter_ran == b.drafter_ran == bool(len(b))
            if len(b):
                torch.testing.assert_close(torch.tensor(a.probs), torch.tensor(b.probs), atol=1e-4, rtol=1e-3)
        width = len(aux_ids) * target.config.hidden_size
        for r in (0, 1, 2):  # every request commits 1 + step tokens: pending positions differ from row to row
            n = 1 + (r + step) % 3
            feats = TargetFeatures(torch.randn(n, width, generator=gen), torch.randn(n, target.config.hidden_size,
                                                                                       generator=gen))
            new = torch.randint(3, target.config.vocab_size, (n,), generator=gen).tolist()
            together.append(r, new, features=feats)
            alone.append(r, new, features=feats)
