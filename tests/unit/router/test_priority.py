"""Priority classes at the router: parsing (kvfleet.priority), the HTTP and gRPC fields, the
key file's per-key default, and the admission headroom each class keeps for the ones above."""

from __future__ import annotations

import json

import pytest

from kvfleet import priority
from kvfleet.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from kvfleet.router.auth import Authenticator
from kvfleet.router.capacity import check_class_room, check_room
from kvfleet.router.openai_request import parse_chat, parse_completion
from kvfleet.router.policy import Candidate
from kvfleet.router.server import priority_from_proto
from kvfleet.v1 import router_pb2
from tests.unit.router import factories

HI = [{"role": "user", "content": "hi"}]


def bearer(key: str):
    return (("authorization", f"Bearer {key}"),)


def cand(rid: str, limit: int, **load) -> Candidate:
    return factories.cand(rid, limit=limit, at=1.0, **load)


def test_classes_and_numbers_parse_lower_first_with_bounded_labels():
    assert [priority.parse(c) for c in ("interactive", "default", "batch")] == [0, 1, 2]
    assert priority.parse(7) == 7 and priority.parse("-3") == -3
    assert [priority.band(p) for p in (-5, 0, 1, 2, 9)] == [
        "interactive", "interactive", "default", "batch", "batch"]
    assert [priority.label(p) for p in (0, 1, 2, 9, -1)] == [
        "interactive", "default", "batch", "other", "other"]
    assert priority.describe(2) == "batch" and priority.describe(9) == "priority 9 (batch)"


@pytest.mark.parametrize("value", ["urgent", True, 1.5, None, [1], 1001, "-1001", ""])
def test_a_bad_priority_is_invalid_argument_naming_the_field(value):
    with pytest.raises(InvalidArgument) as err:
        priority.parse(value, "priority_class")
    assert err.value.field == "priority_class" and "priority_class" in str(err.value)


def test_admission_fractions_parse_and_must_not_favour_a_lower_class():
    assert priority.parse_admit("batch=0.5") == {"interactive": 1.0, "default": 1.0, "batch": 0.5}
    assert priority.parse_admit(priority.format_admit(priority.DEFAULT_ADMIT)) == \
        priority.DEFAULT_ADMIT
    for text, match in (("urgent=0.5", "CLASS=FRACTION"), ("batch", "CLASS=FRACTION"),
                        ("batch=x", "number"), ("batch=0", r"\(0, 1\]"),
                        ("interactive=0.5", "must not grow")):
        with pytest.raises(ValueError, match=f"--priority-admit.*{match}"):
            priority.parse_admit(text)


def test_http_priority_is_a_class_or_number_and_a_bad_one_is_named():
    assert parse_chat({"messages": HI}).inputs[0].priority is None  # the key's default applies
    assert parse_chat({"messages": HI, "priority": "batch"}).inputs[0].priority == 2
    req = parse_completion({"prompt": ["a", "b"], "priority": -2})
    assert [i.priority for i in req.inputs] == [-2, -2]
    for bad in ("urgent", True, 0.5, {"class": "batch"}):
        with pytest.raises(InvalidArgument) as err:
            parse_chat({"messages": HI, "priority": bad})
        assert err.value.field == "priority"


def test_grpc_priority_oneof_names_the_field_it_came_in():
    assert priority_from_proto(router_pb2.GenerateRequest()) is None
    assert priority_from_proto(router_pb2.GenerateRequest(priority_class="interactive")) == 0
    assert priority_from_proto(router_pb2.GenerateRequest(priority_level=5)) == 5
    for req, field in ((router_pb2.GenerateRequest(priority_class="soon"), "priority_class"),
                       (router_pb2.GenerateRequest(priority_level=5000), "priority_level")):
        with pytest.raises(InvalidArgument) as err:
            priority_from_proto(req)
        assert err.value.field == field


def test_a_key_may_carry_a_default_priority_and_a_bad_one_fails_the_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {
        "k-chat": "acme", "k-night": {"tenant": "acme", "priority": "batch"},
        "k-ops": {"tenant": "ops", "priority": -1}, "k-plain": {"tenant": "globex"}}}))
    auth = Authenticator.from_file(str(path))
    assert auth.tenant(bearer("k-night")) == auth.tenant(bearer("k-chat")) == "acme"
    assert [auth.key_class(bearer(k)) for k in ("k-chat", "k-night", "k-ops", "k-plain")] == [
        1, 2, -1, 1]  # plain keys: default
    assert Authenticator.from_file(None).key_class(()) is None  # open router: none
    for entry, match in (({"tenant": "acme", "priority": "soon"}, "tenant 'acme'.*priority"),
                         ({"tenant": "acme", "prio": 1}, "only 'priority'"),
                         ({"priority": 1}, "string 'tenant'")):
        path.write_text(json.dumps({"keys": {"secret-key-1": entry}}))
        with pytest.raises(ValueError, match=match) as err:
            Authenticator.from_file(str(path))
        assert "secret-key-1" not in str(err.value)  # never echo a key


def test_a_key_class_is_a_ceiling_a_request_may_only_lower():
    assert priority.within_key(None, priority.BATCH) == priority.BATCH  # the key's default
    assert priority.within_key(5, priority.BATCH) == 5 and priority.within_key(2, 2) == 2
    assert priority.within_key(-1000, None) == -1000  # an open router sets no ceiling
    for asked in (priority.INTERACTIVE, priority.DEFAULT, -1000):
        with pytest.raises(PermissionDenied) as err:
            priority.within_key(asked, priority.BATCH, "priority_level")
        assert err.value.field == "priority_level" and "above this API key's class batch" in \
            str(err.value)


def test_a_refusal_within_the_keys_own_band_says_which_numbers_are_allowed():
    with pytest.raises(PermissionDenied) as err:
        priority.within_key(-5, priority.INTERACTIVE, "priority")
    text = str(err.value)
    assert text.startswith("priority: -5 (band interactive) is above this API key's class "
                           "interactive = 0")
    assert "a number >= 0" in text and "priority: priority" not in text


def test_batch_is_refused_at_its_fraction_of_capacity_interactive_only_when_full():
    admit = priority.DEFAULT_ADMIT  # batch 0.8
    fleet = [cand("a", 10, running=8), cand("b", 10, running=7)]  # 15 of 20 held
    for level in (0, 1, 2):
        check_class_room(fleet, "m", level, admit)
    fleet = [cand("a", 10, running=8), cand("b", 10, running=8)]  # 16 of 20: 80 %
    with pytest.raises(ResourceExhausted, match=r"batch requests to model 'm' are refused .* "
                                                r"16 of 20 .* up to 80%"):
        check_class_room(fleet, "m", priority.BATCH, admit)
    with pytest.raises(ResourceExhausted, match=r"priority 6 \(batch\) requests"):
        check_class_room(fleet, "m", 6, admit)
    check_class_room(fleet, "m", priority.DEFAULT, admit)
    check_class_room(fleet, "m", priority.INTERACTIVE, admit)
    tight = {"interactive": 1.0, "default": 0.75, "batch": 0.5}
    with pytest.raises(ResourceExhausted, match="default requests"):
        check_class_room(fleet, "m", priority.DEFAULT, tight)
    check_class_room([cand("a", 0, running=99)], "m", priority.BATCH, admit)  # unknown capacity
    with pytest.raises(ResourceExhausted, match="refused: interactive request"):
        check_room([cand("a", 2, running=2)], "m", priority.INTERACTIVE)
