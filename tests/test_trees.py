"""Draft trees: selection of the nodes to verify against a brute force over every ancestor-closed
set of nodes; the packed tree pass and the accepted path's move against uncached forwards; tree
acceptance against the target's exact distribution (chi-square) and its argmax path."""

import itertools

import numpy as np
import pytest

from jaxspec import tetris, verify
from jaxspec.sampling import SamplingConfig


def random_forest(rng, rows: int, nodes: int, certain: float = 0.2):
    """Each row's tree (parent index, -1 under the root; ancestors first) and each node's
    cumulative log-probability; some nodes are certain (log q = 0), so children tie parents."""
    parents = np.full((rows, nodes), -1)
    cum = np.zeros((rows, nodes))
    for r in range(rows):
        for j in range(nodes):
            parents[r, j] = rng.integers(-1, j)
            own = 0.0 if rng.random() < certain else np.log(rng.uniform(0.05, 1.0))
            cum[r, j] = own + (cum[r, parents[r, j]] if parents[r, j] >= 0 else 0.0)
    return parents, cum


def closed(mask, parents):
    return all(parents[r, j] < 0 or mask[r, parents[r, j]] for r, j in zip(*np.nonzero(mask)))


def best_closed_value(parents, cum, size, per_row):
    """max over ancestor-closed node sets of the given size (per row, or in all) of sum(exp(cum))."""
    rows, nodes = cum.shape
    cells = [(r, j) for r in range(rows) for j in range(nodes)]
    best = -1.0
    for chosen in itertools.combinations(cells, size * rows if per_row else size):
        mask = np.zeros((rows, nodes), bool)
        for cell in chosen:
            mask[cell] = True
        if (per_row and set(mask.sum(1)) != {size}) or not closed(mask, parents):
            continue
        best = max(best, float(np.exp(cum[mask]).sum()))
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("per_row", [False, True], ids=["batch", "per-row"])
def test_selected_nodes_are_ancestor_closed_and_the_best_set(seed, per_row):
    rng = np.random.default_rng(seed)
    parents, cum = random_forest(rng, rows=2, nodes=6)
    for size in (1, 2, 3):
        mask = np.asarray(tetris.select_nodes(cum, size, per_row=per_row))
        assert mask.sum() == (2 * size if per_row else size)
        assert closed(mask, parents)
        assert np.isclose(np.exp(cum[mask]).sum(), best_closed_value(parents, cum, size, per_row))


def test_unusable_nodes_and_a_traced_budget_shrink_the_selection():
    rng = np.random.default_rng(9)
    parents, cum = random_forest(rng, rows=3, nodes=5)
    cum[1] = -np.inf                       # a finished row offers nothing
    mask = np.asarray(tetris.select_nodes(cum, 12))
    assert mask.sum() == 10 and not mask[1].any()
    for budget in (0, 3, 7):
        masked = np.asarray(tetris.select_nodes(cum, 8, budget=budget))
        assert masked.sum() == budget and closed(masked, parents)
        assert np.isclose(np.exp(cum[masked]).sum(), np.sort(np.exp(cum[np.isfinite(cum)]))[::-1][:budget].sum())
    with pytest.raises(ValueError, match="capacity must be a static int >= 0, got -1"):
        tetris.select_nodes(cum, -1)


def tree_columns(parents_t):
    """Column layout of a tree under the root: column 0 the root, node j at column j + 1. Returns
    each column's parent column (-1 for the root), depth and ancestor-or-self matrix."""
    t = len(parents_t)
    parent_w = np.concatenate([[-1], np.where(parents_t < 0, 0, parents_t + 1)])
    depth_w = np.zeros(t + 1, np.int32)
    ancestor_ww = np.eye(t + 1, dtype=bool)
    for j in range(1, t + 1):
        depth_w[j] = depth_w[parent_w[j]] + 1
        ancestor_ww[j] |= ancestor_ww[parent_w[j]]
    return parent_w, depth_w, ancestor_ww


def path_to(column, parent_w):
    path = []
    while column > 0:
        path.append(column)
        column = parent_w[column]
    return path[::-1]


@pytest.mark.parametrize("impl", ["plain", "blocked", "xla"])
def test_a_packed_tree_pass_and_the_path_move_equal_uncached_forwards(impl, monkeypatch):
    """Every used node's logits equal an uncached forward of the prompt and its path; after the
    accepted path's keys and values move into contiguous slots, the next cached step equals an
    uncached forward of prompt + path + next token."""
    import jax
    import jax.numpy as jnp

    import jaxspec
    from jaxspec.models import attention
    from jaxspec.models.model import forward, forward_packed, init_cache
    monkeypatch.setattr(attention, "ATTENTION", impl)
    monkeypatch.setattr(attention, "BLOCK", 8)
    model = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny"), seed=4)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 256, n).tolist() for n in (11, 5)]
    trees = [np.array([-1, -1, 0, 0, 2, 1, 4]), np.array([-1, 0, 1, -1, 3, 2, 0])]
    layouts = [tree_columns(p) for p in trees]
    w = len(trees[0]) + 1
    window = np.asarray([[p[-1]] + rng.integers(0, 256, w - 1).tolist() for p in prompts], np.int32)
    used = np.ones((2, w), bool)
    used[0, [5, 7]] = False            # a leaf and a subtree left out (closed under ancestors)
    used[1, [6]] = False
    depth = np.stack([lay[1] for lay in layouts])
    ancestor = np.stack([lay[2] for lay in layouts])

    @jax.jit
    def run(params):
        cache = init_cache(model.graphdef, params, 2, 32)
        tokens = np.zeros((2, 10), np.int32)
        for r, p in enumerate(prompts):
            tokens[r, :len(p) - 1] = p[:-1]
        _, cache = forward(model.graphdef, params, jnp.asarray(tokens), cache, empty=True)
        cache = cache.commit(jnp.asarray([len(p) - 1 for p in prompts]))
        return forward_packed(model.graphdef, params, jnp.asarray(window), jnp.asarray(used), cache, 16,
                              tree=(jnp.asarray(depth), jnp.asarray(ancestor)))

    logits, cache = run(model.params)
    for r, p in enumerate(prompts):
        for col in np.nonzero(used[r])[0]:
            seq = p + [int(window[r, c]) for c in path_to(col, layouts[r][0])]
            want = np.asarray(model.logits([seq]))[0, -1]
            np.testing.assert_allclose(np.asarray(logits[r, col]), want, rtol=2e-4, atol=2e-4)

    leaves = [6, 5]                    # accept root -> ... -> leaf in each row
    paths = [path_to(leaf, lay[0]) for leaf, lay in zip(leaves, layouts)]
    base = np.asarray([len(p) - 1 for p in prompts])
    src = np.zeros((2, 4), np.int32)
    for r, path in enumerate(paths):
        src[r, :len(path)] = base[r] + np.asarray(path)
    count = np.asarray([len(path) for path in paths])
    moved = cache.move(jnp.asarray(src), jnp.asarray(count), jnp.asarray(base + 1)).commit(
        jnp.asarray(base + 1 + count))
    following = np.asarray([[17], [42]], np.int32)
    logits_next, _ = forward(model.graphdef, model.params, jnp.asarray(following), moved)
    for r, p in enumerate(prompts):
        seq = p + [int(window[r, c]) for c in paths[r]] + [int(following[r, 0])]
        np.testing.assert_allclose(np.asarray(logits_next[r, 0]), np.asarray(model.logits([seq]))[0, -1],
                                   rtol=2e-4, atol=2e-4)


# A tree over a 5-token vocabulary: root -> tokens 1, 3 (columns 1, 2); column 1 -> tokens 0, 2
# (columns 3, 4); column 2 -> token 4 (column 5); column 3 -> token 1 (column 6), left unverified.
TREE_TOKENS = np.array([9, 1, 3, 0, 2, 4, 1])
TREE_PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3])
TREE_USED = np.array([True] * 6 + [False])


def exact_emissions(p_wv, depth):
    """{emitted tokens: probability} of walking the tree with the target's own draws."""
    table = {}

    def walk(col, emitted, prob, d):
        for x, px in enumerate(p_wv[col]):
            if px == 0:
                continue
            child = [c for c in range(len(TREE_TOKENS)) if TREE_USED[c] and TREE_PARENTS[c] == col
                     and TREE_TOKENS[c] == x]
            if child and d < depth:
                walk(child[0], emitted + (x,), prob * px, d + 1)
            else:
                table[emitted + (x,)] = table.get(emitted + (x,), 0.0) + prob * px

    walk(0, (), 1.0, 0)
    return table


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.8, top_k=3)],
                         ids=["t1", "t0.8-topk3"])
def test_tree_acceptance_samples_the_targets_distribution(sampling):
    import jax
    from exactness import assert_matches_distribution

    from jaxspec.sampling import probabilities
    rows = 40000
    logits_wv = np.random.default_rng(3).normal(0, 0.7, (7, 5)).astype(np.float32)
    for col in range(1, 6):   # the drafted tokens are likely under the target, as with a good draft
        logits_wv[TREE_PARENTS[col], TREE_TOKENS[col]] += 1.5
    p_wv = np.asarray(probabilities(logits_wv, sampling), np.float64)
    tile = lambda x: np.broadcast_to(x, (rows, *x.shape))   # noqa: E731
    keys = jax.random.split(jax.random.key(11), rows)
    path, count, nxt = jax.jit(verify.accept_tree, static_argnums=(5, 6, 7))(
        keys, tile(TREE_TOKENS), tile(TREE_PARENTS), tile(TREE_USED), tile(logits_wv), sampling, 2, 2)
    path, count, nxt = map(np.asarray, (path, count, nxt))
    emitted = [tuple(int(TREE_TOKENS[c]) for c in path[r, :count[r]]) + (int(nxt[r]),) for r in range(rows)]
    assert_matches_distribution(emitted, exact_emissions(p_wv, depth=2), rows)
    assert count.mean() > 0.3   # the tree is used, not bypassed


def test_greedy_tree_acceptance_follows_the_targets_argmax_path():
    import jax
    rng = np.random.default_rng(8)
    rows = 64
    logits = rng.normal(0, 1, (rows, 7, 5)).astype(np.float32)
    logits[:, :, :] += 4.0 * (np.arange(5) == rng.integers(0, 5, (rows, 7, 1)))   # clear argmaxes
    tile = lambda x: np.broadcast_to(x, (rows, *x.shape))   # noqa: E731
    path, count, nxt = verify.accept_tree(jax.random.split(jax.random.key(0), rows), tile(TREE_TOKENS),
                                          tile(TREE_PARENTS), tile(TREE_USED), logits, SamplingConfig(), 2, 2)
    for r in range(rows):
        col, want = 0, []
        while len(want) < 2:
            top = int(np.argmax(logits[r, col]))
            match = [c for c in range(7) if TREE_USED[c] and TREE_PARENTS[c] == col and TREE_TOKENS[c] == top]
            if not match:
                break
            col = match[0]
            want.append(col)
        assert list(np.asarray(path[r, :count[r]])) == want
        assert int(nxt[r]) == int(np.argmax(logits[r, col]))


def test_a_drafted_tree_is_each_expanded_paths_top_children_under_an_uncached_forward():
    """Every column's token and cumulative log-probability against the draft model's uncached
    logits after the prompt and the column's path; the expanded nodes are each depth's best."""
    import jax.numpy as jnp
    from scipy.special import log_softmax

    import jaxspec
    from jaxspec.drafting.trees import TreeShape, draft_tree
    from jaxspec.models.model import forward, init_cache
    model = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny").replace(vocab_size=32), seed=6)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 32, n).tolist() for n in (7, 3)]
    shape = TreeShape(depth=3, width=2)
    cache = init_cache(model.graphdef, model.params, 2, 32)
    tokens = np.zeros((2, 8), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, :len(p) - 1] = p[:-1]
    _, cache = forward(model.graphdef, model.params, jnp.asarray(tokens), cache, empty=True)
    cache = cache.commit(jnp.asarray([len(p) - 1 for p in prompts]))
    root = jnp.asarray([p[-1] for p in prompts])
    root_logits, cache = forward(model.graphdef, model.params, root[:, None], cache)
    tree, _ = draft_tree(model.graphdef, model.params, cache, root, root_logits[:, 0], shape, SamplingConfig())
    tok, par = np.asarray(tree.tokens_bw), np.asarray(tree.parent_bw)
    # The draft's uncached log-probabilities after the prompt and every node's path, in one call
    # (right-padded rows: a causal model's logits at a position ignore what follows).
    seqs = {(r, q): p + [int(tok[r, c]) for c in path_to(q, par[r])] for r, p in enumerate(prompts)
            for q in range(shape.columns)}
    batch = np.zeros((len(seqs), max(map(len, seqs.values()))), np.int32)
    for i, seq in enumerate(seqs.values()):
        batch[i, :len(seq)] = seq
    logits = np.asarray(model.logits(batch), np.float64)
    logq = {key: log_softmax(logits[i, len(seq) - 1]) for i, (key, seq) in enumerate(seqs.items())}
    assert_dynamic_tree(tree, shape, lambda r, q: logq[r, q])


def assert_dynamic_tree(tree, shape, logq):
    """Each depth's expanded nodes are the best W of the depth above; each expanded node's
    children are the W most probable tokens under `logq(row, column)` (the draft's log
    probabilities after the column's path), with cumulative log-probabilities and ancestors."""
    tok, par, anc, cum = (np.asarray(x) for x in (tree.tokens_bw, tree.parent_bw, tree.ancestor_bww, tree.cum_bw))
    depth = shape.depth_w()
    for r in range(tok.shape[0]):
        for d in range(1, shape.depth + 1):
            cols = np.nonzero(depth == d)[0]
            parents = sorted(set(par[r, cols]))
            if d > 1:   # the expanded parents are the depth above's best
                above = np.nonzero(depth == d - 1)[0]
                assert parents == sorted(above[np.argsort(-cum[r, above])[:shape.width]])
            for q in parents:
                kids = [c for c in cols if par[r, c] == q]
                assert [int(tok[r, c]) for c in kids] == list(np.argsort(-logq(r, q))[:shape.width])
                np.testing.assert_allclose(cum[r, kids], (cum[r, q] if q else 0.0) + logq(r, q)[tok[r, kids]],
                                           atol=1e-4)
                for c in kids:   # ancestors: the path and the root
                    assert set(np.nonzero(anc[r, c])[0]) == {0, *path_to(c, par[r])}


def test_an_eagle_tree_is_each_expanded_paths_top_children_fed_one_token_at_a_time():
    """The head drafts a tree in one pass per depth (tree slots and masks); the reference feeds
    each node's path to the head one token at a time from the committed state (chain steps)."""
    import jax.numpy as jnp
    from scipy.special import log_softmax

    import jaxspec
    from jaxspec.drafting.eagle import EagleState
    from jaxspec.drafting.trees import TreeShape
    from jaxspec.models import eagle
    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny").replace(vocab_size=32), seed=6)
    head = eagle.EagleHead.init(target, draft_vocab_size=24, token_counts=np.arange(32) % 5, seed=2)
    rng, shape, lengths = np.random.default_rng(3), TreeShape(depth=3, width=2), jnp.asarray([5, 3])
    hidden = jnp.asarray(rng.normal(size=(2, 5, head.config.layer.hidden_size)), head.embed_vd.dtype)
    logits, out, cache = eagle.head_forward(head.graphdef, head.params, head.embed_vd, hidden,
                                            jnp.asarray(rng.integers(0, 32, (2, 5))), head.init_cache(2, 32))
    cache = cache.commit(lengths)   # row 1 kept 3 of its 5 (the rest is stale, as after a rejection)
    last = (jnp.arange(2), lengths - 1)
    drafter, state = jaxspec.EagleDrafter(head), EagleState(cache=cache, hidden_bd=out[last], logits_bw=logits[last])
    tree, _ = drafter.propose_tree(drafter.params, state, jnp.asarray([[7], [9]]), jnp.zeros((2,), jnp.int32), shape,
                                   SamplingConfig())
    tok, par = np.asarray(tree.tokens_bw), np.asarray(tree.parent_bw)

    def logq(r, q):
        step_logits, h, c = logits[last], out[last], cache
        for col in path_to(q, par[r]):
            step, h, c = eagle.head_forward(head.graphdef, head.params, head.embed_vd, h[:, None],
                                            jnp.full((2, 1), tok[r, col]), c)
            step_logits, h, c = step[:, 0], h[:, 0], c.commit(c.lengths + 1)
        full = eagle.to_target_logits(step_logits, head.draft_ids, 32)
        return log_softmax(np.asarray(full[r], np.float64))

    assert_dynamic_tree(tree, shape, logq)


def ngram_branches(ctx, max_n, min_n, width, depth):
    """Brute force: up to `width` continuations (`depth` tokens, or up to the present) of earlier
    occurrences of the context's last n tokens, longest n then latest first, distinct first tokens."""
    score = {}
    for n in range(max_n, min_n - 1, -1):
        for s in range(len(ctx) - n):
            if ctx[s:s + n] == ctx[-n:]:
                score[s + n] = max(score.get(s + n, -1), n * 10_000 + s + n)
    branches = []
    while score and len(branches) < width:
        c = max(score, key=score.get)
        branches.append(ctx[c:c + depth])
        score = {x: v for x, v in score.items() if ctx[x] != ctx[c]}
    return branches


def test_an_ngram_tree_holds_the_best_continuations_with_distinct_first_tokens():
    import jax.numpy as jnp

    import jaxspec
    from jaxspec.drafting.trees import TreeShape
    rng, shape = np.random.default_rng(4), TreeShape(depth=3, width=3)
    contexts = [rng.integers(0, 4, n).tolist() for n in (20, 9, 14, 2)] + [[1, 2, 3, 1, 2, 3, 1, 2]]
    seq = np.zeros((len(contexts), 24), np.int32)
    for r, ctx in enumerate(contexts):
        seq[r, :len(ctx)] = ctx
    pending = jnp.asarray([len(c) - 1 for c in contexts])
    tree, _ = jaxspec.NgramDrafter(3, 1).propose_tree((), (), jnp.asarray(seq), pending, shape, SamplingConfig())
    tok, par, cum = (np.asarray(x) for x in (tree.tokens_bw, tree.parent_bw, tree.cum_bw))
    for r, ctx in enumerate(contexts):
        usable = np.nonzero(np.isfinite(cum[r]))[0]
        leaves = {c for c in usable if c > 0 and not any(par[r, x] == c for x in usable)}
        got = sorted((-cum[r, c] - len(path_to(c, par[r])), [int(tok[r, x]) for x in path_to(c, par[r])])
                     for c in leaves)
        assert got == list(enumerate(ngram_branches(ctx, 3, 1, shape.width, shape.depth))), r


@pytest.fixture(scope="module")
def tree_pair():
    import jaxspec
    from jaxspec.tools.benchmarking import layer_skip_pair
    return layer_skip_pair(jaxspec.ModelConfig.preset("tiny").replace(num_layers=4), draft_layers=2, damping=0.05)


@pytest.mark.parametrize("spec", [dict(k=4, tree=(3, 2)), dict(k=3, tree=(2, 3), selection="tetris", capacity=6)],
                         ids=["per-row", "batch-budget"])
def test_tree_decoding_equals_the_targets_greedy_output(tree_pair, spec):
    import jaxspec
    target, draft = tree_pair
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 5, 14)]
    want = jaxspec.generate(target, prompts, max_new_tokens=20).tokens
    # Per row: with refills (2 slots for 4 prompts); the batch budget: all rows at once.
    batch_size = 2 if spec.get("selection") is None else None
    result = jaxspec.SpeculativeDecoder(target, draft, spec=jaxspec.SpecConfig(**spec)).generate(
        prompts, max_new_tokens=20, batch_size=batch_size)
    assert result.tokens == want
    assert result.stats.mean_accepted_length > 1.5   # the tree is used


@pytest.mark.slow   # 18 s per case (suite time)
@pytest.mark.parametrize("selection", ["standard", "tetris"])
def test_goodput_runs_the_tree_where_it_pays_and_plain_steps_where_not(tree_pair, selection):
    """The policy's candidates are plain decoding and the tree: with a nearly free draft it drafts
    trees, with a draft dearer than anything it could save it never drafts; both lossless."""
    import jaxspec
    target, draft = tree_pair
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 256, n).tolist() for n in (3, 9, 5, 14)]
    want = jaxspec.generate(target, prompts, max_new_tokens=16).tokens
    drafted = []
    for draft_fixed in (1e-6, 1.0):
        cost = jaxspec.CostModel.from_coefficients(draft_fixed=draft_fixed, draft_per_token=0.0, target_fixed=1e-2,
                                                   target_per_token=1e-5)
        spec = jaxspec.SpecConfig(k=3, tree=(3, 2), selection=selection, policy="goodput", cost_model=cost)
        result = jaxspec.SpeculativeDecoder(target, draft, spec=spec).generate(prompts, max_new_tokens=16,
                                                                               batch_size=2)
        assert result.tokens == want
        drafted.append(result.stats.drafted_tokens)
    assert drafted[0] > 0 and drafted[1] == 0, drafted


@pytest.fixture(scope="module")
def vocab6():
    """A 6-token target (random drafts often agree with it) and a head over 4 of its tokens."""
    import jaxspec
    from jaxspec.models import eagle
    target = jaxspec.Model.random(jaxspec.ModelConfig.preset("tiny").replace(vocab_size=6, num_layers=4), seed=3)
    return target, eagle.EagleHead.init(target, draft_vocab_size=4, token_counts=[0, 5, 5, 0, 5, 5], seed=6)


@pytest.mark.parametrize("spec", [dict(k=3, tree=(3, 2)), pytest.param(dict(k=3, tree=(2, 3), selection="tetris",
                                                                            capacity=8), marks=pytest.mark.slow)],
                         ids=["per-row", "batch-budget"])
def test_eagle_and_ngram_trees_decode_the_targets_greedy_output(vocab6, spec):
    import jaxspec
    target, head = vocab6
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 6, n).tolist() for n in (3, 9, 5, 12, 2, 7)]
    want = jaxspec.generate(target, prompts, max_new_tokens=24).tokens
    for drafter in (jaxspec.EagleDrafter(head), jaxspec.NgramDrafter()):
        result = jaxspec.SpeculativeDecoder(target, drafter, spec=jaxspec.SpecConfig(**spec)).generate(
            prompts, max_new_tokens=24, batch_size=4)   # 6 requests in 4 slots: refills
        assert result.tokens == want
        assert result.stats.accepted_tokens > 0, drafter   # drafts were accepted (trees took part)


@pytest.mark.parametrize("mesh", [dict(target_tp=2, draft_tp=0),
                                  pytest.param(dict(target_dp=2, target_tp=2, draft_tp=0), marks=pytest.mark.slow)],
                         ids=["tp2", "dp2xtp2"])
def test_tree_decoding_on_a_mesh_equals_the_targets_greedy_output(tree_pair, mesh):
    import jaxspec
    target, draft = tree_pair
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 256, n).tolist() for n in (4, 11, 6, 2)]
    want = jaxspec.generate(target, prompts, max_new_tokens=16).tokens
    result = jaxspec.SpeculativeDecoder(target, draft, mesh=jaxspec.MeshConfig(**mesh), spec=jaxspec.SpecConfig(
        k=3, tree=(2, 2), selection="tetris")).generate(prompts, max_new_tokens=16)
    assert result.tokens == want
    assert result.stats.mean_accepted_length > 1.2


@pytest.mark.slow   # 10-20 s per case (suite time); trees on a tensor-parallel mesh stay in the default suite
@pytest.mark.parametrize("pipeline", [False, True], ids=["two-slices", "pipelined"])
def test_tree_decoding_with_the_draft_on_its_own_slice_equals_the_targets_greedy_output(tree_pair, pipeline):
    import jaxspec
    target, draft = tree_pair
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 256, n).tolist() for n in (4, 11, 6, 2, 9)]
    want = jaxspec.generate(target, prompts, max_new_tokens=[12, 5, 16, 9, 3]).tokens
    result = jaxspec.SpeculativeDecoder(target, draft, mesh=jaxspec.MeshConfig(target_tp=1, draft_tp=1),
                                        spec=jaxspec.SpecConfig(k=3, tree=(2, 2), pipeline=pipeline)).generate(
        prompts, max_new_tokens=[12, 5, 16, 9, 3], batch_size=4)   # refills
    assert result.tokens == want
    assert result.stats.mean_accepted_length > 1.2


@pytest.mark.slow   # 12 s (suite time); model trees' sampling stays in the default suite
def test_eagle_tree_sampling_follows_the_targets_distribution(vocab6):
    from exactness import VOCAB6_PROMPT, assert_matches_distribution, exact_joint

    import jaxspec
    target, head = vocab6
    sampling, rows = SamplingConfig(temperature=0.7, top_k=3), 4000
    decoder = jaxspec.SpeculativeDecoder(target, jaxspec.EagleDrafter(head), spec=jaxspec.SpecConfig(k=3, tree=(2, 2)),
                                         sampling=sampling)
    result = decoder.generate([VOCAB6_PROMPT] * rows, max_new_tokens=4, seed=37)   # the 4th: a full path's bonus
    assert_matches_distribution(result.tokens, exact_joint(target, VOCAB6_PROMPT, 4, sampling), rows)
    assert result.stats.accepted_tokens > 0


@pytest.mark.parametrize("kind", ["model", "ngram", pytest.param("bridge", marks=pytest.mark.slow)])
def test_tree_sampling_follows_the_targets_distribution(kind):
    """A draft model's, an n-gram lookup's (a prompt with repeats, so it finds continuations) and
    the cross-vocabulary bridge's trees; four tokens, the 4th a full path's bonus."""
    from exactness import VOCAB6_PROMPT, assert_matches_distribution, exact_joint, vocab6_models

    import jaxspec
    from jaxspec.drafting.crossvocab import CrossVocabDrafter, VocabMap
    target, draft, _ = vocab6_models()
    cfg = target.config
    pieces = [bytes([97 + i]) for i in range(6)]   # the bridge's draft: tokens 1 and 4 missing
    drafter = {"model": draft, "ngram": jaxspec.NgramDrafter(max_ngram=2),
               "bridge": CrossVocabDrafter(jaxspec.Model.random(cfg.replace(vocab_size=4, num_layers=1), seed=4),
                                           VocabMap([pieces[i] for i in (0, 2, 3, 5)], pieces))}[kind]
    prompt = VOCAB6_PROMPT + [1, 4, 2, 5, 1, 4] if kind == "ngram" else VOCAB6_PROMPT
    sampling, rows = SamplingConfig(temperature=0.7, top_k=3), 4000
    decoder = jaxspec.SpeculativeDecoder(target, drafter, spec=jaxspec.SpecConfig(k=3, tree=(2, 2)),
                                         sampling=sampling)
    result = decoder.generate([prompt] * rows, max_new_tokens=4, seed=31)
    assert_matches_distribution(result.tokens, exact_joint(target, prompt, 4, sampling), rows)
    assert result.stats.accepted_tokens > 0


def test_bad_tree_shapes_are_refused_with_the_limit():
    import jaxspec
    with pytest.raises(ValueError, match="tree width must be an int >= 1, got 0"):
        jaxspec.SpecConfig(k=2, tree=(3, 0))
    with pytest.raises(ValueError, match="more than MAX_TREE_COLUMNS=64"):
        jaxspec.SpecConfig(k=2, tree=(5, 4))
    with pytest.raises(ValueError, match=r"k \(nodes verified per row\) must be in 1..6"):
        jaxspec.SpecConfig(k=7, tree=(2, 2))
    with pytest.raises(ValueError, match="tree drafting takes neither threshold nor extra, got threshold=None, "
                                         "extra=1"):
        jaxspec.SpecConfig(k=2, tree=(2, 2), extra=1)
