"""The training pipeline: recipes, prompt sources and the held-out split, the resumable feature cache, batch
alignment, a few training steps per drafter (loss falls, acceptance rises above chance), resumption, the CLI."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from hybridspec.speculators import (DrafterProposer, TargetFeatures, TargetInfo, default_aux_layer_ids,
                                    load_drafter)
from hybridspec.tools.testing import tiny_llama
from hybridspec.speculators.train import (FeatureStore, Trainer, build_features, features_complete, load_items,
                                          load_recipe, recipe_from_dict)
from hybridspec.speculators.train import data as data_module
from hybridspec.speculators.train import text as text_module
from hybridspec.speculators.train.batches import make_batch
from hybridspec.speculators.train.evaluation import spread, walk_acceptance

WORKLOADS = Path(__file__).resolve().parents[1].parent / "shared" / "workloads"
RECIPES = Path(__file__).resolve().parents[1] / "speculators" / "recipes"


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory) -> Path:
    """A small jsonl prompt set (the real MT-Bench file when present, else synthetic questions)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    if (WORKLOADS / "mt_bench_questions.jsonl").exists():
        lines = (WORKLOADS / "mt_bench_questions.jsonl").read_text().splitlines()
        rows = [json.loads(line)["turns"][0] for line in lines]
    else:
        rows = [f"Question {i}: how would you explain topic {i * 7 % 13} to a child?" for i in range(40)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return path


def tiny_recipe(drafter: str, root: Path, chat_file: Path, architecture: dict | None = None, **training) -> dict:
    return {
        "drafter": drafter, "target": "tiny",
        "data": {"sources": [{"kind": "jsonl", "path": str(chat_file), "max_items": 24}], "heldout_fraction": 0.25,
                 "max_prompt_tokens": 24, "max_new_tokens": 40, "shard_size": 6, "generation_batch_size": 6,
                 "cache_dir": str(root / "features")},
        "architecture": {"num_layers": 7 if drafter == "fasteagle" else 1, "draft_vocab_size": 96,
                         "mask_token_id": 127, "dim": 32, "num_speculative_tokens": 7, **(architecture or {})},
        "training": {"steps": 40, "tokens_per_step": 192, "lr": 3e-3, "warmup_steps": 4, "eval_every": 0,
                     "save_every": 10, **training},
        "output": {"dir": str(root / f"out-{drafter}"), "state_dir": str(root / f"state-{drafter}"),
                   "dtype": "float32"},
    }


@pytest.fixture(scope="module")
def target():
    """A tiny random target whose greedy text mixes repeats and short loops with fresh tokens: structure a drafter can
    learn in a few dozen steps (the shared tiny_model's text is too varied for that)."""
    return tiny_llama(init_std=0.1)


@pytest.fixture(scope="module")
def engine(target, tiny_tokenizer):
    """The runtime's engine over the target: what writes the target's responses (the training library takes it)."""
    from hybridspec.runtime.engine import Engine
    from hybridspec.model.target import TargetModel

    return Engine(TargetModel(target), tiny_tokenizer)


@pytest.fixture(scope="module")
def features(tmp_path_factory, target, tiny_tokenizer, chat_file, engine) -> Path:
    root = tmp_path_factory.mktemp("train")
    recipe = recipe_from_dict(tiny_recipe("peagle", root, chat_file))
    build_features(recipe, target, tiny_tokenizer, progress=False, engine=engine)
    return root


# ---------------------------------------------------------------------------------------------------------------------
# recipes


def test_shipped_recipes_load():
    names = {p.stem: load_recipe(p) for p in RECIPES.glob("*.yaml")}
    assert {r.drafter for r in names.values()} == {"peagle", "eagle3", "lstm", "fasteagle"}
    for recipe in names.values():
        assert recipe.target == "smollm2" and recipe.data.sources
        assert recipe.output_dir().is_relative_to(RECIPES.parent)
    # the drafters share one feature cache, so they are trained on the same data; P-EAGLE, EAGLE-3 and FastEagle on
    # the same budget too, so they can be compared
    assert len({r.feature_dir() for r in names.values()}) == 1
    steps = {names[f"{kind}-smollm2"].training.steps for kind in ("peagle", "eagle3", "fasteagle")}
    assert len(steps) == 1


def test_fasteagle_ablation_recipes_change_one_setting_each():
    """The paper's ablations and the data levers: each recipe differs from the base one in one setting, on the same
    budget (and, but for a data lever, the same data)."""
    ablations = {p.stem: load_recipe(p) for p in (RECIPES / "ablations").glob("fasteagle-*.yaml")}
    base = dataclasses.asdict(ablations.pop("fasteagle-base"))
    shipped = load_recipe(RECIPES / "fasteagle-smollm2.yaml")
    assert base["architecture"] == dataclasses.asdict(shipped.architecture)
    changed = {"fasteagle-no-cascade": ("architecture", "independent_layers"),
               "fasteagle-no-feature-loss": ("training", "feature_weight"),
               "fasteagle-data-25": ("training", "train_fraction"), "fasteagle-data-50": ("training", "train_fraction"),
               "fasteagle-layers-from-target": ("architecture", "layers_from_target"),
               "fasteagle-vocab-8192": ("architecture", "draft_vocab_size"),
               "fasteagle-agent-text": ("data", "sources")}
    assert set(ablations) == set(changed)
    for name, recipe in ablations.items():
        assert (recipe.feature_dir() == shipped.feature_dir()) == (changed[name][0] != "data")
        other = dataclasses.asdict(recipe)
        section, key = changed[name]
        assert other[section][key] != base[section][key]
        other[section][key] = base[section][key]
        assert {k: v for k, v in other.items() if k not in ("output", "base_dir")} == \
            {k: v for k, v in base.items() if k not in ("output", "base_dir")}


def test_recipe_errors(tmp_path):
    with pytest.raises(ValueError, match="drafter"):
        recipe_from_dict({"drafter": "medusa"})
    with pytest.raises(ValueError, match="unknown key"):
        recipe_from_dict({"drafter": "peagle", "training": {"stpes": 3}})
    with pytest.raises(ValueError, match="unknown top-level"):
        recipe_from_dict({"drafter": "peagle", "optimizer": {}})
    with pytest.raises(ValueError, match="architecture.num_speculative_tokens"):  # the old name of the key
        recipe_from_dict({"drafter": "lstm", "architecture": {"n_predict": 7}})
    with pytest.raises(ValueError, match="bad data source"):
        recipe_from_dict({"drafter": "lstm", "data": {"sources": [{"kind": "web", "path": "x"}]}})
    with pytest.raises(ValueError, match="needs a path"):
        recipe_from_dict({"drafter": "lstm", "data": {"sources": [{"kind": "jsonl"}]}})
    with pytest.raises(ValueError, match="self_instruct needs"):
        recipe_from_dict({"drafter": "lstm", "data": {"sources": [{"kind": "self_instruct"}]}})
    with pytest.raises(ValueError, match="heldout_fraction"):
        recipe_from_dict({"drafter": "lstm", "data": {"heldout_fraction": 0}})
    with pytest.raises(ValueError, match="max_depth"):
        recipe_from_dict({"drafter": "lstm", "training": {"max_depth": 3, "eval_ks": [3, 5]}})
    with pytest.raises(ValueError, match="max_prompt_slots"):
        recipe_from_dict({"drafter": "peagle", "training": {"max_prompt_slots": -1}})
    with pytest.raises(ValueError, match="depth_weights"):
        recipe_from_dict({"drafter": "peagle", "training": {"depth_weights": [1.0, 0.5]}})
    with pytest.raises(ValueError, match="feature_weight"):
        recipe_from_dict({"drafter": "peagle", "training": {"feature_weight": 0.1}})
    with pytest.raises(ValueError, match="independent_layers"):
        recipe_from_dict({"drafter": "eagle3", "architecture": {"independent_layers": True}})
    with pytest.raises(ValueError, match="one token per layer"):
        recipe_from_dict({"drafter": "fasteagle", "architecture": {"num_layers": 3}})
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")
    (tmp_path / "r.yaml").write_text("drafter: lstm\noutput: {dir: out}\n")
    assert load_recipe(tmp_path / "r.yaml").output_dir() == tmp_path.resolve() / "out"


# ---------------------------------------------------------------------------------------------------------------------
# sources and splits


def test_agent_trace_sources_and_stable_heldout_split(tmp_path):
    traj = {"history": [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix bug A"},
                        {"role": "assistant", "content": "looking at A"}, {"role": "user", "content": "output of ls"},
                        {"role": "assistant", "content": "ls shows files"}]}
    mini = {"messages": [{"role": "user", "content": [{"type": "text", "text": "task B"}]},
                         {"role": "assistant", "content": "doing B"}]}
    (tmp_path / "a.traj").write_text(json.dumps(traj))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.traj.json").write_text(json.dumps(mini))
    (tmp_path / "sub" / "conversation_round_0.json").write_text(json.dumps(traj["history"][:3]))  # duplicate turns
    base = {"drafter": "lstm", "data": {"heldout_fraction": 0.5}}
    base["data"]["sources"] = [{"kind": "agent_traces", "path": str(tmp_path)}]
    items = load_items(recipe_from_dict(base))
    prompts = sorted(i.prompt for s in items.values() for i in s)
    assert prompts == ["fix bug A", "output of ls", "task B"]  # user turns, deduplicated
    base["data"]["sources"][0]["mode"] = "text"
    pairs = sorted((i.prompt, i.response) for s in load_items(recipe_from_dict(base)).values() for i in s)
    assert pairs == [("fix bug A", "looking at A"), ("output of ls", "ls shows files"), ("task B", "doing B")]


def test_heldout_split_is_disjoint_stable_and_capped(chat_file):
    recipe = recipe_from_dict({"drafter": "lstm", "data": {"sources": [{"kind": "jsonl", "path": str(chat_file)}],
                                                           "heldout_fraction": 0.2}})
    first, second = load_items(recipe), load_items(recipe)
    assert first == second
    train, held = {i.key for i in first["train"]}, {i.key for i in first["heldout"]}
    assert train and held and not train & held
    assert 0.05 < len(held) / (len(train) + len(held)) < 0.4
    recipe.data.sources[0].max_items = 10
    capped = load_items(recipe)
    assert len(capped["train"]) + len(capped["heldout"]) == 10 and len(capped["heldout"]) == 2
    assert {i.key for i in capped["heldout"]} <= held  # capping never moves an item across the split


def test_train_only_text_never_leaks_a_heldout_prompt(chat_file, tmp_path):
    """Existing text with train_only goes to the training split whole, except answers to held-out prompts."""
    questions = [json.loads(line)["text"] for line in chat_file.read_text().splitlines()]
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"prompt": q, "text": f"answer {i}"}) + "\n"
                               for i, q in enumerate(questions)))
    sources = [{"kind": "jsonl", "path": str(chat_file)}, {"kind": "jsonl", "path": str(answers), "mode": "text"}]
    recipe = recipe_from_dict({"drafter": "peagle", "data": {"sources": sources, "heldout_fraction": 0.2}})
    shared = load_items(recipe)
    recipe.data.sources[1].train_only = True
    items = load_items(recipe)
    held = {i.prompt for i in items["heldout"]}
    assert held and all(i.response is None for i in items["heldout"])  # only the generate source is held out
    assert items["heldout"] == [i for i in shared["heldout"] if i.response is None]
    texts = [i for i in items["train"] if i.response is not None]
    assert {i.prompt for i in texts} == set(questions) - held
    assert not any(i.prompt in held for i in items["train"])
    recipe.data.sources[1].max_items = 5
    assert len([i for i in load_items(recipe)["train"] if i.response is not None]) == 5


def test_self_instruct_requests_are_the_targets_own_and_resumable(tmp_path, target, tiny_tokenizer, chat_file,
                                                                    monkeypatch):
    """The target writes its own requests from the user-turn header; the source's items are those requests, written
    once (a rerun generates nothing) and the same for the same seed; the other sources' split does not wait on them."""
    from hybridspec.runtime.engine import Engine
    from hybridspec.model.target import TargetModel

    raw = tiny_recipe("peagle", tmp_path, chat_file)
    raw["data"]["sources"].append({"kind": "self_instruct", "max_items": 6, "seed": 3})
    recipe = recipe_from_dict(raw)
    source = recipe.data.sources[1]
    with pytest.raises(text_module.NotGeneratedError, match="--data-only"):
        load_items(recipe)
    assert not features_complete(recipe)
    others = load_items(recipe, skip_ungenerated=True)
    raw["data"]["sources"].pop()
    assert others == load_items(recipe_from_dict(raw))

    engine = Engine(TargetModel(target), tiny_tokenizer)
    batches = []
    real = engine.generate
    monkeypatch.setattr(engine, "generate", lambda p, **k: batches.append(len(p)) or real(p, **k))
    fingerprint = text_module.target_fingerprint(target)
    path = text_module.write_self_instruct(recipe, source, engine, fingerprint, progress=False)
    header = text_module.request_header(tiny_tokenizer)
    assert tiny_tokenizer.decode(header).endswith("<|im_start|>user\n")
    requests = [json.loads(line)["prompt"] for line in path.read_text().splitlines()[1:]]
    assert len(requests) == len(set(requests)) == 6 and all(len(r) >= 16 for r in requests)
    # each request is a finished sample of the target from the header: the target ends it with EOS
    first = tiny_tokenizer(requests[0], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = target(torch.tensor([header + first])).logits[0, -1]
    assert torch.softmax(logits.float(), -1)[tiny_tokenizer.eos_token_id] > 1e-4
    n = len(batches)
    assert text_module.write_self_instruct(recipe, source, engine, fingerprint, progress=False) == path
    assert len(batches) == n  # written once
    items = load_items(recipe)
    mine = {i.prompt for split in items.values() for i in split if i.source.startswith("self_instruct")}
    assert len(mine) >= 4 and mine <= set(requests)  # max_items caps the split source as it caps any other
    again = tmp_path / "again"
    raw["data"]["cache_dir"] = str(again / "features")
    raw["data"]["sources"].append({"kind": "self_instruct", "max_items": 6, "seed": 3})
    recipe2 = recipe_from_dict(raw)
    path2 = text_module.write_self_instruct(recipe2, recipe2.data.sources[1], engine, fingerprint, progress=False)
    assert path2 != path and path2.read_text() == path.read_text()  # the seed fixes the requests


# ---------------------------------------------------------------------------------------------------------------------
# the feature cache


def test_feature_cache_holds_the_targets_features(features, target):
    store = FeatureStore(features / "features", "train")
    assert len(store) >= 10 and store.meta["aux_layer_ids"] == [2, 3, 3]
    assert store.sources == ["jsonl:prompts.jsonl"] * len(store)
    start, end, rs = store.spans[3]
    tokens = store.data["tokens"][start:end].long()
    with torch.no_grad():
        out = target(tokens[None], output_hidden_states=True)
    expected = TargetFeatures.from_hidden_states(out.hidden_states, (2, 3, 3))
    torch.testing.assert_close(store.data["aux"][start:end].float(), expected.aux, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(store.data["final"][start:end].float(), expected.final, atol=2e-3, rtol=2e-3)
    assert torch.equal(store.data["topk_ids"][start:end, 0].long(), out.logits[0].argmax(-1))
    # the response is the target's greedy continuation of the prompt
    assert torch.equal(tokens[rs:], out.logits[0, rs - 1:-1].argmax(-1))


def test_feature_cache_resumes_at_the_first_missing_shard(features, target, tiny_tokenizer, chat_file, engine,
                                                          monkeypatch):
    recipe = recipe_from_dict(tiny_recipe("peagle", features, chat_file))
    assert features_complete(recipe)
    shard = features / "features" / "train-00001.safetensors"
    before = shard.read_bytes()
    shard.unlink()
    assert not features_complete(recipe)
    calls = []
    real = data_module.generate_responses
    monkeypatch.setattr(data_module, "generate_responses", lambda e, p, *a: calls.append(len(p)) or real(e, p, *a))
    build_features(recipe, target, tiny_tokenizer, progress=False, engine=engine)
    assert calls == [] and shard.read_bytes() == before  # the responses were cached: only features recomputed
    shard.unlink()
    for cache in recipe.generated_dir().glob("responses-*.jsonl"):
        cache.unlink()
    build_features(recipe, target, tiny_tokenizer, progress=False, engine=engine)
    assert calls == [6]  # only the missing shard's six prompts were generated again
    assert shard.read_bytes() == before and features_complete(recipe)
    with pytest.raises(ValueError, match="engine="):  # generate-mode sources need the runtime's engine passed in
        build_features(recipe, target, tiny_tokenizer, progress=False)
    with pytest.raises(ValueError, match="another target"):
        build_features(recipe, tiny_llama(hidden_size=32), tiny_tokenizer, progress=False, engine=engine)


def test_batches_align_slots_with_their_targets(features):
    store = FeatureStore(features / "features", "train")
    batch = make_batch(store, [0, 1], max_slots=10_000, max_depth=7)
    start, end, rs = store.spans[0]
    n = end - start - 2
    assert torch.equal(batch.positions[:n], torch.arange(n)) and bool((batch.seq_id[:n] == 0).all())
    tokens, top1 = store.data["tokens"].long(), store.data["topk_ids"][:, 0].long()
    assert torch.equal(batch.next_tokens[:n], tokens[start + 1: start + 1 + n])
    assert torch.equal(batch.target_top1[:n], top1[start + 1: start + 1 + n])
    assert torch.equal(batch.loss_mask[:n], torch.arange(n) + 2 >= rs)
    assert batch.valid_depth[n - 1] == 0 and batch.valid_depth[0] == 6
    cropped = make_batch(store, [0], max_slots=5, max_depth=7)
    assert torch.equal(cropped.positions, torch.arange(n - 5, n))
    # prompt context cut to 3 slots before the first trained-on slot (rs - 2), the response kept whole
    context = make_batch(store, [0], max_slots=10_000, max_depth=7, max_prompt_slots=3)
    assert rs - 2 > 3 and torch.equal(context.positions, torch.arange(rs - 5, n))
    assert torch.equal(context.loss_mask, batch.loss_mask[rs - 5: n])


# ---------------------------------------------------------------------------------------------------------------------
# training


@pytest.mark.parametrize("kind", ["peagle", "eagle3"])
def test_chains_start_only_where_they_reach_a_trained_target(kind, features, chat_file):
    """Depth 0 keeps every real slot (the EAGLE family's context); deeper chains only from origins whose deepest element
    has a trained-on target, and every such origin is a candidate (nested, as the chain layout requires)."""
    recipe = recipe_from_dict(tiny_recipe(kind, features, chat_file, sample_chains=False))
    trainer = Trainer(recipe, features / "features", progress=False)
    batch = trainer.next_batch()
    layout = trainer.layout(batch, sample=False)
    slots = torch.arange(len(batch))
    assert torch.equal(layout.origins[0], slots)
    trained = slots[batch.loss_mask[slots + batch.valid_depth]]
    assert 0 < trained.numel() < len(batch)  # the prompt's slots are context only
    for d, origins in enumerate(layout.origins[1:], start=1):
        assert torch.equal(origins, trained[batch.valid_depth[trained] >= d])


def test_a_train_fraction_trains_on_a_nested_share_of_the_sequences(features, chat_file):
    """train_fraction (data scaling): batches and the draft vocabulary come from a fixed share of the training
    sequences, a smaller share inside a larger one; 1.0 is every sequence in the order training always had."""
    trainers = {f: Trainer(recipe_from_dict(tiny_recipe("peagle", features, chat_file, train_fraction=f)),
                           features / "features", progress=False) for f in (0.25, 0.5, 1.0)}
    n = len(trainers[1.0].train)
    pools = {f: set(t.pool.tolist()) for f, t in trainers.items()}
    assert pools[1.0] == set(range(n)) and len(pools[0.5]) == round(0.5 * n) and len(pools[0.25]) == round(0.25 * n)
    assert pools[0.25] < pools[0.5] < pools[1.0]
    quarter = trainers[0.25]
    for _ in range(2 * n):  # several epochs: every epoch's order is a shuffle of the same share
        quarter.next_batch()
    assert quarter.epoch >= 2 and sorted(quarter.order.tolist()) == sorted(pools[0.25])
    assert torch.equal(trainers[1.0].order, torch.randperm(n, generator=torch.Generator().manual_seed(0)))
    counts = quarter.train.response_target_counts(quarter.meta["vocab_size"], sorted(pools[0.25]))
    assert counts.sum() < trainers[1.0].train.response_target_counts(quarter.meta["vocab_size"]).sum()
    assert quarter.train_tokens < trainers[1.0].train_tokens == trainers[1.0].train.num_tokens
    with pytest.raises(ValueError, match="train_fraction"):
        recipe_from_dict(tiny_recipe("peagle", features, chat_file, train_fraction=0.0))


def test_layers_from_target_start_from_the_targets_last_layers(features, chat_file, target):
    """architecture.layers_from_target: drafter layer i starts from the target's i-th of its last layers, every weight
    of the same shape (FastEagle's later layers: attention and norms; its first layer reads 2H, its MLP is smaller)."""
    raw = tiny_recipe("fasteagle", features, chat_file, architecture={"layers_from_target": True, "num_layers": 5,
                                                                      "intermediate_size": 24},
                      max_depth=5, eval_ks=[3, 5])
    layers = target.model.layers[-5:]
    trainer = Trainer(recipe_from_dict(raw), features / "features", progress=False,
                      target_layers=[layer.state_dict() for layer in layers])
    copied = set(trainer.layers_copied)
    assert "layers.3.self_attn.q_proj.weight" in copied and "layers.4.post_attention_layernorm.weight" in copied
    assert "layers.0.self_attn.q_proj.weight" not in copied and "layers.0.self_attn.o_proj.weight" in copied
    assert not any(".mlp." in name for name in copied)
    assert torch.equal(trainer.drafter.layers[3].self_attn.k_proj.weight, layers[3].self_attn.k_proj.weight)
    with pytest.raises(ValueError, match="needs the target's layers"):
        Trainer(recipe_from_dict(raw), features / "features", progress=False)
    with pytest.raises(ValueError, match="4 target layers for a drafter of 5"):
        Trainer(recipe_from_dict(raw), features / "features", progress=False,
                target_layers=[layer.state_dict() for layer in layers[1:]])
    with pytest.raises(ValueError, match="LSTM"):
        recipe_from_dict(tiny_recipe("lstm", features, chat_file, architecture={"layers_from_target": True}))


@pytest.mark.parametrize("kind", ["peagle", "eagle3", "lstm", "fasteagle"])
def test_a_few_steps_lower_the_loss_and_raise_acceptance(kind, features, chat_file, target):
    steps = {"peagle": 80, "eagle3": 60, "lstm": 80, "fasteagle": 80}[kind]
    extra = {"feature_weight": 0.5, "depth_weights": [1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4]} if kind == "fasteagle" else {}
    architecture = {"intermediate_size": 64, "lm_head_from_target": True} if kind == "fasteagle" else None
    recipe = recipe_from_dict(tiny_recipe(kind, features, chat_file, architecture, steps=steps, save_every=1000,
                                          **extra))
    recipe.output.resume = False
    trainer = Trainer(recipe, features / "features", progress=False)
    before, before_heldout = trainer.evaluate(trainer.train), trainer.evaluate()
    trainer.run()
    after, after_heldout = trainer.evaluate(trainer.train), trainer.evaluate()
    losses = [h["loss"] for h in trainer.history]
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    # chance is ~1 + 1/vocab tokens per step; an untrained drafter sits there
    assert before["acceptance@3"] < 1.05 and before_heldout["acceptance@3"] < 1.05
    assert after["acceptance@3"] > 1.3 and after_heldout["acceptance@3"] > 1.25
    # the offline figure is what greedy speculative decoding with the drafter achieves on the held-out prompts
    online = online_tokens_per_step(target, trainer.drafter, trainer.heldout, k=3)
    assert online == pytest.approx(after_heldout["acceptance@3"], abs=0.03)
    # the run wrote a checkpoint in the drafter's format and a log
    log = json.loads((recipe.output_dir() / "train_log.json").read_text())
    assert log["steps"] == steps and "acceptance@7" in log["final_eval"]
    assert log["machine"]["cpu"] and log["machine"]["threads"] >= 1  # where it trained, with its time and data
    meta = trainer.meta
    loaded = load_drafter(recipe.output_dir(), target=TargetInfo(meta["num_layers"], meta["hidden_size"],
                                                                 meta["vocab_size"]),
                          embed_tokens=trainer.drafter.state_dict().get("embed_tokens.weight"))
    assert type(loaded) is type(trainer.drafter)


def online_tokens_per_step(target, drafter, store, k: int) -> float:
    """Greedy speculative decoding of each held-out prompt to its response's length, driven as an engine would."""
    aux_ids = default_aux_layer_ids(target.config.num_hidden_layers)

    def forward(ids):
        with torch.no_grad():
            out = target(torch.tensor([ids]), output_hidden_states=True)
        return out.logits[0], TargetFeatures.from_hidden_states(out.hidden_states, aux_ids)

    proposer, tokens, steps = DrafterProposer(drafter, num_speculative_tokens=k), 0, 0
    for request, (start, end, rs) in enumerate(store.spans):
        prompt = store.data["tokens"][start:start + rs].tolist()
        logits, features = forward(prompt)
        sequence = prompt + [int(logits[-1].argmax())]
        proposer.start_request(request, sequence, features=features)  # features: positions before its last token
        while len(sequence) < end - start:
            proposal = proposer.speculate(request)
            logits, features = forward(sequence + proposal.token_ids)
            base, accepted = len(sequence) - 1, 0
            while accepted < k and proposal.token_ids[accepted] == int(logits[base + accepted].argmax()):
                accepted += 1
            new_tokens = proposal.token_ids[:accepted] + [int(logits[base + accepted].argmax())]
            proposer.append(request, new_tokens, features=features[base:base + accepted + 1])
            sequence += new_tokens
            tokens, steps = tokens + len(new_tokens), steps + 1
        proposer.finish_request(request)
    return tokens / steps


def test_evaluation_cap_samples_every_part_of_the_store():
    assert spread(5, None) == spread(5, 9) == [0, 1, 2, 3, 4]
    picked = spread(139, 10)
    assert len(set(picked)) == 10 and picked[0] == 0 and picked[-1] >= 125  # reaches the last sources too
    assert all(0 <= i < 139 for i in picked)


def test_walk_acceptance_steps_like_decoding():
    correct = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]]).bool()
    valid = torch.tensor([2, 2, 2, 2, 2, 1, 0])
    origin = torch.tensor([0, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    # starts at slot 1: 1 token -> slot 2: 1+3 -> slot 6: 1 token (end of text)
    assert walk_acceptance(correct, valid, origin, 3) == (6, 3)
    # with 2 drafts: slot 1: 1 -> slot 2: 3 -> slot 5: 1 + min(2, valid 1 + 1) = 3 -> end
    assert walk_acceptance(correct, valid, origin, 2) == (7, 3)
    assert walk_acceptance(correct, valid, torch.zeros(7, dtype=torch.bool), 3) == (0, 0)
    # a tree: where the chain is first wrong, a runner-up that is right adds one token
    runner_up = torch.zeros(7, 3, dtype=torch.bool)
    runner_up[1, 0] = runner_up[3, 1] = runner_up[4, 2] = True  # slot 4 is never a step's start: no effect
    # slot 1: 1 + 1 -> slot 3: 1 + (1 + 1) -> slot 6: 1
    assert walk_acceptance(correct, valid, origin, 3, runner_up) == (6, 3)


def test_interrupted_training_resumes_to_the_same_weights(features, chat_file, tmp_path):
    def run(state: str, chunks: list[int]) -> dict:
        raw = tiny_recipe("peagle", features, chat_file, steps=6, save_every=1)
        raw["output"]["state_dir"] = str(tmp_path / state)
        raw["output"]["dir"] = str(tmp_path / f"out-{state}")
        for chunk in chunks:  # a new Trainer per chunk: as if the process had been killed and restarted
            Trainer(recipe_from_dict(raw), features / "features", progress=False).run(max_steps=chunk)
        return torch.load(tmp_path / state / "train_state.pt", weights_only=False)

    straight, resumed = run("straight", [6]), run("resumed", [2, 3, 1])
    assert straight["step"] == resumed["step"] == 6
    for name, tensor in straight["model"].items():
        torch.testing.assert_close(resumed["model"][name], tensor, rtol=0, atol=0)


def test_cli_trains_from_a_recipe_file(tmp_path, chat_file, tiny_model, tiny_tokenizer):
    """`hybridspec train RECIPE.yaml` end to end on a tiny local Hugging Face target."""
    from hybridspec.cli import main

    model_dir = tmp_path / "tiny"
    tiny_model.save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    raw = tiny_recipe("lstm", tmp_path, chat_file, steps=4)
    raw["target"] = str(model_dir)
    raw["data"]["sources"][0]["max_items"] = 8
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(raw))
    assert main(["train", str(tmp_path / "recipe.yaml"), "--no-progress"]) == 0
    assert (tmp_path / "out-lstm" / "config.json").exists()
    assert json.loads((tmp_path / "out-lstm" / "train_log.json").read_text())["steps"] == 4


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "gemma3", "qwen3_5"])
def test_a_head_trains_for_any_supported_target(arch, tmp_path, chat_file, tiny_tokenizer):
    """The pipeline is per target, not per Llama: features from a Qwen3-MoE, gpt-oss, Gemma 3 or Qwen3.5 target (the
    engine writes its responses), a few P-EAGLE steps, and the head it wrote drafts in an Engine over that target with
    the tokens of plain greedy decoding."""
    from hybridspec.model.target import TargetModel
    from hybridspec.runtime.engine import Engine
    from hybridspec.tools.testing import tiny_causal_lm

    model = tiny_causal_lm(arch, init_std=0.1)
    engine = Engine(TargetModel(model), tiny_tokenizer, verify_cost=None)
    recipe = recipe_from_dict(tiny_recipe("peagle", tmp_path, chat_file, steps=6, save_every=1000))
    build_features(recipe, model, tiny_tokenizer, progress=False, engine=engine)
    store = FeatureStore(tmp_path / "features", "train")
    assert len(store) > 0 and store.meta["hidden_size"] == model.config.hidden_size
    Trainer(recipe, tmp_path / "features", progress=False).run()
    drafting = Engine(TargetModel(model), tiny_tokenizer, drafters={"peagle": str(recipe.output_dir())},
                      router=lambda proposals, contexts: list(proposals))
    prompt = tiny_tokenizer("Question 3: how would you explain")["input_ids"]
    spec = drafting.generate(prompt, max_new_tokens=24, speculate="peagle")
    assert spec.token_ids == drafting.generate(prompt, max_new_tokens=24, speculate="none").token_ids
    assert spec.stats.draft_tokens > 0
