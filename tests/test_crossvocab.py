"""Drafts whose vocabulary differs from the target's (`jaxspec.drafting.crossvocab`): the tables against a
brute-force reading of the two vocabularies; greedy output equal to the target's own and sampled
output following the target's exact distribution, for drafts that share most, or few, tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from catching_up import assert_static, check_catch_up
from exactness import assert_matches_distribution, exact_joint

import jaxspec
from jaxspec.drafting.crossvocab import CrossVocabDrafter, VocabMap, token_bytes
from jaxspec.drafting.trees import TreeShape
from jaxspec.models.model import Model
from jaxspec.sampling import SamplingConfig

# The target's 8 tokens; the last is a special token (a name, not bytes).
TARGET_PIECES = [b"a", b"b", b"c", b"ab", b"ba", b"abc", b" ", "<eos>"]
# A draft that is the target itself under another numbering, without "ab" (spelled a, b).
TWIN_ORDER = [5, 0, 6, 2, 1, 4, 7]
# An unrelated draft of 6 tokens sharing three with the target, with a special token of its own
# and a plain-text token spelled like the target's special one.
OTHER_PIECES = [b"c", b"ca", b"a", b"<eos>", b"b", "<s>"]
PROMPTS = [[0, 1, 2], [3, 5, 0, 6, 4, 1, 2], [6], [2, 2, 4, 4, 0]]


def brute_force_map(draft_pieces, target_pieces):
    """{target id: draft id} of tokens that stand for the same thing."""
    return {t: d for t, tp in enumerate(target_pieces) for d, dp in enumerate(draft_pieces)
            if tp == dp and type(tp) is type(dp)}


@pytest.fixture(scope="module")
def pair():
    cfg = jaxspec.ModelConfig.preset("tiny").replace(vocab_size=len(TARGET_PIECES), name="tiny-v8")
    target = jaxspec.Model.random(cfg, seed=7)
    params = dict(target.params)
    order = np.asarray(TWIN_ORDER)
    params["embed_vd"] = target.params["embed_vd"][order]
    params["lm_head_vd"] = target.params["lm_head_vd"][order]
    twin = Model(cfg.replace(vocab_size=len(order), name="twin"), params)
    other = jaxspec.Model.random(cfg.replace(vocab_size=len(OTHER_PIECES), num_layers=1, name="other"), seed=8)
    twin_map = VocabMap([TARGET_PIECES[i] for i in TWIN_ORDER], TARGET_PIECES)
    return target, {"twin": CrossVocabDrafter(twin, twin_map),
                    "other": CrossVocabDrafter(other, VocabMap(OTHER_PIECES, TARGET_PIECES))}


@pytest.mark.parametrize("draft_pieces", [[TARGET_PIECES[i] for i in TWIN_ORDER], OTHER_PIECES], ids=["twin", "other"])
def test_tables_match_a_brute_force_reading(draft_pieces):
    vmap = VocabMap(draft_pieces, TARGET_PIECES)
    shared = brute_force_map(draft_pieces, TARGET_PIECES)
    assert {t: int(vmap.to_draft_v[t]) for t in range(len(TARGET_PIECES)) if vmap.to_draft_v[t] < len(draft_pieces)} \
        == shared
    assert {int(vmap.to_target_w[d]): d for d in range(len(draft_pieces)) if vmap.to_target_w[d] >= 0} == shared
    for t, piece in enumerate(TARGET_PIECES):
        spelled = [draft_pieces[d] for d in vmap.expand_vm[t, :vmap.expand_len_v[t]]]
        if isinstance(piece, str):   # a special token is its namesake, or nothing
            assert spelled == ([piece] if piece in draft_pieces else [])
        else:   # every byte the draft can spell is spelled, in order; the others are skipped
            assert b"".join(spelled) == bytes(c for c in piece if bytes([c]) in draft_pieces)


def test_token_bytes_spell_real_text(smollm2_path):
    from jaxspec.models.gguf_tokenizer import tokenizer_from_gguf_metadata
    from jaxspec.models.loading import read_gguf
    tokenizer = tokenizer_from_gguf_metadata(read_gguf(smollm2_path)[0], smollm2_path)
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)  # «naïve» 🙂"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = token_bytes(tokenizer, len(tokenizer))
    assert b"".join(pieces[i] for i in ids) == text.encode("utf-8")
    assert pieces[tokenizer.convert_tokens_to_ids("<|im_end|>")] == "<|im_end|>"   # a name, not text


@pytest.mark.parametrize("kind", ["twin", pytest.param("other", marks=pytest.mark.slow)])
def test_greedy_equals_target_alone(pair, kind):
    target, drafters = pair
    reference = jaxspec.generate(target, PROMPTS, max_new_tokens=24).tokens
    for spec, batch_size in [(jaxspec.SpecConfig(k=3), None), (jaxspec.SpecConfig(k=3), 2),
                             (jaxspec.SpecConfig(k=2, extra=2, selection="tetris", capacity=4), None)]:
        result = jaxspec.SpeculativeDecoder(target, drafters[kind], spec=spec).generate(
            PROMPTS, max_new_tokens=24, batch_size=batch_size)
        assert result.tokens == reference, (spec, batch_size)
        if kind == "twin" and spec.selection == "standard":   # the target but for one token
            assert result.stats.mean_accepted_length > 2.0, spec


@pytest.mark.slow  # 20 s (suite time)
def test_trees_through_the_bridge_equal_target_alone(pair):
    target, drafters = pair
    reference = jaxspec.generate(target, PROMPTS, max_new_tokens=24).tokens
    for spec, batch_size in [(jaxspec.SpecConfig(k=3, tree=(3, 2)), 2),
                             (jaxspec.SpecConfig(k=3, tree=(2, 3), selection="tetris"), None)]:
        result = jaxspec.SpeculativeDecoder(target, drafters["twin"], spec=spec).generate(
            PROMPTS, max_new_tokens=24, batch_size=batch_size)
        assert result.tokens == reference, spec
        assert result.stats.mean_accepted_length > 2.0, spec


@pytest.mark.slow  # the single-slice engine above runs the same drafter
def test_greedy_equals_target_alone_pipelined(pair):
    target, drafters = pair
    reference = jaxspec.generate(target, PROMPTS, max_new_tokens=16).tokens
    decoder = jaxspec.SpeculativeDecoder(target, drafters["twin"], spec=jaxspec.SpecConfig(k=3, pipeline=True))
    assert decoder.generate(PROMPTS, max_new_tokens=16).tokens == reference


@pytest.mark.slow  # 28 s
def test_greedy_equals_target_alone_under_goodput_and_on_a_mesh(pair):
    """The goodput policy (its plain steps leave the draft behind: it catches up), and the draft
    on its own device slice with its tables."""
    target, drafters = pair
    reference = jaxspec.generate(target, PROMPTS, max_new_tokens=16).tokens
    cost = jaxspec.CostModel.from_coefficients(draft_fixed=1e-3, draft_per_token=1e-4, target_fixed=5e-3,
                                               target_per_token=5e-4)
    goodput = jaxspec.SpeculativeDecoder(target, drafters["twin"],
                                         spec=jaxspec.SpecConfig(k=3, policy="goodput", cost_model=cost))
    assert goodput.generate(PROMPTS, max_new_tokens=16).tokens == reference
    sliced = jaxspec.SpeculativeDecoder(target, drafters["twin"], spec=jaxspec.SpecConfig(k=3),
                                        mesh=jaxspec.MeshConfig(target_tp=2, draft_tp=1))
    assert sliced.generate(PROMPTS, max_new_tokens=16).tokens == reference


@pytest.mark.parametrize("kind, sampling", [("twin", SamplingConfig(temperature=0.7, top_k=3)),
                                            pytest.param("other", SamplingConfig(temperature=0.7, top_k=3),
                                                         marks=pytest.mark.slow)], ids=["twin", "other"])
def test_sampling_follows_the_target_distribution(pair, kind, sampling):
    """Four tokens: the prefill's, the window's two drafts and its bonus."""
    target, drafters = pair
    prompt, rows = PROMPTS[1], 4000
    decoder = jaxspec.SpeculativeDecoder(target, drafters[kind], spec=jaxspec.SpecConfig(k=2), sampling=sampling)
    result = decoder.generate([prompt] * rows, max_new_tokens=4, seed=29)
    assert_matches_distribution(result.tokens, exact_joint(target, prompt, 4, sampling), rows)
    assert 0 < result.stats.acceptance_rate < 1


def test_mismatched_vocabularies_without_tokenizers_are_refused(pair):
    target, drafters = pair
    with pytest.raises(ValueError, match="no tokenizers to bridge"):
        jaxspec.SpeculativeDecoder(target, drafters["other"].model)
    with pytest.raises(ValueError, match="share no token"):
        VocabMap([b"x", b"y"], TARGET_PIECES)



@pytest.mark.parametrize("kind", ["twin", "other"])
def test_a_deferred_bridge_catches_up_to_what_a_prefilled_one_proposes(pair, kind):
    """Started without its prefill and behind by plain steps, the bridge catches up (partially,
    `width` a call, or at once) and then proposes what one prefilled with the same text proposes."""
    drafter = pair[1][kind]
    seq_bl = jnp.asarray(np.random.default_rng(3).integers(0, 7, (3, 48)), jnp.int32)
    prompt_len_b, pending_b = jnp.asarray([4, 9, 6], jnp.int32), jnp.asarray([25, 11, 37], jnp.int32)
    reference = drafter.init(drafter.params, seq_bl[:, :37], pending_b, 48)
    deferred = drafter.init_deferred(drafter.params, seq_bl[:, :9], prompt_len_b, 48)
    assert int(jnp.max(deferred.cache.lengths)) == 0
    for width in (5, int(jnp.max(drafter.lag(deferred, seq_bl, pending_b)))):
        check_catch_up(drafter, deferred, reference, seq_bl, pending_b, width)


def test_bridge_programs_are_static(pair, monkeypatch):
    drafter = pair[1]["twin"]
    seq_bl = jnp.asarray(np.random.default_rng(3).integers(0, 7, (3, 48)), jnp.int32)
    prompt_len_b, pending_b = jnp.asarray([4, 9, 6], jnp.int32), jnp.asarray([25, 11, 37], jnp.int32)
    state = drafter.init(drafter.params, seq_bl[:, :9], prompt_len_b, 48)
    keys_b = jax.random.split(jax.random.key(0), 3)
    assert_static(monkeypatch, drafter.propose, drafter.params, state, seq_bl, pending_b, 3, keys_b, SamplingConfig(),
                  static_argnums=(4, 6))
    assert_static(monkeypatch, drafter.catch_up, drafter.params, state, seq_bl, pending_b, 8, static_argnums=4)
    assert_static(monkeypatch, drafter.propose_tree, drafter.params, state, seq_bl, pending_b, TreeShape(2, 2),
                  SamplingConfig(), static_argnums=(4, 5))

CORPUS = ["the cat sat on the mat", "a dog ate the cat's food", "def add(a, b): return a + b",
          "the mat is on the floor; the dog is on the mat", "return the sum of a and b"] * 4


def trained_tokenizer(kind: str, vocab_size: int):
    """A transformers fast tokenizer trained here: byte-level BPE (GPT-2 style) or
    SentencePiece-style pieces ("▁" for spaces)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    if kind == "byte-level":
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        tok.decoder = decoders.Metaspace(prepend_scheme="never")
        alphabet = sorted(set("".join(CORPUS).replace(" ", "\u2581")))
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                                        initial_alphabet=alphabet))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def test_models_with_different_tokenizers_pair_by_themselves():
    """Two models whose tokenizers were trained apart (byte-level BPE and SentencePiece-style):
    SpeculativeDecoder bridges them, and greedy output is the target's own."""
    target_tok, draft_tok = trained_tokenizer("metaspace", 64), trained_tokenizer("byte-level", 300)
    for tok in (target_tok, draft_tok):
        ids = tok("the dog sat on the floor")["input_ids"]
        assert b"".join(token_bytes(tok, len(tok))[i] for i in ids) == b"the dog sat on the floor"
    tiny = jaxspec.ModelConfig.preset("tiny")
    target = Model(tiny.replace(vocab_size=len(target_tok)), jaxspec.Model.random(
        tiny.replace(vocab_size=len(target_tok)), seed=1).params, tokenizer=target_tok)
    draft = Model(tiny.replace(vocab_size=len(draft_tok), num_layers=1), jaxspec.Model.random(
        tiny.replace(vocab_size=len(draft_tok), num_layers=1), seed=2).params, tokenizer=draft_tok)
    decoder = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(k=3))
    assert isinstance(decoder.drafter, CrossVocabDrafter) and decoder.drafter.map.shared > 20
    prompts = ["the cat sat", "def add(a, b):"]
    assert decoder.generate(prompts, max_new_tokens=16).tokens == jaxspec.generate(target, prompts, 16).tokens


@pytest.mark.slow   # needs `make models-qwen`
def test_smollm2_drafts_for_qwen_coder(smollm2):
    """Real weights and tokenizers: SmolLM2-135M drafts for Qwen2.5-Coder 0.5B; the output is the
    target's own and a fair share of the drafts is kept."""
    target = jaxspec.load(jaxspec.example_model("qwen2.5-coder-0.5b"))
    prompts = ["def is_prime(n: int) -> bool:\n", "# Sort a list of numbers in place\ndef sort_numbers(xs):\n"]
    result = jaxspec.SpeculativeDecoder(target, smollm2, spec=jaxspec.SpecConfig(k=2)).generate(prompts, 32)
    assert result.tokens == jaxspec.generate(target, prompts, 32).tokens
    assert result.stats.acceptance_rate > 0.2
