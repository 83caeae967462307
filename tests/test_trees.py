"""Draft trees: selection of the nodes to verify against a brute force over every ancestor-closed
set of nodes."""

import itertools

import numpy as np
import pytest

from jaxspec import tetris


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
