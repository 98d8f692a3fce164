"""Fuzzing the protocol: any input gives a valid value or a ProtocolError; valid ones round-trip."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta, timezone
from uuid import UUID

from hypothesis import given, settings
from hypothesis import strategies as st

from workflow_delivery.protocol import (
    MESSAGE_KIND,
    MESSAGE_V1_MARKER,
    WAKE_HINT_KIND,
    CauseKind,
    DeliveryBinding,
    EventCause,
    ProtocolError,
    ScheduleCause,
    WakeHint,
    WebhookCause,
    message_v1_targets,
)

fuzz = settings(max_examples=200, deadline=None)

BINDING_FIELDS = [field.name for field in dataclasses.fields(DeliveryBinding)]

bytes32 = st.binary(min_size=32, max_size=32)
hex64 = bytes32.map(bytes.hex)
uuids = st.uuids()
canonical_uuids = uuids.map(str)

words = st.sampled_from(["", "p", "P", "e", "delivery", MESSAGE_V1_MARKER, "\x00", " ", "\ud800"])
near_hex = st.one_of(
    hex64,
    hex64.map(str.upper),
    st.text("0123456789abcdefABCDEFg", min_size=62, max_size=66),
)
near_uuid = st.one_of(
    canonical_uuids,
    canonical_uuids.map(str.upper),
    uuids.map(lambda value: value.hex),
    uuids.map(lambda value: value.urn),
    st.text("0123456789abcdef-", min_size=35, max_size=37),
)
tag_items = st.one_of(words, near_hex, near_uuid, st.text(max_size=8))

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=40),
    words,
    uuids,
    st.datetimes(),
)
junk = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=3), children, max_size=3),
    ),
    max_leaves=15,
)

kinds = st.one_of(st.sampled_from([MESSAGE_KIND, WAKE_HINT_KIND]), st.integers(), junk)

target_tags = hex64.map(lambda pubkey: ["p", pubkey, "", MESSAGE_V1_MARKER])
string_tags = st.lists(tag_items, max_size=5)
marker_tags = st.lists(tag_items, min_size=1, max_size=5).flatmap(
    lambda items: st.permutations([*items, MESSAGE_V1_MARKER])
)
message_tags = st.one_of(
    st.lists(st.one_of(target_tags, string_tags, marker_tags, junk), max_size=6), junk
)

wake_p_tags = st.one_of(hex64, near_hex).map(lambda pubkey: ["p", pubkey])
wake_delivery_tags = st.one_of(canonical_uuids, near_uuid).map(lambda value: ["delivery", value])
wake_tags = st.one_of(
    st.lists(st.one_of(wake_p_tags, wake_delivery_tags, string_tags, junk), max_size=4), junk
)
contents = st.one_of(st.just(""), st.text(max_size=5), junk)

offsets = st.timedeltas(
    min_value=-timedelta(hours=23, minutes=59), max_value=timedelta(hours=23, minutes=59)
)
timezones = st.one_of(st.none(), st.just(UTC), offsets.map(timezone))
instants = st.datetimes(timezones=timezones)
whole_second_instants = st.datetimes(timezones=st.just(UTC)).map(
    lambda value: value.replace(microsecond=0)
)

valid_causes = st.one_of(
    bytes32.map(EventCause),
    whole_second_instants.map(ScheduleCause),
    uuids.map(WebhookCause),
)
non_nil_uuids = uuids.filter(lambda value: value.int != 0)
step_ids = st.text(
    st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=64
).filter(lambda value: not value.isspace())


def bytes_like(data: bytes) -> st.SearchStrategy[object]:
    return st.sampled_from([data, bytearray(data), memoryview(data)])


uuid_values = st.one_of(uuids, near_uuid, st.just(UUID(int=0)), junk)
step_values = st.one_of(
    step_ids,
    st.text(max_size=70),
    words,
    st.text(st.characters(categories=["Cs"]), max_size=3),
    junk,
)
bytes_values = st.one_of(
    bytes32, st.binary(min_size=30, max_size=34).flatmap(bytes_like), hex64, junk
)
cause_values = st.one_of(valid_causes, st.sampled_from(list(CauseKind)), junk)
binding_values = {
    "community_id": uuid_values,
    "workflow_id": uuid_values,
    "run_id": uuid_values,
    "step_id": step_values,
    "target_pubkey": bytes_values,
    "definition_event_id": bytes_values,
    "message_event_id": bytes_values,
    "cause": cause_values,
}

valid_bindings = st.builds(
    DeliveryBinding,
    community_id=non_nil_uuids,
    workflow_id=uuids,
    run_id=uuids,
    step_id=step_ids,
    target_pubkey=bytes32,
    definition_event_id=bytes32,
    message_event_id=bytes32,
    cause=valid_causes,
)


def assert_normalised(binding: DeliveryBinding) -> None:
    assert type(binding.community_id) is UUID and binding.community_id.int != 0
    assert type(binding.workflow_id) is UUID
    assert type(binding.run_id) is UUID
    assert isinstance(binding.step_id, str) and 1 <= len(binding.step_id) <= 64
    assert not binding.step_id.isspace() and "\x00" not in binding.step_id
    assert binding.step_id.encode("utf-8").decode("utf-8") == binding.step_id
    for name in ("target_pubkey", "definition_event_id", "message_event_id"):
        value = getattr(binding, name)
        assert type(value) is bytes and len(value) == 32
    assert isinstance(binding.cause, EventCause | ScheduleCause | WebhookCause)


@fuzz
@given(kind=kinds, tags=message_tags)
def test_message_targets_return_targets_or_raise_protocol_error(kind: object, tags: object) -> None:
    try:
        targets = message_v1_targets(kind, tags)  # type: ignore[arg-type]
    except ProtocolError as error:
        assert error.field in {"kind", "tags"}
        return
    assert type(kind) is int and kind == MESSAGE_KIND
    marked = [tag for tag in tags if MESSAGE_V1_MARKER in tag[1:]]  # type: ignore[union-attr]
    assert all(tag == ["p", tag[1], "", MESSAGE_V1_MARKER] for tag in marked)
    assert targets == [bytes.fromhex(tag[1]) for tag in marked]
    assert len(set(targets)) == len(targets)


@fuzz
@given(
    targets=st.lists(bytes32, unique=True, max_size=6),
    noise=st.lists(st.one_of(hex64.map(lambda pubkey: ["p", pubkey]), string_tags), max_size=6),
    data=st.data(),
)
def test_message_targets_find_every_target_among_ordinary_tags(
    targets: list[bytes], noise: list[list[str]], data: st.DataObject
) -> None:
    noise = [tag for tag in noise if MESSAGE_V1_MARKER not in tag[1:]]
    tags = [["p", target.hex(), "", MESSAGE_V1_MARKER] for target in targets]
    for tag in noise:
        tags.insert(data.draw(st.integers(0, len(tags)), label="position"), tag)
    assert message_v1_targets(MESSAGE_KIND, tags) == targets


@fuzz
@given(kind=kinds, content=contents, tags=wake_tags)
def test_wake_hint_parse_returns_hint_or_raises_protocol_error(
    kind: object, content: object, tags: object
) -> None:
    try:
        hint = WakeHint.parse(kind, content, tags)  # type: ignore[arg-type]
    except ProtocolError as error:
        assert error.field in {"kind", "content", "tags", "target_pubkey", "delivery_id"}
        return
    assert kind == WAKE_HINT_KIND and content == ""
    assert sorted(hint.tags()) == sorted(tags)  # type: ignore[arg-type]
    assert type(hint.target_pubkey) is bytes and type(hint.delivery_id) is UUID


@fuzz
@given(target=bytes32, delivery=uuids, swap=st.booleans())
def test_wake_hint_round_trips(target: bytes, delivery: UUID, swap: bool) -> None:
    hint = WakeHint(target, delivery)
    tags = hint.tags()
    assert WakeHint.parse(WAKE_HINT_KIND, "", tags[::-1] if swap else tags) == hint
    assert WakeHint(bytearray(target), str(delivery)) == hint  # type: ignore[arg-type]


@fuzz
@given(target=junk, delivery=junk)
def test_wake_hint_constructor_returns_hint_or_raises_protocol_error(
    target: object, delivery: object
) -> None:
    try:
        hint = WakeHint(target, delivery)  # type: ignore[arg-type]
    except ProtocolError as error:
        assert error.field in {"target_pubkey", "delivery_id"}
        return
    assert WakeHint.parse(WAKE_HINT_KIND, "", hint.tags()) == hint


@fuzz
@given(st.fixed_dictionaries(binding_values))
def test_binding_constructor_returns_binding_or_raises_protocol_error(
    values: dict[str, object],
) -> None:
    try:
        binding = DeliveryBinding(**values)  # type: ignore[arg-type]
    except ProtocolError as error:
        assert error.field in BINDING_FIELDS
        return
    assert_normalised(binding)


@fuzz
@given(binding=valid_bindings, field=st.sampled_from(BINDING_FIELDS), data=st.data())
def test_one_fuzzed_field_is_accepted_or_named(
    binding: DeliveryBinding, field: str, data: st.DataObject
) -> None:
    value = data.draw(binding_values[field], label=field)
    try:
        changed = dataclasses.replace(binding, **{field: value})
    except ProtocolError as error:
        assert error.field == field
        return
    assert_normalised(changed)


@fuzz
@given(event_id=bytes_values, invocation=uuid_values)
def test_event_and_webhook_causes_return_cause_or_raise_protocol_error(
    event_id: object, invocation: object
) -> None:
    try:
        cause = EventCause(event_id)  # type: ignore[arg-type]
    except ProtocolError as error:
        assert error.field == "event_id"
    else:
        assert cause.event_id == bytes(event_id) and len(cause.event_id) == 32  # type: ignore[call-overload]
    try:
        webhook = WebhookCause(invocation)  # type: ignore[arg-type]
    except ProtocolError as error:
        assert error.field == "invocation_id"
    else:
        assert type(webhook.invocation_id) is UUID
        assert str(webhook.invocation_id) in (invocation, str(invocation))


@fuzz
@given(scheduled_for=st.one_of(instants, junk))
def test_schedule_cause_returns_utc_whole_seconds_or_raises_protocol_error(
    scheduled_for: object,
) -> None:
    try:
        cause = ScheduleCause(scheduled_for)  # type: ignore[arg-type]
    except ProtocolError as error:
        assert error.field == "scheduled_for"
        return
    assert isinstance(scheduled_for, datetime) and scheduled_for.utcoffset() is not None
    assert cause.scheduled_for == scheduled_for
    assert cause.scheduled_for.tzinfo is UTC and cause.scheduled_for.microsecond == 0


@fuzz
@given(binding=valid_bindings, data=st.data())
def test_valid_binding_round_trips_through_other_spellings(
    binding: DeliveryBinding, data: st.DataObject
) -> None:
    assert_normalised(binding)
    respelled = DeliveryBinding(
        community_id=str(binding.community_id),  # type: ignore[arg-type]
        workflow_id=str(binding.workflow_id),  # type: ignore[arg-type]
        run_id=data.draw(st.sampled_from([binding.run_id, str(binding.run_id)])),  # type: ignore[arg-type]
        step_id=binding.step_id,
        target_pubkey=data.draw(bytes_like(binding.target_pubkey)),  # type: ignore[arg-type]
        definition_event_id=bytearray(binding.definition_event_id),
        message_event_id=memoryview(binding.message_event_id),
        cause=binding.cause,
    )
    assert respelled == binding
    assert hash(respelled) == hash(binding)
    assert dataclasses.replace(binding) == binding


@fuzz
@given(binding=valid_bindings, other=valid_bindings, field=st.sampled_from(BINDING_FIELDS))
def test_binding_differing_in_one_field_is_not_equal(
    binding: DeliveryBinding, other: DeliveryBinding, field: str
) -> None:
    changed = dataclasses.replace(binding, **{field: getattr(other, field)})
    assert (changed == binding) == (getattr(other, field) == getattr(binding, field))


@fuzz
@given(binding=valid_bindings, others=st.lists(bytes32, max_size=4), data=st.data())
def test_valid_binding_accepts_its_own_message_event(
    binding: DeliveryBinding, others: list[bytes], data: st.DataObject
) -> None:
    targets = list(dict.fromkeys([*others, binding.target_pubkey]))
    order = data.draw(st.permutations(targets))
    tags = [["p", target.hex(), "", MESSAGE_V1_MARKER] for target in order]
    binding.validate_message_event(MESSAGE_KIND, binding.message_event_id, tags)


@fuzz
@given(binding=valid_bindings, kind=kinds, event_id=bytes_values, tags=message_tags)
def test_validate_message_event_passes_or_raises_protocol_error(
    binding: DeliveryBinding, kind: object, event_id: object, tags: object
) -> None:
    try:
        binding.validate_message_event(kind, event_id, tags)  # type: ignore[arg-type]
    except ProtocolError as error:
        assert error.field in {"kind", "event_id", "tags", "target_pubkey"}
        return
    assert kind == MESSAGE_KIND
    assert bytes(event_id) == binding.message_event_id  # type: ignore[call-overload]
    assert binding.target_pubkey in message_v1_targets(MESSAGE_KIND, tags)  # type: ignore[arg-type]
