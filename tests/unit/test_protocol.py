"""The protocol vocabulary: every ProtocolError case of SPEC §6, named, with the field it names."""

from __future__ import annotations

import dataclasses
from datetime import UTC, date, datetime, timedelta, timezone
from uuid import UUID, uuid4

import pytest

from workflow_delivery import exceptions, protocol
from workflow_delivery.protocol import (
    MESSAGE_KIND,
    MESSAGE_V1_MARKER,
    WAKE_HINT_KIND,
    AlreadyTerminal,
    CauseKind,
    DeliveryBinding,
    DeliveryStatus,
    EventCause,
    LeaseLost,
    NewDelivery,
    Outcome,
    ProtocolError,
    ScheduleCause,
    Settled,
    WakeHint,
    WebhookCause,
    message_v1_targets,
    new_delivery_id,
)

COMMUNITY = UUID("c0111111-aaaa-4111-8111-111111111111")
WORKFLOW = UUID("f1022222-bbbb-4222-8222-222222222222")
RUN = UUID("e2033333-cccc-4333-8333-333333333333")
DELIVERY = UUID("d3044444-dddd-4444-8444-444444444444")
INVOCATION = UUID("b4055555-eeee-4555-8555-555555555555")
TARGET = bytes(range(32))
OTHER_TARGET = bytes(range(1, 33))
DEFINITION = b"\xd0" * 32
MESSAGE = b"\x0e" * 32
CAUSE_EVENT = b"\xca" * 32
SCHEDULED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

UUID_FIELDS = ["community_id", "workflow_id", "run_id"]
BYTES_FIELDS = ["target_pubkey", "definition_event_id", "message_event_id"]


def make_binding(**overrides: object) -> DeliveryBinding:
    fields: dict[str, object] = {
        "community_id": COMMUNITY,
        "workflow_id": WORKFLOW,
        "run_id": RUN,
        "step_id": "notify",
        "target_pubkey": TARGET,
        "definition_event_id": DEFINITION,
        "message_event_id": MESSAGE,
        "cause": EventCause(CAUSE_EVENT),
    }
    fields.update(overrides)
    return DeliveryBinding(**fields)


def target_tag(pubkey: bytes) -> list[str]:
    return ["p", pubkey.hex(), "", MESSAGE_V1_MARKER]


def wake_tags(target: str | None = None, delivery: str | None = None) -> list[list[str]]:
    return [["p", target or TARGET.hex()], ["delivery", delivery or str(DELIVERY)]]


def assert_field(excinfo: pytest.ExceptionInfo[ProtocolError], field: str) -> None:
    assert excinfo.value.field == field


def test_protocol_error_is_the_apps_value_error() -> None:
    assert ProtocolError is exceptions.ProtocolError
    error = ProtocolError("step_id", "must not be blank")
    assert isinstance(error, ValueError)
    assert isinstance(error, exceptions.WorkflowDeliveryError)
    assert str(error) == "step_id: must not be blank"


# Binding construction


def test_binding_normalises_uuid_strings_and_bytes_like_values() -> None:
    binding = make_binding(
        community_id=str(COMMUNITY),
        workflow_id=str(WORKFLOW),
        run_id=str(RUN),
        target_pubkey=bytearray(TARGET),
        definition_event_id=memoryview(DEFINITION),
        message_event_id=bytearray(MESSAGE),
    )
    assert binding == make_binding()
    assert hash(binding) == hash(make_binding())
    for name in UUID_FIELDS:
        assert type(getattr(binding, name)) is UUID
    for name in BYTES_FIELDS:
        assert type(getattr(binding, name)) is bytes


def test_binding_is_immutable() -> None:
    binding = make_binding()
    with pytest.raises(dataclasses.FrozenInstanceError):
        binding.step_id = "other"  # type: ignore[misc]


def test_binding_rejects_nil_community_id() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(community_id=UUID(int=0))
    assert_field(excinfo, "community_id")


def test_binding_rejects_nil_community_id_string() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(community_id="00000000-0000-0000-0000-000000000000")
    assert_field(excinfo, "community_id")


@pytest.mark.parametrize("field", UUID_FIELDS)
@pytest.mark.parametrize(
    "spelling",
    [
        lambda u: str(u).upper(),
        lambda u: u.hex,
        lambda u: "{" + str(u) + "}",
        lambda u: u.urn,
        lambda u: f" {u}",
        lambda u: str(u)[:-1],
    ],
    ids=["uppercase", "no-hyphens", "braces", "urn", "padded", "truncated"],
)
def test_binding_rejects_non_canonical_uuid_string(field: str, spelling) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(**{field: spelling(COMMUNITY)})
    assert_field(excinfo, field)


@pytest.mark.parametrize("field", UUID_FIELDS)
@pytest.mark.parametrize(
    "value",
    [None, True, 0, COMMUNITY.int, COMMUNITY.bytes, 1.5, [str(COMMUNITY)]],
    ids=["none", "bool", "zero", "int", "bytes", "float", "list"],
)
def test_binding_rejects_uuid_field_of_wrong_type(field: str, value: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(**{field: value})
    assert_field(excinfo, field)


@pytest.mark.parametrize("field", BYTES_FIELDS)
def test_binding_rejects_31_byte_value(field: str) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(**{field: b"\x01" * 31})
    assert_field(excinfo, field)


@pytest.mark.parametrize("field", BYTES_FIELDS)
def test_binding_rejects_33_byte_value(field: str) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(**{field: b"\x01" * 33})
    assert_field(excinfo, field)


@pytest.mark.parametrize("field", BYTES_FIELDS)
@pytest.mark.parametrize(
    "value", [TARGET.hex(), list(TARGET), None, 32], ids=["hex-string", "int-list", "none", "int"]
)
def test_binding_rejects_bytes_field_of_wrong_type(field: str, value: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(**{field: value})
    assert_field(excinfo, field)


def test_binding_rejects_released_memoryview() -> None:
    view = memoryview(bytes(TARGET))
    view.release()
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(target_pubkey=view)
    assert_field(excinfo, "target_pubkey")


def test_binding_rejects_empty_step_id() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(step_id="")
    assert_field(excinfo, "step_id")


@pytest.mark.parametrize(
    "step_id", [" ", "\t\n ", "\u3000\u00a0"], ids=["space", "tabs", "unicode"]
)
def test_binding_rejects_whitespace_only_step_id(step_id: str) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(step_id=step_id)
    assert_field(excinfo, "step_id")


def test_binding_rejects_65_character_step_id() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(step_id="s" * 65)
    assert_field(excinfo, "step_id")


def test_binding_accepts_64_character_step_id_with_inner_spaces() -> None:
    assert make_binding(step_id=" s" * 32).step_id == " s" * 32


def test_binding_rejects_nul_in_step_id() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(step_id="step\x00one")
    assert_field(excinfo, "step_id")


def test_binding_rejects_lone_surrogate_in_step_id() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(step_id="step\ud800")
    assert_field(excinfo, "step_id")


@pytest.mark.parametrize("step_id", [None, 7, b"notify", ["notify"]])
def test_binding_rejects_non_string_step_id(step_id: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(step_id=step_id)
    assert_field(excinfo, "step_id")


@pytest.mark.parametrize(
    "cause",
    [None, CauseKind.EVENT, CAUSE_EVENT, INVOCATION, SCHEDULED, ("event", CAUSE_EVENT)],
    ids=["none", "kind", "bytes", "uuid", "datetime", "tuple"],
)
def test_binding_rejects_wrong_cause_type(cause: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(cause=cause)
    assert_field(excinfo, "cause")


def test_binding_names_the_first_wrong_field() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding(run_id="nope", step_id="", cause=None)
    assert_field(excinfo, "run_id")


# Causes


def test_causes_report_their_kind() -> None:
    assert EventCause(CAUSE_EVENT).kind is CauseKind.EVENT
    assert ScheduleCause(SCHEDULED).kind is CauseKind.SCHEDULE
    assert WebhookCause(INVOCATION).kind is CauseKind.WEBHOOK
    assert [kind.value for kind in CauseKind] == ["event", "schedule", "webhook"]


def test_event_cause_normalises_bytes_like() -> None:
    cause = EventCause(bytearray(CAUSE_EVENT))
    assert type(cause.event_id) is bytes
    assert cause == EventCause(CAUSE_EVENT)


@pytest.mark.parametrize("event_id", [b"\x01" * 31, b"\x01" * 33, CAUSE_EVENT.hex(), None])
def test_event_cause_rejects_anything_but_32_bytes(event_id: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        EventCause(event_id)  # type: ignore[arg-type]
    assert_field(excinfo, "event_id")


def test_schedule_cause_rejects_naive_datetime() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        ScheduleCause(datetime(2026, 1, 2, 3, 4, 5))
    assert_field(excinfo, "scheduled_for")


def test_schedule_cause_rejects_fractional_second() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        ScheduleCause(SCHEDULED.replace(microsecond=1))
    assert_field(excinfo, "scheduled_for")


def test_schedule_cause_rejects_offset_that_makes_the_instant_fractional() -> None:
    odd = timezone(timedelta(hours=1, microseconds=500))
    with pytest.raises(ProtocolError) as excinfo:
        ScheduleCause(datetime(2026, 1, 2, 3, 4, 5, tzinfo=odd))
    assert_field(excinfo, "scheduled_for")


def test_schedule_cause_rejects_instant_outside_the_datetime_range() -> None:
    ahead = timezone(timedelta(hours=5))
    with pytest.raises(ProtocolError) as excinfo:
        ScheduleCause(datetime(1, 1, 1, tzinfo=ahead))
    assert_field(excinfo, "scheduled_for")


@pytest.mark.parametrize("value", [date(2026, 1, 2), SCHEDULED.isoformat(), 1767323045, None])
def test_schedule_cause_rejects_non_datetime(value: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        ScheduleCause(value)  # type: ignore[arg-type]
    assert_field(excinfo, "scheduled_for")


def test_schedule_cause_normalises_to_utc() -> None:
    paris_winter = timezone(timedelta(hours=1))
    cause = ScheduleCause(datetime(2026, 1, 2, 4, 4, 5, tzinfo=paris_winter))
    assert cause.scheduled_for.tzinfo is UTC
    assert cause.scheduled_for == SCHEDULED
    assert cause == ScheduleCause(SCHEDULED)
    assert hash(cause) == hash(ScheduleCause(SCHEDULED))


def test_webhook_cause_accepts_canonical_string() -> None:
    assert WebhookCause(str(INVOCATION)) == WebhookCause(INVOCATION)  # type: ignore[arg-type]
    assert type(WebhookCause(str(INVOCATION)).invocation_id) is UUID  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [str(INVOCATION).upper(), INVOCATION.hex, None, b"x" * 16])
def test_webhook_cause_rejects_non_canonical_or_non_uuid(value: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        WebhookCause(value)  # type: ignore[arg-type]
    assert_field(excinfo, "invocation_id")


# Binding equality


def test_equal_bindings_are_equal_and_hash_alike() -> None:
    assert make_binding() == make_binding()
    assert hash(make_binding()) == hash(make_binding())
    assert len({make_binding(), make_binding()}) == 1


def test_binding_equality_covers_cause_identity() -> None:
    assert make_binding(cause=EventCause(b"\x01" * 32)) != make_binding(
        cause=EventCause(b"\x02" * 32)
    )
    assert make_binding(cause=ScheduleCause(SCHEDULED)) != make_binding(
        cause=ScheduleCause(SCHEDULED + timedelta(seconds=1))
    )
    assert make_binding(cause=WebhookCause(INVOCATION)) != make_binding(
        cause=WebhookCause(DELIVERY)
    )


def test_binding_equality_covers_cause_kind() -> None:
    causes = [EventCause(CAUSE_EVENT), ScheduleCause(SCHEDULED), WebhookCause(INVOCATION)]
    bindings = [make_binding(cause=cause) for cause in causes]
    assert len(set(bindings)) == 3
    assert bindings[0] != bindings[1] != bindings[2] != bindings[0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("community_id", DELIVERY),
        ("workflow_id", DELIVERY),
        ("run_id", DELIVERY),
        ("step_id", "other"),
        ("target_pubkey", OTHER_TARGET),
        ("definition_event_id", OTHER_TARGET),
        ("message_event_id", OTHER_TARGET),
    ],
)
def test_binding_equality_covers_every_field(field: str, value: object) -> None:
    assert make_binding(**{field: value}) != make_binding()


# Validating a binding against its message event


def test_validate_message_event_accepts_the_bindings_message() -> None:
    tags = [["e", "ab" * 32], target_tag(OTHER_TARGET), target_tag(TARGET)]
    assert make_binding().validate_message_event(MESSAGE_KIND, MESSAGE, tags) is None


def test_validate_message_event_accepts_bytes_like_event_id() -> None:
    make_binding().validate_message_event(MESSAGE_KIND, bytearray(MESSAGE), [target_tag(TARGET)])


@pytest.mark.parametrize("kind", [1, WAKE_HINT_KIND, "9", 9.0, None])
def test_validate_message_event_rejects_wrong_kind(kind: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding().validate_message_event(kind, MESSAGE, [target_tag(TARGET)])  # type: ignore[arg-type]
    assert_field(excinfo, "kind")


def test_validate_message_event_rejects_wrong_event_id() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding().validate_message_event(MESSAGE_KIND, DEFINITION, [target_tag(TARGET)])
    assert_field(excinfo, "event_id")


def test_validate_message_event_rejects_malformed_event_id() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding().validate_message_event(MESSAGE_KIND, MESSAGE.hex(), [target_tag(TARGET)])  # type: ignore[arg-type]
    assert_field(excinfo, "event_id")


def test_validate_message_event_rejects_absent_target() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding().validate_message_event(MESSAGE_KIND, MESSAGE, [target_tag(OTHER_TARGET)])
    assert_field(excinfo, "target_pubkey")


def test_validate_message_event_does_not_count_a_plain_mention_as_target() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        make_binding().validate_message_event(MESSAGE_KIND, MESSAGE, [["p", TARGET.hex()]])
    assert_field(excinfo, "target_pubkey")


def test_validate_message_event_rejects_malformed_target_tags() -> None:
    tags = [target_tag(TARGET), ["p", OTHER_TARGET.hex(), MESSAGE_V1_MARKER]]
    with pytest.raises(ProtocolError) as excinfo:
        make_binding().validate_message_event(MESSAGE_KIND, MESSAGE, tags)
    assert_field(excinfo, "tags")


# Message targets


def test_message_targets_preserve_tag_order() -> None:
    third = b"\xff" * 32
    tags = [target_tag(OTHER_TARGET), target_tag(third), target_tag(TARGET)]
    assert message_v1_targets(MESSAGE_KIND, tags) == [OTHER_TARGET, third, TARGET]


def test_message_targets_ignore_ordinary_tags() -> None:
    tags = [
        ["p", TARGET.hex()],
        ["p", OTHER_TARGET.hex(), "wss://relay.example"],
        ["e", MESSAGE.hex(), "", "reply"],
        [MESSAGE_V1_MARKER, TARGET.hex()],
        [],
        target_tag(OTHER_TARGET),
    ]
    assert message_v1_targets(MESSAGE_KIND, tags) == [OTHER_TARGET]


def test_message_targets_of_a_message_without_targets_are_empty() -> None:
    assert message_v1_targets(MESSAGE_KIND, [["p", TARGET.hex()]]) == []
    assert message_v1_targets(MESSAGE_KIND, []) == []


@pytest.mark.parametrize("kind", [1, 0, WAKE_HINT_KIND, "9", 9.0, True, None])
def test_message_targets_reject_wrong_kind(kind: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(kind, [target_tag(TARGET)])  # type: ignore[arg-type]
    assert_field(excinfo, "kind")


def test_message_targets_reject_three_element_marker_tag() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(MESSAGE_KIND, [["p", TARGET.hex(), MESSAGE_V1_MARKER]])
    assert_field(excinfo, "tags")


def test_message_targets_reject_five_element_marker_tag() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(MESSAGE_KIND, [[*target_tag(TARGET), "extra"]])
    assert_field(excinfo, "tags")


def test_message_targets_reject_bad_key() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(MESSAGE_KIND, [["P", TARGET.hex(), "", MESSAGE_V1_MARKER]])
    assert_field(excinfo, "tags")


@pytest.mark.parametrize(
    "pubkey",
    [TARGET.hex()[:-2], TARGET.hex() + "00", "zz" + TARGET.hex()[2:], "", MESSAGE_V1_MARKER],
    ids=["short", "long", "non-hex", "empty", "marker"],
)
def test_message_targets_reject_bad_hex(pubkey: str) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(MESSAGE_KIND, [["p", pubkey, "", MESSAGE_V1_MARKER]])
    assert_field(excinfo, "tags")


def test_message_targets_reject_uppercase_hex() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(MESSAGE_KIND, [["p", "AB" * 32, "", MESSAGE_V1_MARKER]])
    assert_field(excinfo, "tags")


def test_message_targets_reject_repeated_target() -> None:
    tags = [target_tag(TARGET), target_tag(OTHER_TARGET), target_tag(TARGET)]
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(MESSAGE_KIND, tags)
    assert_field(excinfo, "tags")


def test_message_targets_reject_non_empty_relay_slot() -> None:
    tag = ["p", TARGET.hex(), "wss://relay.example", MESSAGE_V1_MARKER]
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(MESSAGE_KIND, [tag])
    assert_field(excinfo, "tags")


def test_message_targets_reject_marker_not_last() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(MESSAGE_KIND, [["p", TARGET.hex(), MESSAGE_V1_MARKER, ""]])
    assert_field(excinfo, "tags")


@pytest.mark.parametrize(
    "tags",
    [None, "p", {"p": TARGET.hex()}, [("p", TARGET.hex())], [["p", 1]], [None], [[None]]],
    ids=["none", "string", "dict", "tuple-tag", "int-element", "none-tag", "none-element"],
)
def test_message_targets_reject_tags_that_are_not_lists_of_strings(tags: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        message_v1_targets(MESSAGE_KIND, tags)  # type: ignore[arg-type]
    assert_field(excinfo, "tags")


# Wake hints


def test_wake_hint_parses_both_tag_orders() -> None:
    expected = WakeHint(TARGET, DELIVERY)
    assert WakeHint.parse(WAKE_HINT_KIND, "", wake_tags()) == expected
    assert WakeHint.parse(WAKE_HINT_KIND, "", wake_tags()[::-1]) == expected


def test_wake_hint_round_trips_through_its_tags() -> None:
    hint = WakeHint(bytearray(TARGET), str(DELIVERY))  # type: ignore[arg-type]
    assert hint.tags() == [["p", TARGET.hex()], ["delivery", str(DELIVERY)]]
    assert WakeHint.parse(WAKE_HINT_KIND, "", hint.tags()) == hint
    assert type(hint.target_pubkey) is bytes
    assert type(hint.delivery_id) is UUID


@pytest.mark.parametrize("kind", [MESSAGE_KIND, 24621, "24620", None, True])
def test_wake_hint_rejects_wrong_kind(kind: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint.parse(kind, "", wake_tags())  # type: ignore[arg-type]
    assert_field(excinfo, "kind")


@pytest.mark.parametrize("content", ["wake up", " ", None, b"", []])
def test_wake_hint_rejects_non_empty_content(content: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint.parse(WAKE_HINT_KIND, content, wake_tags())  # type: ignore[arg-type]
    assert_field(excinfo, "content")


@pytest.mark.parametrize("missing", ["p", "delivery"])
def test_wake_hint_rejects_missing_tag(missing: str) -> None:
    tags = [tag for tag in wake_tags() if tag[0] != missing]
    with pytest.raises(ProtocolError, match=missing) as excinfo:
        WakeHint.parse(WAKE_HINT_KIND, "", tags)
    assert_field(excinfo, "tags")


def test_wake_hint_rejects_no_tags() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint.parse(WAKE_HINT_KIND, "", [])
    assert_field(excinfo, "tags")


@pytest.mark.parametrize("repeated", [0, 1], ids=["p", "delivery"])
def test_wake_hint_rejects_repeated_tag(repeated: int) -> None:
    tags = wake_tags()
    tags.append(list(tags[repeated]))
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint.parse(WAKE_HINT_KIND, "", tags)
    assert_field(excinfo, "tags")


def test_wake_hint_rejects_repeated_tag_with_different_value() -> None:
    tags = [*wake_tags(), ["p", OTHER_TARGET.hex()]]
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint.parse(WAKE_HINT_KIND, "", tags)
    assert_field(excinfo, "tags")


@pytest.mark.parametrize("extra", [["e", MESSAGE.hex()], ["expiration", "1"], ["", ""]])
def test_wake_hint_rejects_unexpected_tag(extra: list[str]) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint.parse(WAKE_HINT_KIND, "", [*wake_tags(), extra])
    assert_field(excinfo, "tags")


@pytest.mark.parametrize(
    "tags",
    [
        [["p", TARGET.hex(), "wss://relay.example"], ["delivery", str(DELIVERY)]],
        [["p", TARGET.hex()], ["delivery", str(DELIVERY), ""]],
        [["p"], ["delivery", str(DELIVERY)]],
        [["p", TARGET.hex()], ["delivery", DELIVERY]],
        [["p", TARGET.hex()], None],
        "p",
        None,
    ],
    ids=["p-three", "delivery-three", "p-one", "uuid-object", "none-tag", "string", "none"],
)
def test_wake_hint_rejects_malformed_tags(tags: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint.parse(WAKE_HINT_KIND, "", tags)  # type: ignore[arg-type]
    assert_field(excinfo, "tags")


@pytest.mark.parametrize(
    "delivery",
    [
        str(DELIVERY).upper(),
        DELIVERY.hex,
        "{" + str(DELIVERY) + "}",
        DELIVERY.urn,
        str(DELIVERY)[:-1] + "g",
        "not-a-uuid",
    ],
    ids=["uppercase", "no-hyphens", "braces", "urn", "non-hex", "garbage"],
)
def test_wake_hint_rejects_malformed_uuid(delivery: str) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint.parse(WAKE_HINT_KIND, "", wake_tags(delivery=delivery))
    assert_field(excinfo, "delivery_id")


@pytest.mark.parametrize(
    "target", [TARGET.hex().upper(), TARGET.hex()[:-2], "x" * 64], ids=["upper", "short", "junk"]
)
def test_wake_hint_rejects_malformed_target(target: str) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint.parse(WAKE_HINT_KIND, "", wake_tags(target=target))
    assert_field(excinfo, "target_pubkey")


def test_wake_hint_constructor_validates_its_fields() -> None:
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint(TARGET[:31], DELIVERY)
    assert_field(excinfo, "target_pubkey")
    with pytest.raises(ProtocolError) as excinfo:
        WakeHint(TARGET, "nope")  # type: ignore[arg-type]
    assert_field(excinfo, "delivery_id")


def test_wake_hint_docstring_denies_authority() -> None:
    assert "never an authority" in (WakeHint.__doc__ or "")


# New deliveries, statuses and results


def test_new_delivery_normalises_its_id() -> None:
    new = NewDelivery(str(DELIVERY), make_binding())  # type: ignore[arg-type]
    assert new == NewDelivery(DELIVERY, make_binding())
    assert type(new.id) is UUID


@pytest.mark.parametrize("value", [str(DELIVERY).upper(), 1, b"\x00" * 16, ""])
def test_new_delivery_rejects_bad_id(value: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        NewDelivery(value, make_binding())  # type: ignore[arg-type]
    assert_field(excinfo, "id")


@pytest.mark.parametrize("binding", [None, dataclasses.asdict(make_binding()), "binding"])
def test_new_delivery_rejects_non_binding(binding: object) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        NewDelivery(DELIVERY, binding)  # type: ignore[arg-type]
    assert_field(excinfo, "binding")
    with pytest.raises(ProtocolError) as excinfo:
        NewDelivery(binding=binding)  # type: ignore[arg-type]
    assert_field(excinfo, "binding")


def test_new_delivery_without_an_id_gets_a_time_ordered_one() -> None:
    binding = make_binding()
    made = [NewDelivery(binding), NewDelivery(binding=binding), NewDelivery(None, binding)]
    made += [NewDelivery(binding) for _ in range(500)]
    assert {new.id.version for new in made} == {7}
    assert len({new.id for new in made}) == len(made)
    assert all(new.binding is binding for new in made)
    # Made in order, they sort in order, to the millisecond their first 48 bits hold.
    stamps = [new.id.int >> 80 for new in made]
    assert stamps == sorted(stamps)
    # The id a producer chose is kept as it is: a random one is accepted.
    chosen = uuid4()
    assert NewDelivery(chosen, binding).id == chosen
    assert NewDelivery(id=chosen, binding=binding).id == chosen
    assert NewDelivery(binding=binding, id=str(chosen)).id == chosen
    # A copy with another binding keeps the id (dataclasses.replace calls __init__).
    other = make_binding(step_id="other")
    assert dataclasses.replace(made[0], binding=other) == NewDelivery(made[0].id, other)


def test_only_finished_and_failed_are_terminal() -> None:
    assert {status for status in DeliveryStatus if status.is_terminal} == {
        DeliveryStatus.FINISHED,
        DeliveryStatus.FAILED,
    }
    assert [status.value for status in DeliveryStatus] == [
        "pending",
        "claimed",
        "finished",
        "failed",
    ]


def test_every_outcome_is_a_terminal_status() -> None:
    assert [outcome.value for outcome in Outcome] == ["finished", "failed"]
    assert all(DeliveryStatus(outcome).is_terminal for outcome in Outcome)


def test_results_are_values() -> None:
    assert LeaseLost() == LeaseLost()
    assert Settled(Outcome.FAILED) != Settled(Outcome.FINISHED)
    assert AlreadyTerminal(DeliveryStatus.FINISHED) != Settled(Outcome.FINISHED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settled(Outcome.FAILED).outcome = Outcome.FINISHED  # type: ignore[misc]


def test_a_new_delivery_id_is_a_version_7_uuid_that_grows_with_time(monkeypatch) -> None:
    ids = [new_delivery_id() for _ in range(2000)]
    assert len(set(ids)) == 2000
    assert {value.version for value in ids} == {7}
    assert {value.variant for value in ids} == {"specified in RFC 4122"}
    instants = iter([1_800_000_000_000_000_000, 1_800_000_000_001_000_000])
    monkeypatch.setattr(protocol.time, "time_ns", lambda: next(instants))
    earlier, later = new_delivery_id(), new_delivery_id()
    assert earlier < later
    # The first 48 bits are the Unix time in milliseconds.
    assert earlier.int >> 80 == 1_800_000_000_000
    assert later.int >> 80 == 1_800_000_000_001
    # A freshly made id passes every check a producer's id goes through.
    assert NewDelivery(earlier, make_binding()).id is earlier
