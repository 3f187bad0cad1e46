"""The manager <-> worker messages' wire forms: every message decodes back to the dataclass it was (edge cases
included: empty lists, None fields), and the wire form holds only what msgpack packs, so Ray never takes its
cloudpickle fallback for it. Pure: no Ray, no model."""
import dataclasses

import msgpack
import pytest

from minedraft_ray.engine.kv_blocks import TableEdits
from minedraft_ray.runtime.messages import (DraftRound, KVEdits, LinkRound, LinkTokens, PrefillRow, PrefillTask,
                                            SamplingRow, SlotResume, SpecStep, VerifierResult, VerifyTask)

EDITS = TableEdits([0, 3, 3], [1, 0, 7], [12, 5, 9])
SAMPLING = SamplingRow(0.7, 0.9, 40, 2**62 + 5)
ROWS = [PrefillRow(2, 0, [5, 17, 42]),                                     # a chunk before the prompt's end
        PrefillRow(0, 16, [3, 3], SAMPLING),                               # the end of a prompt
        PrefillRow(5, 0, [8] * 9, SamplingRow(0.0, 1.0, 0, 0), SlotResume(8, 11, 4)),   # a resumed request
        PrefillRow(1, 4, [])]                                              # empty: still a row

MESSAGES = [
    LinkRound(3, 16, 4, 2),
    LinkTokens(9, 16, 5, 1),
    SAMPLING,
    SlotResume(1, 2, 3),
    *ROWS,
    KVEdits(),
    KVEdits(target=EDITS),
    KVEdits(draft=EDITS),
    KVEdits(EDITS, TableEdits([], [], [])),
    PrefillTask(4, ROWS, 2, KVEdits(target=EDITS)),
    PrefillTask(5, []),
    VerifyTask(7, [2, 0, 5], 0, [0, -1, 1]),
    VerifyTask(8, [], 0),
    VerifyTask(9, [4], 3, [0], [LinkRound(1, 1, 4, 1), LinkRound(2, 3, 4, 1)], LinkTokens(9, 1, 5, 1),
               KVEdits(EDITS, EDITS), ROWS),
    VerifyTask(10, [1, 2], 0, None, [], None, None, []),
    SpecStep(11, [0, 1], 4),
    SpecStep(12, [3], 2, 5, KVEdits(EDITS, EDITS), ROWS[:1]),
    DraftRound(13, 4, [2, 0], [10, 0], [[5, 6], []], [[(0, 1), (1, 0)], []], [True, False], [7, 2**62],
               [3, 0]),
    DraftRound(14, 4, [], [], [], [], [], [], [], KVEdits(draft=EDITS), LinkTokens(13, 2, 5, 3)),
    VerifierResult([[1, 2, 3], [4]], None, 1.5, 2.0, 3.0, 0.25),
    VerifierResult([], None, 0.0),
    VerifierResult([[7]], [[{"token_id": 7, "logprob": -0.5, "top": [[7, -0.5], [9, -1.25]]}]], 2.0),
]


def _packs_without_fallback(wire) -> bytes:
    # as Ray packs a task argument (MessagePackSerializer): strict types, so a tuple or an object is not an array;
    # without a `default` hook anything msgpack cannot pack raises here instead of taking Ray's pickle fallback
    return msgpack.packb(wire, use_bin_type=True, strict_types=True)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_wire_form_round_trips_through_msgpack(message):
    wire = message.to_wire()
    sent = msgpack.unpackb(_packs_without_fallback(wire), raw=False, strict_map_key=False)
    back = type(message).from_wire(sent)
    assert back == message
    assert type(back) is type(message)


def test_every_message_class_and_field_is_covered():
    """A message class added without a round trip here would go unchecked, and so would a field that the wire form
    drops (decoding would give its default): each optional field holds something else in some message here."""
    classes = {LinkRound, LinkTokens, SamplingRow, SlotResume, PrefillRow, KVEdits, PrefillTask, VerifyTask,
               SpecStep, DraftRound, VerifierResult}
    assert {type(m) for m in MESSAGES} == classes
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.default is not dataclasses.MISSING:
                assert any(getattr(m, f.name) != f.default for m in MESSAGES if type(m) is cls), (cls, f.name)


def test_draft_round_takes_come_back_as_pairs():
    """takes are (source, row) pairs in the code; the wire flattens them, decoding restores the tuples."""
    message = MESSAGES[-5]
    back = DraftRound.from_wire(msgpack.unpackb(_packs_without_fallback(message.to_wire())))
    assert back.takes == [[(0, 1), (1, 0)], []]
    assert all(type(pair) is tuple for row in back.takes for pair in row)


def test_dataclasses_themselves_would_take_the_pickle_fallback():
    """What the wire form is for: msgpack refuses a message as it is (Ray would then pickle it)."""
    with pytest.raises(TypeError):
        _packs_without_fallback(MESSAGES[0])
    with pytest.raises(TypeError):
        _packs_without_fallback([(0, 1)])
