"""The agent API's statements: a request's admission (freshness, replay guard, the
key's standing), each served operation admitted and run in one statement (claim,
renew, finish, finish and claim the next), and the claim of a waiting request.

The operations are the holder's, built from the same ``fragments``.
"""

from __future__ import annotations

from ..statement import Statement
from .fragments import (
    BY_ID,
    CAUSES,
    CLAIMED_RECORD,
    COMMUNITIES,
    EVENTS,
    EXPECTED,
    REPLAYS,
    TERMINAL,
    claiming,
    renew_live_lease,
    seen_status,
    settle_and_claim,
    settle_live_lease,
    trying_fence,
)

# Whether the event is fresh: its created_at within ``skew`` seconds of the
# database's clock.
_CLOCK = """clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
)"""


def _recording(community: str, source: str, answer: str) -> str:
    """The replay guard's insert: the request's event recorded for ``community`` from
    the rows of ``source`` (a FROM list with its conditions), once: ON CONFLICT makes a
    second arrival of the same event insert nothing. Answers ``answer`` per row
    recorded."""
    return f"""    INSERT INTO {REPLAYS} (community_id, event_id, event_created_at)
    SELECT {community}, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM {source}
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING {answer}"""


# The agent API's admission of a request named by its Host: the community whose host
# it is (any case, by wd_community_host_ci_key), where the signing key stands in its
# roster, the freshness by the database clock and the replay guard (ON CONFLICT makes a
# second arrival of the same event, from any process, at the same instant, for any
# community, insert nothing), in one round trip. The standing is read under the
# roster's shared lock (wd_agent_standing, through wd_lock_roster_shared), held to the
# end of the request's transaction, so a revocation waits for the key's requests in
# flight.
# The community's shared deletion lock is only tried, never waited for: while its
# deletion executor holds the exclusive lock (or waits for it), the standing is
# ``ADMISSION_DELETING`` and nothing is recorded, so a request of a community being
# deleted holds no server thread. Only an enabled agent's fresh event is recorded.
# Answers (community id or NULL, fresh, recorded, standing or ADMISSION_DELETING or
# NULL); an unknown host records nothing.
# Parameters: ``created_at``, ``skew`` (the freshness window), ``host``, ``pubkey``,
# ``event_id``.
ADMISSION_DELETING = "deleting"
_ENABLED_AGENTS_EVENT = _recording(
    "community.id",
    "community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'",
    "community_id",
)
_ADMISSION_CTES = f"""
WITH {_CLOCK}, community AS (
    SELECT id FROM {COMMUNITIES} WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, {trying_fence("id")} AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE '{ADMISSION_DELETING}' END AS standing
      FROM gate
), recorded AS (
{_ENABLED_AGENTS_EVENT}
)"""
ADMIT_REQUEST_EVENT = Statement(f"""{_ADMISSION_CTES}
SELECT (SELECT id FROM community), clock.fresh, EXISTS (SELECT 1 FROM recorded),
       (SELECT standing FROM agent)
  FROM clock
""")


# The agent API's requests, each admitted and served by one statement in autocommit
# (``services.holder``'s ``*_admitted`` functions): ADMIT_REQUEST_EVENT's look-ups,
# freshness and replay guard, then the holder's operation, built from the same
# fragments as the in-process one (``claiming``, ``renew_live_lease``,
# ``settle_live_lease``, ``seen_status``), on the community the replay row was
# recorded for, the caller's key as the target (nothing runs when the request was
# not admitted). The statement is its own
# transaction, so the replay row commits with the operation or not at all; an
# operation that refuses calls wd_refuse_request (``_REFUSE``), whose error
# (``REQUEST_REFUSED``) rolls back both. Parameters: the admission's, then the
# operation's. Every answer row starts with the admission (community id or NULL,
# fresh, recorded, standing or NULL).
def _admitted(operation: str, answer: str) -> Statement:
    return Statement(f"""{_ADMISSION_CTES}, admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), {operation}
{answer}
""")


_ADMISSION = "a.community_id, a.fresh, a.recorded, a.standing"
_ADMITTED_COMMUNITY = "(SELECT community_id FROM recorded)"
_CALLER = "%(pubkey)s"
# Raises ``errors.REQUEST_REFUSED``: the request's statement rolls back as a whole.
_REFUSE = "wd_refuse_request('lease_lost')"

# A claimed row ``n``'s message event (the event's columns NULL when the event is not
# stored), read as ``protocol.stored_message`` takes them.
_MESSAGE_COLUMNS = (
    "e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL"
)
_MESSAGE_OF_CLAIMED = f"""LEFT JOIN {EVENTS} AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id"""


# A settle's answer on an admitted request: the status settled, and for a lease that
# settled nothing the row as the caller's capability sees it (``seen_status``). A terminal
# row answers its status (a retry of a settle); anything else refuses (``lease_lost``).
_SERVED_SEEN = f"""seen AS (
    SELECT a.recorded, s.status AS settled,
           {seen_status("a.community_id", _CALLER, "a.recorded AND s.status IS NULL")} AS status
      FROM admission AS a LEFT JOIN settled AS s ON true
)"""
_REFUSE_UNLESS_SETTLED = f"""CASE WHEN seen.recorded AND seen.settled IS NULL
                 AND (seen.status IS NULL OR seen.status NOT IN {TERMINAL})
            THEN {_REFUSE} END"""


def _served_claim(match: str = "", limit: str = "%(limit)s") -> Statement:
    """The holder's claim (``holder._claim_statement``) of the caller's oldest claimable
    deliveries that meet ``match``, up to ``limit``, each answered with its record and
    its message; one row of admission alone when nothing was claimed. Parameters after
    the admission's: ``lease_seconds``, ``limit`` and ``match``'s."""
    return _admitted(
        claiming(_ADMITTED_COMMUNITY, _CALLER, match, limit),
        f"""SELECT {_ADMISSION}, {CLAIMED_RECORD}, {_MESSAGE_COLUMNS}
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  {_MESSAGE_OF_CLAIMED}""",
    )


# The claim in the holder's shapes (CLAIM_BATCH's with a limit, a limit of 1 being the
# single claim; CLAIM_BY_ID's; CLAIM_EXPECTED's and CLAIM_BY_ID_EXPECTED's by cause).
SERVED_CLAIM = _served_claim()
SERVED_CLAIM_BY_ID = _served_claim(BY_ID, limit="1")
SERVED_CLAIM_EXPECTED = {
    cause: _served_claim(EXPECTED.format(cause=cause), limit="1") for cause in CAUSES
}
SERVED_CLAIM_BY_ID_EXPECTED = {
    cause: _served_claim(BY_ID + EXPECTED.format(cause=cause), limit="1") for cause in CAUSES
}

# Renew the caller's live lease (RENEW); a lost one refuses (``lease_lost``).
# Parameters after the admission's: ``lease_seconds``, ``delivery_id``,
# ``generation``. Answers the admission and the new lease_until.
SERVED_RENEW = _admitted(
    f"""renewed AS (
{renew_live_lease(_ADMITTED_COMMUNITY, _CALLER)}
)""",
    f"""SELECT {_ADMISSION}, r.lease_until,
       CASE WHEN a.recorded AND r.lease_until IS NULL THEN {_REFUSE} END
  FROM admission AS a LEFT JOIN renewed AS r ON true""",
)

# Settle the caller's live lease once (FINISH), answered as ``_SERVED_SEEN``.
# Parameters after the admission's: ``outcome``, ``delivery_id``, ``generation``.
# Answers the admission, the settled status, the status seen.
SERVED_FINISH = _admitted(
    f"""settled AS (
{settle_live_lease(_ADMITTED_COMMUNITY, _CALLER)}
), {_SERVED_SEEN}""",
    f"""SELECT {_ADMISSION}, seen.settled, seen.status, {_REFUSE_UNLESS_SETTLED}
  FROM admission AS a, seen""",
)

# Settle the caller's live lease once and claim the caller's oldest claimable
# delivery with it: the holder's settle-and-claim (``settle_and_claim``), answered
# as SERVED_FINISH (a settle that did not happen claims nothing). Parameters after
# the admission's: ``outcome``, ``delivery_id``, ``generation``, ``lease_seconds``.
# Answers the admission, the settled status, the status seen, the refusal's column,
# then the claimed record and its message (NULL when nothing was claimed).
SERVED_FINISH_AND_CLAIM_NEXT = _admitted(
    f"""{settle_and_claim(_ADMITTED_COMMUNITY, _CALLER, _CALLER, error=False)},
{_SERVED_SEEN}""",
    f"""SELECT {_ADMISSION}, seen.settled, seen.status, {_REFUSE_UNLESS_SETTLED},
       {CLAIMED_RECORD}, {_MESSAGE_COLUMNS}
  FROM admission AS a CROSS JOIN seen
  LEFT JOIN claimed AS n ON true
  {_MESSAGE_OF_CLAIMED}""",
)

# The claim of a request admitted earlier (a waiting claim, after its wake-up): the
# single claim of the key's oldest claimable delivery, with its message, only while
# the key is an enabled agent of the community. The standing is read once, as a gate
# before the scan, under the roster's shared lock (``wd_agent_standing``), held to
# the end of the statement's transaction: a revocation waits for the claim, and a
# claim after a revocation takes nothing. Parameters: ``community_id``,
# ``target_pubkey``, ``lease_seconds``. Answers the claimed record and its message,
# no row when nothing was claimed.
_ENROLLED = (
    "(SELECT wd_agent_standing(%(community_id)s::uuid, %(target_pubkey)s::bytea)) = 'enabled' AND "
)
CLAIM_ENROLLED = Statement(f"""
WITH {claiming("%(community_id)s", "%(target_pubkey)s", gate=_ENROLLED)}
SELECT {CLAIMED_RECORD}, {_MESSAGE_COLUMNS}
  FROM claimed AS n
  {_MESSAGE_OF_CLAIMED}
""")
