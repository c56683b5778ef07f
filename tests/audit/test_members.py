"""Finding the members: clear errors when they cannot be found (no Spark needed)."""

from __future__ import annotations

import pytest

from tandem.audit import members


def test_a_brokercluster_that_does_not_resolve_says_where_it_looked() -> None:
    with pytest.raises(members.DiscoveryError, match=r"cannot resolve nosuch-members\.q\.svc"):
        members.from_kubernetes("nosuch", "q")


def test_a_cluster_url_that_does_not_answer_says_so() -> None:
    with pytest.raises(members.DiscoveryError, match=r"127\.0\.0\.1:9/cluster"):
        members.from_cluster("http://127.0.0.1:9")


def test_a_dead_member_is_one_row_naming_it() -> None:
    (row,) = members.read_member("http://127.0.0.1:9")
    node, url, role, reachable, error = row[:5]
    assert (node, url, role, reachable) == ("127.0.0.1:9", "http://127.0.0.1:9", None, False)
    assert error.startswith("does not answer")
    assert members.request_checkpoint(["http://127.0.0.1:9"]) is None
