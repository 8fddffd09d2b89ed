"""Tick fixtures: the committed ones replay exactly on SmolLM2; capture in a real loop;
edited fixtures fail their checksum, and re-signed ones their replay check; bad, oversized or
hostile files give one line, allocate nothing and run nothing; a fixture the model cannot take
is refused before a state is built; `positronic replay FILE` prints the tick and exits 0 / 1 / 2."""

import io
import math
import os
import pickle
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

import positronic.fixtures as fixtures_module
from positronic.fixtures import (
    MAX_HEAD_DIM, MAX_KV_HEADS, MAX_TENSOR_ELEMENTS, VERSION, Capture, CaptureMismatch, FixtureError, _fault_of,
    capture_tick, checksum, finish, load_fixture, parse_spec, replay, save_fixture, snapshot,
)
from positronic.loop import Brain, BrainConfig
from positronic.state_manager import FAULT_STAGES, ApplyReport, StateManager
from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = sorted((ROOT / "fixtures").glob("*.pt"))


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """These tests run many small forwards; where cores are shared, two torch threads spin
    against each other (7x slower measured here). Results do not depend on it: the committed
    fixtures are captured with one thread (bench/capture_fixtures.py) and replay within the
    tolerances with two as well."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# --- the committed fixtures -----------------------------------------------------------------


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_committed_fixture_replays_exactly(path, smol):
    result = replay(load_fixture(path), smol)
    assert result.passed, [f"{c.name}: {c.detail}" for c in result.checks if not c.passed]
    assert result.layer0_error <= 1e-4


def test_committed_fixtures_cover_the_required_ticks():
    fixtures = [load_fixture(p) for p in COMMITTED]
    assert fixtures, "no fixtures/*.pt committed"
    assert {f.model for f in fixtures} == {"smollm2"}
    pairs = [a for f in fixtures for a in f.actions if a["action"] == "replace_pair"]
    assert {2, 3} <= {len(a["new_token_ids"]) for a in pairs}, "multi-token replacements of 2 and 3 tokens"
    deletes = [(a["position"], len(f.live_ids_before)) for f in fixtures for a in f.actions if a["action"] == "delete"]
    assert any(row == 4 for row, _ in deletes), "a delete at the first row after the 4 sinks"
    assert any(row == length - 1 for row, length in deletes), "a delete at the last row"
    rebuilt = [f for f in fixtures if f.expected.rebuilt]
    assert rebuilt and all(f.fault in FAULT_STAGES for f in rebuilt)
    assert all(f.fault is None for f in fixtures if not f.expected.rebuilt)
    stages = {f.fault for f in rebuilt}
    assert "mid-forward" in stages and stages - {"mid-forward"}, "a failure half-way through the forward and another"
    for f in rebuilt:  # a failed tick is all or nothing: the rows are the ones from before it
        assert (f.expected.live_ids, f.expected.positions) == (f.live_ids_before, f.positions_before)
    looped = [f for f in fixtures if f.label.startswith("live run")]
    assert looped and all(f.brightness is not None for f in looped if not f.expected.rebuilt), \
        "live ticks carry their Step 2b brightness"
    assert sum(p.stat().st_size for p in COMMITTED) < 5 * 2**20


# --- a small fixture on the tiny random model -----------------------------------------------

PROMPT = [1] + list(range(40, 70))  # BOS + 30 tokens of the byte vocabulary
STEP_BRIGHTNESS = [float(10 * row) for row in range(len(PROMPT))]  # a Step 2b output for the tiny tick


@pytest.fixture(scope="module")
def tiny_fixture(tiny, tmp_path_factory) -> Path:
    """A crafted tick with history behind it: a 3-token replacement, a delete and an add,
    applied to a state that was already edited (so the live cache carries splice traces)."""
    state = StateManager.from_tokens(tiny, PROMPT, brightness=200.0)
    state.apply([{"action": "replace_pair", "original_pos1": 8, "original_pos2": 9, "new_token_ids": [90]},
                 {"action": "add", "token_id": 77}], tick=1)
    fixture, report = capture_tick(state, [
        {"action": "replace_pair", "original_pos1": 5, "original_pos2": 6, "new_token_ids": [80, 81, 82]},
        {"action": "delete", "position": 20},
        {"action": "add", "token_id": 99},
    ], tick=2, brightness=STEP_BRIGHTNESS, label="tiny test tick")
    assert not report.rebuilt
    path = tmp_path_factory.mktemp("tiny") / "tiny.pt"
    save_fixture(fixture, path)
    return path


def raw(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def rewrite(data, path: Path, *, sign: bool = True) -> Path:
    """Save edited fixture content; `sign`: with its checksum recomputed, as someone who edits a
    file on purpose can do, so that the checks behind the checksum are the ones tested. (Not
    for content whose checksum would itself blow up: a huge view, a cycle.)"""
    if sign and type(data) is dict:
        data["sha256"] = checksum(data)
    torch.save(data, path)
    return path


def test_a_crafted_tick_replays_and_records_what_the_tick_did(tiny, tiny_fixture):
    fixture = load_fixture(tiny_fixture)
    assert fixture.tick == 2 and fixture.label == "tiny test tick" and fixture.fault is None
    assert fixture.new_brightness == 200.0 and fixture.brightness == STEP_BRIGHTNESS
    assert len(fixture.live_ids_before) == len(PROMPT)  # 31 - 2 + 1 + 1
    assert fixture.expected.live_ids[5:8] == [80, 81, 82] and fixture.expected.live_ids[-1] == 99
    # rows 0-4 keep their Step 2b brightness, the repair's tokens start at the brighter of the
    # pair they replace (rows 5-6), the add at 200, row 20 is gone
    brightness = fixture.expected.brightness
    assert brightness[:5] == STEP_BRIGHTNESS[:5] and brightness[5:8] == [max(STEP_BRIGHTNESS[5:7])] * 3
    assert brightness[-1] == 200.0
    assert brightness[8:-1] == STEP_BRIGHTNESS[7:20] + STEP_BRIGHTNESS[21:]
    assert fixture.expected.layer0_rows.tolist() == [0, 5, 6, 7, 31]  # first, created (incl. the add), last
    assert fixture.expected.layer0_keys.shape == (tiny.num_kv_heads, 5, tiny.head_dim)
    assert len(fixture.expected.greedy) == 4
    result = replay(fixture, tiny)
    assert result.passed, [c for c in result.checks if not c.passed]


TAMPERED = [
    (lambda d: d["after"]["live_ids"].__setitem__(-1, d["after"]["live_ids"][-1] + 1), "live ids"),
    (lambda d: d["after"]["positions"].__setitem__(-1, d["after"]["positions"][-1] + 1), "positions"),
    (lambda d: d["after"]["texts"].__setitem__(3, d["after"]["texts"][3] + "x"), "text"),
    (lambda d: d["after"]["brightness"].__setitem__(2, d["after"]["brightness"][2] + 0.5), "brightness"),
    (lambda d: d.__setitem__("brightness", None), "brightness"),  # the Step 2b input is part of the tick
    (lambda d: d.__setitem__("new_brightness", 255.0), "brightness"),
    (lambda d: d["after"]["layer0"]["keys"][0, 1, 0].add_(1e-3), "layer-0 K/V"),
    (lambda d: d["after"]["layer0"]["values"][0, -1, 3].sub_(1e-3), "layer-0 K/V"),
    (lambda d: d["after"]["greedy"].__setitem__(2, (d["after"]["greedy"][2] + 1) % 256), "greedy"),
    (lambda d: d["after"].__setitem__("rebuilt", True), "rebuild"),
]
TAMPERED_IDS = ["live-id", "position", "text", "brightness-after", "brightness-input", "new-brightness",
                "layer0-key", "layer0-value", "greedy", "rebuilt-flag"]


@pytest.mark.parametrize("tamper, failing", TAMPERED, ids=TAMPERED_IDS)
def test_replay_detects_a_tampered_expectation(tiny, tiny_fixture, tmp_path, tamper, failing):
    """Edited and re-signed (the checksum is no signature): the replay's check still catches it."""
    data = raw(tiny_fixture)
    tamper(data)
    result = replay(load_fixture(rewrite(data, tmp_path / "tampered.pt")), tiny)
    assert not result.passed
    assert result.failed() == [failing]


EDITS = [tamper for tamper, _ in TAMPERED] + [
    lambda d: d["mirror"]["ledger"]["token_id"].__setitem__(3, d["mirror"]["ledger"]["token_id"][3] + 1),
    lambda d: d["actions"][0]["new_token_ids"].__setitem__(0, 81),
    lambda d: d["mirror"]["ledger"]["brightness"].__setitem__(0, 1.0),
    lambda d: d.__setitem__("tick", 3),
    lambda d: d.__setitem__("label", "another label"),
    lambda d: d.__setitem__("sha256", "0" * 64),
]
EDIT_IDS = TAMPERED_IDS + ["mirror-token-id", "action-token-id", "mirror-brightness", "tick", "label", "sha256"]


@pytest.mark.parametrize("edit", EDITS, ids=EDIT_IDS)
def test_a_fixture_edited_after_it_was_saved_fails_its_checksum(tiny_fixture, tmp_path, edit, capsys):
    data = raw(tiny_fixture)
    edit(data)
    path = rewrite(data, tmp_path / "edited.pt", sign=False)
    with pytest.raises(FixtureError) as caught:
        load_fixture(path)
    assert str(caught.value) == f"{path}: checksum mismatch: the content was changed or damaged after it was saved"
    assert run_cli("replay", str(path)) == 2
    assert capsys.readouterr().err == f"error: {caught.value}\n"


def test_the_checksum_covers_the_content_not_the_pickle(tiny_fixture, tmp_path):
    data = raw(tiny_fixture)
    assert data["sha256"] == checksum(data) and len(data["sha256"]) == 64
    shuffled = dict(reversed(list(data.items())))  # another key order pickles to other bytes
    shuffled["after"]["layer0"]["keys"] = shuffled["after"]["layer0"]["keys"].clone()  # another storage
    assert checksum(shuffled) == data["sha256"]
    assert load_fixture(rewrite(shuffled, tmp_path / "shuffled.pt", sign=False)).tick == 2
    # equal values of another type or dtype are other content
    for change in (lambda d: d.__setitem__("new_brightness", 200), lambda d: d["after"].__setitem__("rebuilt", 0),
                   lambda d: d["after"]["layer0"].__setitem__("rows", d["after"]["layer0"]["rows"].int())):
        other = raw(tiny_fixture)
        change(other)
        assert checksum(other) != data["sha256"]


def test_layer0_tolerance_is_1e_4(tiny, tiny_fixture, tmp_path):
    data = raw(tiny_fixture)
    data["after"]["layer0"]["keys"][0, 1, 0] += 5e-5
    assert replay(load_fixture(rewrite(data, tmp_path / "close.pt")), tiny).passed


def test_replay_of_changed_actions_fails(tiny, tiny_fixture, tmp_path):
    data = raw(tiny_fixture)
    data["actions"][0]["new_token_ids"] = [80, 81, 83]
    result = replay(load_fixture(rewrite(data, tmp_path / "other.pt")), tiny)
    assert {"live ids", "layer-0 K/V"} <= set(result.failed())


def test_replay_of_a_fixture_given_a_fault_it_did_not_have_fails(tiny, tiny_fixture, tmp_path):
    data = raw(tiny_fixture)
    data["fault"] = "commit"
    result = replay(load_fixture(rewrite(data, tmp_path / "faulted.pt")), tiny)
    assert result.report.rebuilt and result.report.error == "InjectedFault: fault injected at stage 'commit'"
    assert {"live ids", "brightness", "rebuild"} <= set(result.failed())


def test_replay_refuses_another_model(smol, tiny_fixture):
    with pytest.raises(FixtureError, match="captured with model 'random:tiny', not 'smollm2'"):
        replay(load_fixture(tiny_fixture), smol)


# --- capture in a real loop -----------------------------------------------------------------

# a pair every tick at the budget; DESIGN's ttl constants, so that brightness moves in a tiny model
LOOP = dict(budget=40, window=8, seed=0, repair_batch=1, repairer="self", ttl_gain=10.0)


def run_loop(tiny, ticks: int, *observers) -> list:
    brain = Brain.start(tiny, PROMPT, BrainConfig(**LOOP))
    brain.observers.extend(observers)
    return [brain.step() for _ in range(ticks)]


def test_capture_listed_ticks_writes_exactly_those_and_they_replay(tiny, tmp_path):
    log = io.StringIO()
    capture = Capture(tmp_path / "cap", tiny, "3,14,16", log=log)
    records = run_loop(tiny, 18, capture)
    assert sorted(p.name for p in (tmp_path / "cap").iterdir()) == ["tick000003.pt", "tick000014.pt", "tick000016.pt"]
    for path in capture.written:
        fixture = load_fixture(path)
        assert fixture.actions == records[fixture.tick - 1].actions
        assert fixture.expected.live_ids[-1] == records[fixture.tick - 1].token_id
        assert fixture.brightness is not None and len(fixture.brightness) == len(fixture.live_ids_before)
        assert fixture.brightness != fixture.mirror().brightness()  # the ttl rule moved it this tick
        result = replay(fixture, tiny)
        assert result.passed, (path.name, [c for c in result.checks if not c.passed])
    assert any(a["action"] == "replace_pair" for a in load_fixture(capture.written[-1]).actions)
    lines = log.getvalue().splitlines()
    assert lines[0] == f"capture: ticks 3,14,16 into {tmp_path / 'cap'}/ (at most 3 files)"
    assert lines[1].startswith("capture: tick 3 (add) -> ") and lines[1].endswith("tick000003.pt")
    assert lines[2:] == [f"capture: done, 3 fixtures in {tmp_path / 'cap'}/"]


def test_capture_repairs_takes_the_first_repair_ticks_up_to_the_limit(tiny, tmp_path):
    log = io.StringIO()
    capture = Capture(tmp_path / "cap", tiny, "repairs", limit=3, log=log)
    records = run_loop(tiny, 20, capture)
    repair_ticks = [r.tick for r in records if any(a["action"] in ("replace_pair", "delete") for a in r.actions)]
    assert len(repair_ticks) > 3
    assert [load_fixture(p).tick for p in capture.written] == repair_ticks[:3]
    assert "capture: done, 3 fixtures in" in log.getvalue() and "(the limit; later ticks" in log.getvalue()


INJECTED = {stage: f"InjectedFault: fault injected at stage '{stage}'" for stage in FAULT_STAGES}
INJECTED["mid-forward"] = "InjectedFault: fault injected half-way through the forward"


class FaultAt:
    """Observer: make the given tick's apply fail at `stage`."""

    def __init__(self, tick: int, stage: str):
        self.tick, self.stage = tick, stage

    def before_apply(self, brain, actions, brightness=None):
        if brain.tick == self.tick:
            brain.state.inject_fault(self.stage)

    def after_apply(self, brain, actions, report):
        pass


class Before:
    """Observer: the live rows and brightness just before each apply."""

    def __init__(self):
        self.seen = {}

    def before_apply(self, brain, actions, brightness=None):
        self.seen[brain.tick] = (brain.state.live_token_ids(), brain.state.positions(), brain.state.mirror.brightness())

    def after_apply(self, brain, actions, report):
        pass


@pytest.mark.parametrize("stage", FAULT_STAGES)
def test_capture_of_a_tick_that_failed_replays_the_failure(tiny, tmp_path, stage):
    capture, before = Capture(tmp_path / "cap", tiny, "15", log=io.StringIO()), Before()
    records = run_loop(tiny, 15, before, FaultAt(15, stage), capture)
    assert records[-1].rebuilt and any(a["action"] == "replace_pair" for a in records[-1].actions)
    fixture = load_fixture(capture.written[0])
    assert fixture.expected.rebuilt and fixture.fault == stage
    assert fixture.brightness is not None, "the tick's Step 2b input is recorded even though the tick failed"
    # all or nothing: rows, positions and brightness are those from before the tick
    ids, positions, brightness = before.seen[15]
    assert (fixture.live_ids_before, fixture.positions_before) == (ids, positions)
    assert (fixture.expected.live_ids, fixture.expected.positions, fixture.expected.brightness) == \
        (ids, positions, brightness)
    assert fixture.expected.layer0_rows.tolist() == [0, len(ids) - 1]  # the tick created no row
    result = replay(fixture, tiny)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.report.rebuilt and result.report.error == INJECTED[stage]


def test_a_failure_that_was_not_injected_is_replayed_as_a_failure_at_commit():
    assert _fault_of(ApplyReport(tick=3)) is None
    assert _fault_of(ApplyReport(tick=3, rebuilt=True, error="RuntimeError: CUDA out of memory")) == "commit"
    assert _fault_of(ApplyReport(tick=3, rebuilt=True, error="InjectedFault: fault injected at stage 'rotate'")) \
        == "rotate"
    assert _fault_of(ApplyReport(tick=3, rebuilt=True,
                                 error="InjectedFault: fault injected half-way through the forward")) == "mid-forward"


def test_capture_tick_with_a_fault_records_an_unchanged_state(tiny):
    state = StateManager.from_tokens(tiny, PROMPT)
    before = (state.live_token_ids(), state.positions())
    actions = [{"action": "delete", "position": 7},
               {"action": "replace_pair", "original_pos1": 10, "original_pos2": 11, "new_token_ids": [80, 81]},
               {"action": "add", "token_id": 99}]
    fixture, report = capture_tick(state, actions, tick=1, brightness=STEP_BRIGHTNESS, fault="mid-forward")
    assert report.rebuilt and fixture.fault == "mid-forward" and fixture.brightness == STEP_BRIGHTNESS
    assert (state.live_token_ids(), state.positions()) == before
    assert (fixture.expected.live_ids, fixture.expected.positions) == before
    assert fixture.expected.brightness == [255.0] * len(PROMPT)  # a failed tick stores no brightness either
    assert replay(fixture, tiny).passed
    with pytest.raises(ValueError, match="unknown fault stage 'after-edit-3'"):
        capture_tick(state, actions, fault="after-edit-3")


def test_capture_refuses_a_fresh_state_that_disagrees_with_the_live_run(tiny):
    live = StateManager.from_tokens(tiny, PROMPT)
    other = StateManager.from_tokens(tiny, PROMPT[:-1] + [5])
    actions = [{"action": "add", "token_id": 9}]
    snap = snapshot(live, actions, tick=1)
    report = other.apply(actions, tick=1)
    with pytest.raises(CaptureMismatch, match=r"ends the tick differently from the live run \(live ids;"):
        finish(snap, other, report)


def test_capture_refuses_a_tick_whose_brightness_it_did_not_see(tiny):
    live = StateManager.from_tokens(tiny, PROMPT)
    actions = [{"action": "add", "token_id": 9}]
    snap = snapshot(live, actions, tick=1)  # no brightness given ...
    report = live.apply(actions, tick=1, brightness=STEP_BRIGHTNESS)  # ... but the live tick stored one
    with pytest.raises(CaptureMismatch, match=r"\(brightness; rebuilt False vs False\)"):
        finish(snap, live, report)


@pytest.mark.parametrize("spec", ["", "some", "0", "5,x", "-3"])
def test_bad_capture_spec_is_a_value_error(spec):
    with pytest.raises(ValueError, match="--capture-ticks"):
        parse_spec(spec)


# --- bad and hostile files ------------------------------------------------------------------


class Payload:
    """Unpickling this would run a shell command that creates the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _set(path: list, value):
    def change(d):
        for key in path[:-1]:
            d = d[key]
        d[path[-1]] = value
    return change


def _drop(path: list):
    def change(d):
        for key in path[:-1]:
            d = d[key]
        del d[path[-1]]
    return change


BAD = {
    "not-a-dict": (lambda d: [1, 2, 3], "not a tick fixture: holds list"),
    "wrong-format": (_set(["format"], "something-else"), "not a tick fixture (format 'something-else'"),
    "wrong-version": (_set(["version"], 99), f"fixture version 99, this build reads {VERSION}"),
    "version-as-bool": (_set(["version"], True), f"fixture version True, this build reads {VERSION}"),
    # a v1 file (faults by edit count, no Step 2b brightness): refused by its version, with the reason
    "old-version-1": (lambda d: _v1(d), f"fixture version 1, this build reads {VERSION}: written for the v1 runtime"),
    "unknown-field": (_set(["extra"], 1), "unknown field(s) extra"),
    "missing-actions": (_drop(["actions"]), "missing field actions"),
    "missing-greedy": (_drop(["after", "greedy"]), "missing field after.greedy"),
    "tick-as-str": (_set(["tick"], "5"), "field tick must be an int >= 0, got str '5'"),
    "rebuilt-as-int": (_set(["after", "rebuilt"], 1), "field after.rebuilt must be a bool"),
    "bad-action": (_set(["actions", 0, "new_token_ids"], []), "actions: action 0 (replace_pair): new_token_ids"),
    "old-fault-record": (_set(["fault"], {"after_edits": 4, "mid_edit": True}),
                         "field fault must be None or a fault stage ('splice' | 'rotate' | 'forward' | "
                         "'mid-forward' | 'commit'), got dict"),
    "unknown-fault-stage": (_set(["fault"], "after-edit-3"), "field fault must be None or a fault stage"),
    "missing-fault": (_drop(["fault"]), "missing field fault"),
    "missing-brightness": (_drop(["brightness"]), "missing field brightness"),
    "brightness-short": (lambda d: d["brightness"].pop() and d,
                         "field brightness must be None or a list of 31 finite floats"),
    "brightness-int": (_set(["brightness", 0], 0), "field brightness must be None or a list of 31 finite floats"),
    "brightness-inf": (_set(["brightness", 0], float("inf")), "field brightness must be None or a list of 31"),
    "after-brightness-missing": (_drop(["after", "brightness"]), "missing field after.brightness"),
    "after-brightness-nan": (_set(["after", "brightness", 2], float("nan")),
                             "field after.brightness must be a list of finite floats"),
    "keys-2d": (lambda d: _set(["after", "layer0", "keys"], d["after"]["layer0"]["keys"][0].clone())(d) or d,
                "field after.layer0.keys must be a finite float32 tensor"),
    "keys-float64": (lambda d: _set(["after", "layer0", "keys"], d["after"]["layer0"]["keys"].double())(d) or d,
                     "got tensor float64"),
    "keys-nan": (lambda d: d["after"]["layer0"]["keys"].fill_(float("nan")) is None or d,
                 "field after.layer0.keys must be a finite float32 tensor"),
    "rows-beyond": (_set(["after", "layer0", "rows"], torch.tensor([0, 5, 6, 7, 99])), "must be increasing rows"),
    "rows-int32": (_set(["after", "layer0", "rows"], torch.tensor([0, 5, 6, 7, 31], dtype=torch.int32)),
                   "field after.layer0.rows must be an int64 or float32 tensor, got tensor int32 [5]"),
    "lengths-differ": (lambda d: d["after"]["texts"].pop() and d,
                       "after: 32 live ids, 32 positions, 31 texts, 32 brightness values"),
    "mirror-bad-column": (_set(["mirror", "ledger", "text", 0], 7), "mirror: ledger text[0] = 7, expected str"),
    "mirror-inconsistent": (_set(["mirror", "live", "positions", 3], 0), "inconsistent mirror: RoPE positions"),
    "before-mismatch": (lambda d: d["before"]["live_ids"].reverse() or d, "do not match the mirror's live rows"),
    "old-version-2": (_set(["version"], 2),
                      f"fixture version 2, this build reads {VERSION}: written without a content checksum"),
    "sha256-as-int": (_set(["sha256"], 7), "field sha256 must be a str, got int 7"),
    "missing-sha256": (_drop(["sha256"]), "missing field sha256"),
    # what needs no model is checked at load: ids >= 0, positions >= 0 and increasing
    "negative-live-id": (lambda d: _live_id(d, 3, -5), "field before.live_ids must be a list of token ids (int >= 0)"),
    "negative-position": (lambda d: _position(d, 0, -1), "inconsistent mirror: RoPE positions"),
    "after-negative-id": (_set(["after", "live_ids", 2], -1), "field after.live_ids must be a non-empty list of token"),
    "after-positions-decreasing": (lambda d: d["after"]["positions"].reverse() or d,
                                   "field after.positions must be a list of increasing positions (int >= 0)"),
    "after-negative-position": (_set(["after", "positions", 0], -1), "field after.positions must be a list of"),
    "negative-greedy": (_set(["after", "greedy", 0], -3), "field after.greedy must be a list of 1-64 token ids"),
    # only a tree of dicts (str keys), lists, plain values and tensors, never deeper than the schema needs
    "tuple": (_set(["after", "texts"], ("a",)), "field after.texts holds tuple: a fixture holds only dicts, lists"),
    "bytes": (_set(["label"], b"tick"), "field label holds bytes"),
    "set": (_set(["actions", 0, "new_token_ids"], {80, 81}), "field actions[0].new_token_ids holds set"),
    "int-key": (_set(["after", 5], 1), "field after has a key int 5, expected str"),
    "huge-int": (_set(["mirror", "ledger", "tick_born", 4], 2**70), "field mirror.ledger.tick_born[4] holds an int "
                                                                     "beyond 64 bits"),
    "too-deep": (_set(["label"], [[[[[[[[["x"]]]]]]]]]),
                 "field label[0][0][0][0][0][0][0][0]: nested deeper than 8 levels"),
    "shared-list": (lambda d: _set(["before", "positions"], d["mirror"]["live"]["positions"])(d) or d,
                    "the same list appears twice (shared or cyclic)"),
    "cyclic-list": (lambda d: d["actions"].append(d["actions"]) or d,
                    "field actions[3]: the same list appears twice (shared or cyclic)"),
    # tensors: compact, owning exactly their storage, of a schema dtype and bounded size, read
    # from metadata only (a copy of a view could take gigabytes)
    "keys-stride-0": (lambda d: _keys(d, lambda k: torch.zeros(1).expand(k.shape)),
                      "field after.layer0.keys is a view (shape [2, 5, 16], strides [0, 0, 0], offset 0, storage of "
                      "4 bytes): only compact tensors that own their storage"),
    "keys-transposed": (lambda d: _keys(d, lambda k: k.transpose(1, 2).contiguous().transpose(1, 2)),
                        "field after.layer0.keys is a view (shape [2, 5, 16], strides [80, 1, 5]"),
    "keys-overlapping": (lambda d: _keys(d, lambda k: torch.zeros(40).as_strided(k.shape, (10, 1, 1))),
                         "field after.layer0.keys is a view (shape [2, 5, 16], strides [10, 1, 1]"),
    "keys-at-offset": (lambda d: _keys(d, lambda k: torch.cat([k.flatten(), k.flatten()])[k.numel():].view(k.shape)),
                       "field after.layer0.keys is a view (shape [2, 5, 16], strides [80, 16, 1], offset 160, "
                       "storage of 1280 bytes)"),
    "keys-in-larger-storage": (lambda d: _keys(d, lambda k: torch.cat([k.flatten(), k.flatten()])[:k.numel()]
                                               .view(k.shape)), "offset 0, storage of 1280 bytes)"),
    "keys-share-storage": (lambda d: _keys(d, lambda k: d["after"]["layer0"]["values"].view(k.shape)),
                           "shares its storage with another tensor"),
    "keys-sparse": (lambda d: _keys(d, lambda k: k.to_sparse()), "field after.layer0.keys is a torch.sparse_coo "
                                                                 "tensor on cpu: only dense CPU tensors"),
    "keys-parameter": (lambda d: _keys(d, torch.nn.Parameter), "field after.layer0.keys holds Parameter"),
    "keys-4d": (lambda d: _keys(d, lambda k: k[None]), "field after.layer0.keys must be a finite float32 tensor "
                                                       "[kv_heads, 5, head_dim], 1 <= kv_heads <= 256, 1 <= head_dim "
                                                       "<= 1024, got tensor float32 [1, 2, 5, 16]"),
    "keys-5d": (lambda d: _keys(d, lambda k: k[None, None]), "field after.layer0.keys is a tensor of shape "
                                                             "[1, 1, 2, 5, 16]"),
    "keys-int32": (lambda d: _keys(d, lambda k: k.int()), "field after.layer0.keys must be an int64 or float32 "
                                                          "tensor, got tensor int32 [2, 5, 16]"),
    "tensor-elsewhere": (_set(["after", "greedy"], torch.tensor([1, 2])), "field after.greedy must be a list of 1-64"),
    "too-many-kv-heads": (lambda d: _keys_and_values(d, torch.zeros(MAX_KV_HEADS + 1, 5, 1)),
                          f"1 <= kv_heads <= {MAX_KV_HEADS}, 1 <= head_dim <= {MAX_HEAD_DIM}, got tensor float32 "
                          f"[{MAX_KV_HEADS + 1}, 5, 1]"),
    "head-dim-too-large": (lambda d: _keys_and_values(d, torch.zeros(1, 5, MAX_HEAD_DIM + 1)),
                           f"got tensor float32 [1, 5, {MAX_HEAD_DIM + 1}]"),
}


def _live_id(data: dict, row: int, token_id: int) -> dict:
    """Live row `row` holds `token_id`, in the mirror and in before.live_ids alike."""
    data["mirror"]["ledger"]["token_id"][data["mirror"]["live"]["ledger_ids"][row]] = token_id
    data["before"]["live_ids"][row] = token_id
    return data


def _position(data: dict, row: int, position: int) -> dict:
    """Live row `row` sits at RoPE `position`, in the mirror and in before.positions alike."""
    data["mirror"]["live"]["positions"][row] = data["before"]["positions"][row] = position
    return data


def _keys(data: dict, make) -> dict:
    layer0 = data["after"]["layer0"]
    layer0["keys"] = make(layer0["keys"])
    return data


def _keys_and_values(data: dict, tensor: torch.Tensor) -> dict:
    data["after"]["layer0"].update(keys=tensor, values=tensor.clone())
    return data


def _v1(data: dict) -> dict:
    """The tiny fixture as the v1 format wrote it."""
    data["version"] = 1
    data["fault"] = {"after_edits": 1, "mid_edit": False}
    del data["brightness"], data["after"]["brightness"]
    return data


def _apply(change, data):
    result = change(data)
    return data if result is None else result


# content the checksum cannot even take (refused before it is computed), or a bad checksum field
UNSIGNED = {"sha256-as-int", "missing-sha256", "cyclic-list", "tuple", "bytes", "set", "int-key", "keys-sparse",
            "keys-parameter"}


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_fixture_gives_one_clear_line(tiny_fixture, tmp_path, name):
    change, message = BAD[name]
    path = rewrite(_apply(change, raw(tiny_fixture)), tmp_path / f"{name}.pt", sign=name not in UNSIGNED)
    with pytest.raises(FixtureError) as caught:
        load_fixture(path)
    text = str(caught.value)
    assert "\n" not in text and text.startswith(f"{path}: ")
    assert message in text


def test_truncated_empty_garbage_and_missing_files_give_one_line(tiny_fixture, tmp_path):
    data = tiny_fixture.read_bytes()
    cases = {
        "truncated.pt": data[: len(data) // 2],
        "empty.pt": b"",
        "garbage.pt": b"\x80\x04 definitely not a pickle \xff" * 10,
        "text.pt": b"# a README, not a fixture\n",
    }
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
    for name in [*cases, "missing.pt"]:
        with pytest.raises(FixtureError) as caught:
            load_fixture(tmp_path / name)
        text = str(caught.value)
        assert "\n" not in text and text.startswith(f"{tmp_path / name}: ")
        expected = {"missing.pt": "cannot read", "garbage.pt": "refused: holds something other than plain data",
                    "empty.pt": "not a .pt file",
                    "text.pt": "not a .pt file (neither a torch zip archive nor a pickle)"}
        assert expected.get(name, "not a readable .pt file") in text


@pytest.mark.parametrize("writer, reason", [
    ("pickle-2", "GLOBAL posix.system"),  # reaches the global, which is refused
    ("pickle-5", "Unsupported operand"),
    ("torch.save", "GLOBAL posix.system"),
])
def test_a_malicious_pickle_is_refused_and_runs_nothing(tmp_path, writer, reason):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    payload = {"format": "positronic-tick-fixture", "version": VERSION, "model": Payload(marker)}
    if writer.startswith("pickle"):
        path.write_bytes(pickle.dumps(payload, protocol=int(writer[-1])))
    else:
        torch.save(payload, path)
    with pytest.raises(FixtureError, match=r"refused: holds something other than plain data and tensors") as caught:
        load_fixture(path)
    assert "\n" not in str(caught.value) and reason in str(caught.value)
    assert not any(advice in str(caught.value) for advice in TORCH_ADVICE)
    assert not marker.exists()
    assert run_cli("replay", str(path)) == 2
    assert not marker.exists()


# torch's advice around a refusal: how to load the file anyway. A hostile file must not be
# waved through, so none of it is shown, only the reason.
TORCH_ADVICE = ["weights_only` set to `False`", "Re-running", "safe_globals", "trust", "documentation", "file an issue",
                "PyTorch 2.6", "\x1b["]


class Plain:
    """A harmless custom class: still not plain data."""

    def __init__(self):
        self.value = 1


def _legacy_tar(path: Path) -> None:
    """An archive in torch's legacy .tar format, its first member named so the file starts like a pickle."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        member = tarfile.TarInfo("\x80storages")
        member.size = 4
        tar.addfile(member, io.BytesIO(b"data"))


@pytest.mark.parametrize("write, message", [
    (lambda p: torch.save({"model": Plain()}, p), f"refused: holds something other than plain data and tensors "
                                                  f"(Unsupported global: GLOBAL {Plain.__module__}.Plain was not "
                                                  "an allowed global by default)"),
    (lambda p: torch.save({"model": Plain}, p), f"GLOBAL {Plain.__module__}.Plain was not an allowed global"),
    (lambda p: torch.save({"model": os.path.join}, p), "(Unsupported global: GLOBAL posixpath.join was not an allowed"),
    (lambda p: torch.save({"model": print}, p), "(Unsupported global: GLOBAL print was not an allowed global"),
    (_legacy_tar, "not a readable .pt file (RuntimeError: Cannot use ``weights_only=True`` with files saved in the "
                  "legacy .tar format)"),
], ids=["custom-object", "class", "function", "builtin", "legacy-tar"])
def test_a_refusal_names_the_reason_without_torchs_advice(tmp_path, capsys, write, message):
    path = tmp_path / "hostile.pt"
    write(path)
    with pytest.raises(FixtureError) as caught:
        load_fixture(path)
    text = str(caught.value)
    assert text.startswith(f"{path}: ") and message in text
    assert not any(advice in text for advice in TORCH_ADVICE), text
    assert run_cli("replay", str(path)) == 2
    assert capsys.readouterr().err == f"error: {text}\n"


@pytest.mark.parametrize("where", [("after", "layer0", "keys"), ("after", "layer0", "values"), ("brightness",)])
def test_a_huge_view_of_a_small_storage_is_refused_before_anything_allocates(tiny_fixture, tmp_path, capsys, where):
    """torch.save keeps the 4-byte storage of a stride-0 view, so the file stays small; any copy,
    comparison or isfinite of it would allocate its full size (4 TB here, so a regression fails
    at once instead of filling the memory)."""
    data = raw(tiny_fixture)
    heads, rows, _ = data["after"]["layer0"]["keys"].shape
    shape = (heads, rows, 10**12) if where[0] == "after" else (10**9,)
    _set(list(where), torch.zeros(1).expand(shape))(data)
    path = rewrite(data, tmp_path / "view.pt", sign=False)  # a checksum would read all of it
    assert path.stat().st_size < tiny_fixture.stat().st_size + 2000
    with pytest.raises(FixtureError) as caught:
        load_fixture(path)
    count = math.prod(shape)
    assert str(caught.value) == (f"{path}: field {'.'.join(where)} is a tensor of shape {list(shape)} ({count} "
                                 f"elements): at most 4 dimensions and {MAX_TENSOR_ELEMENTS} elements")
    assert run_cli("replay", str(path)) == 2
    assert capsys.readouterr().err == f"error: {caught.value}\n"


def test_a_file_or_archive_beyond_the_size_limit_is_refused_unread(tiny_fixture, tmp_path, monkeypatch):
    size = tiny_fixture.stat().st_size
    monkeypatch.setattr(fixtures_module, "MAX_FILE_BYTES", size - 1)
    with pytest.raises(FixtureError, match=f"a file of {size} bytes, more than the {size - 1} a fixture may have"):
        load_fixture(tiny_fixture)
    # torch.load reads deflated members too: a small archive may unpack to gigabytes
    limit = 2**20
    monkeypatch.setattr(fixtures_module, "MAX_FILE_BYTES", limit)
    with zipfile.ZipFile(tiny_fixture) as source:
        members = {info.filename: source.read(info) for info in source.infolist()}
    deflated, bomb = tmp_path / "deflated.pt", tmp_path / "bomb.pt"
    for path, extra in ((deflated, {}), (bomb, {"tiny/data/junk": bytes(2 * limit)})):
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            for name, content in {**members, **extra}.items():
                archive.writestr(name, content)
    assert load_fixture(deflated).tick == 2  # deflating alone is fine
    assert bomb.stat().st_size < limit // 4
    unpacked = sum(map(len, members.values())) + 2 * limit
    with pytest.raises(FixtureError) as caught:
        load_fixture(bomb)
    assert str(caught.value) == f"{bomb}: its zip archive unpacks to {unpacked} bytes, more than the {limit} a " \
                                "fixture may have"


MISFITS = {
    "live-id": (lambda d, lm: _live_id(d, 3, lm.vocab_size),
                "before.live_ids[3] = 512 is outside the vocabulary 0..511"),
    "position": (lambda d, lm: _position(d, 30, lm.max_positions),
                 "before.positions[30] = RoPE position 512, outside the model's 0..511"),
    "after-id": (lambda d, lm: _set(["after", "live_ids", 0], lm.vocab_size + 7)(d),
                 "after.live_ids[0] = 519 is outside the vocabulary 0..511"),
    "after-position": (lambda d, lm: _set(["after", "positions", -1], 10**6)(d),
                       "after.positions[31] = RoPE position 1000000, outside the model's 0..511"),
    "greedy": (lambda d, lm: _set(["after", "greedy", 1], lm.vocab_size)(d),
               "after.greedy[1] = 512 is outside the vocabulary 0..511"),
    "action-token": (lambda d, lm: _set(["actions", 2, "token_id"], lm.vocab_size)(d),
                     "actions: action 2 (add): token_id=512 is outside the vocabulary 0..511"),
    "kv-heads": (lambda d, lm: _keys_and_values(d, torch.zeros(lm.num_kv_heads + 1, 5, lm.head_dim)),
                 "after.layer0 holds 3 kv heads of size 16, the model has 2 of size 16"),
}


@pytest.mark.parametrize("name", list(MISFITS))
def test_a_fixture_the_model_cannot_take_is_refused_before_a_state_is_built(tiny, tiny_fixture, tmp_path,
                                                                            monkeypatch, capsys, name):
    """Only the model knows its vocabulary, its RoPE limit and its sizes: replay checks them
    first, so the file gives one line instead of an IndexError deep in the forward."""
    change, problem = MISFITS[name]
    data = raw(tiny_fixture)
    change(data, tiny)
    path = rewrite(data, tmp_path / f"{name}.pt")
    fixture = load_fixture(path)  # nothing here needs the model
    built = []
    monkeypatch.setattr(StateManager, "from_mirror", lambda *args, **kwargs: built.append(1))
    with pytest.raises(FixtureError) as caught:
        replay(fixture, tiny)
    assert str(caught.value) == f"{path}: does not fit model 'random:tiny': {problem}"
    assert not built
    monkeypatch.undo()
    assert run_cli("replay", str(path)) == 2
    assert capsys.readouterr().err == f"error: {caught.value}\n"


# --- the replay command ---------------------------------------------------------------------


def test_replay_command_prints_the_tick(capsys):
    path = ROOT / "fixtures" / "api_delete_row4.pt"
    assert run_cli("replay", str(path)) == 0
    out = capsys.readouterr().out
    fixture = load_fixture(path)
    assert "model smollm2 (float32)" in out and f"tick {fixture.tick}" in out
    assert "delete row 4 (" in out and "add token" in out
    before = out[out.index("\nbefore: "):out.index("\nafter:  ")]  # the texts may hold newlines
    after = out[out.index("\nafter:  "):out.index("\nchecks:")]
    removed = fixture.mirror().live_texts()[4]
    assert f"[-{removed}-]" in before and "{+" in after and "[-" not in after  # changes marked without colour
    assert out.count("PASS") == 8 and "FAIL" not in out  # 7 checks, then the verdict


def test_replay_command_on_a_bad_file_prints_one_error_line(tmp_path, capsys):
    path = tmp_path / "bad.pt"
    torch.save({"format": "positronic-tick-fixture", "version": 99}, path)
    assert run_cli("replay", str(path)) == 2
    err = capsys.readouterr().err
    assert err == f"error: {path}: fixture version 99, this build reads {VERSION}\n"


def test_replay_command_on_a_tampered_file_reports_fail(tiny_fixture, tmp_path, capsys):
    data = raw(tiny_fixture)
    data["after"]["greedy"][0] = (data["after"]["greedy"][0] + 1) % 256
    assert run_cli("replay", str(rewrite(data, tmp_path / "tampered.pt"))) == 1
    out = capsys.readouterr().out
    assert "FAIL  greedy" in out and "FAIL: greedy differ" in out


def test_layer0_rows_keep_first_and_last_when_a_tick_creates_many(tiny):
    state = StateManager.from_tokens(tiny, PROMPT)
    actions = [{"action": "replace_pair", "original_pos1": p, "original_pos2": p + 1, "new_token_ids": [80, 81, 82]}
               for p in (6, 10, 14)] + [{"action": "add", "token_id": 99}]
    fixture, _ = capture_tick(state, actions, tick=1)
    rows = fixture.expected.layer0_rows.tolist()
    assert len(rows) == 8 and rows[0] == 0 and rows[-1] == len(state) - 1
    assert rows[1:7] == [6, 7, 8, 11, 12, 13]  # then the created rows, in order, as many as fit
    assert replay(fixture, tiny).passed
