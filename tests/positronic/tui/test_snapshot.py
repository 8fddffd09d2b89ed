"""The snapshot: what the render thread reads is a copy, never the brain itself."""

from positronic.tui.snapshot import take_snapshot


def test_a_snapshot_does_not_change_with_the_brain(tiny, crafted, set_brightness):
    """The render thread reads snapshots while the loop edits the mirror: they must be copies."""
    brain = crafted(tiny)
    snapshot = take_snapshot(brain, tiny)
    texts, brightness, counts = list(snapshot.texts), list(snapshot.brightness), dict(snapshot.counts)
    set_brightness(brain, [1.0] * len(brain.state))
    brain.state.apply([{"action": "delete", "position": 10}, {"action": "add", "token_id": 50}])
    brain.counts["culls"] += 1
    assert snapshot.texts == texts and snapshot.brightness == brightness and snapshot.counts == counts
