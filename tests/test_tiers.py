"""The tier files name tests that exist: an id left behind by a rename would mark nothing."""

import pytest
from conftest import UNMATCHED


def test_every_id_in_the_tier_files_names_a_test(request):
    unmatched = request.config.stash.get(UNMATCHED, None)
    if unmatched is None:
        pytest.skip("only some tests of a file were collected (a node id was given)")
    for tier, ids in unmatched.items():
        assert not ids, f"tests/{tier}_tests.txt names no test as {ids}: correct or remove them"
