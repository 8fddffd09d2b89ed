"""Each tick's edits in words, as the "last edits" panel shows them."""

from positronic.tui.records import ActionRecorder
from positronic.tui.render import render_actions
from positronic.tui.snapshot import take_snapshot


def test_edits_are_described_in_words_with_the_texts_before_the_edits(tiny, crafted, plain):
    brain = crafted(tiny)  # rows: '<s>', 'T', 'h', 'e', ' ', 'o', 'l', 'd', ' ', 'l', 'i', 'g', 'h', ...
    recorder = ActionRecorder(tiny)
    brain.observers.append(recorder)
    brain.tick = 9
    actions = [{"action": "replace_pair", "original_pos1": 5, "original_pos2": 6, "new_token_ids": tiny.encode("XY")},
               {"action": "delete", "position": 9}, {"action": "add", "token_id": tiny.encode("!")[0]}]
    for observer in brain.observers:  # what Brain.step does around Step 4
        observer.before_apply(brain, actions)
    report = brain.state.apply(actions, tick=brain.tick)
    for observer in brain.observers:
        observer.after_apply(brain, actions, report)
    assert list(recorder.lines) == ["t9 replace 5–6 'ol' → 'XY'", "t9 delete 9 'l'"]
    out = plain(render_actions(take_snapshot(brain, tiny, actions=list(recorder.lines)), 6))
    assert "replace 5–6 'ol' → 'XY'" in out and "delete 9 'l'" in out
