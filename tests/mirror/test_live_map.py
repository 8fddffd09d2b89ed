"""The live map (positronic/mirror/live_map.py): one ledger id and one RoPE position per cache row."""

import pytest

from positronic.mirror import LiveMap


def test_a_live_map_needs_one_position_per_ledger_id():
    assert len(LiveMap([4, 2, 9], [0, 1, 5])) == 3
    with pytest.raises(ValueError, match="one position per ledger id"):
        LiveMap([4, 2, 9], [0, 1])
    with pytest.raises(ValueError, match="one position per ledger id"):
        LiveMap(None, [0])


def test_empty_live_maps_do_not_share_their_rows():
    first, second = LiveMap(), LiveMap()
    first.ledger_ids.append(0)
    first.positions.append(0)
    assert len(first) == 1 and len(second) == 0 and second.positions == []
