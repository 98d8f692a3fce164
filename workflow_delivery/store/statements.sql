-- Generated from workflow_delivery.store.statements by scripts/dump_statements;
-- do not edit. Every final statement, under its name, in name order.

-- name: ADMIT_REQUEST_EVENT --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
)
SELECT (SELECT id FROM community), clock.fresh, EXISTS (SELECT 1 FROM recorded),
       (SELECT standing FROM agent)
  FROM clock;

-- name: CLAIM --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)

UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at";

-- name: CLAIM_BATCH --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT %(limit)s
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)

UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at";

-- name: CLAIM_BY_ID --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND id = %(delivery_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)

UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at";

-- name: CLAIM_BY_ID_EXPECTED[cause_event_id] --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND id = %(delivery_id)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_event_id = %(cause_event_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)

UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at";

-- name: CLAIM_BY_ID_EXPECTED[cause_scheduled_for] --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND id = %(delivery_id)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_scheduled_for = %(cause_scheduled_for)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)

UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at";

-- name: CLAIM_BY_ID_EXPECTED[cause_webhook_invocation_id] --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND id = %(delivery_id)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_webhook_invocation_id = %(cause_webhook_invocation_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)

UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at";

-- name: CLAIM_ENROLLED --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE (SELECT wd_agent_standing(%(community_id)s::uuid, %(target_pubkey)s::bytea)) = 'enabled' AND community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM claimed AS n
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: CLAIM_EXPECTED[cause_event_id] --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_event_id = %(cause_event_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)

UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at";

-- name: CLAIM_EXPECTED[cause_scheduled_for] --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_scheduled_for = %(cause_scheduled_for)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)

UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at";

-- name: CLAIM_EXPECTED[cause_webhook_invocation_id] --
WITH picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = %(community_id)s AND target_pubkey = %(target_pubkey)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_webhook_invocation_id = %(cause_webhook_invocation_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken)

UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at";

-- name: COMMUNITY_FENCE_STATE --
SELECT deletion_state, deletion_fence_generation FROM "communities" WHERE id = %(community_id)s
   FOR NO KEY UPDATE;

-- name: COMMUNITY_WRITE_ALLOWED --
SELECT community_write_allowed(%(community_id)s::uuid);

-- name: CURRENT_ROLE --
SELECT current_user;

-- name: ENROLL_AGENTS --
INSERT INTO "community_agents" AS a (community_id, pubkey, label)
SELECT %(community_id)s::uuid, k.pubkey, coalesce(%(label)s::text, '')
  FROM unnest(%(pubkeys)s::bytea[]) AS k (pubkey)
ON CONFLICT ON CONSTRAINT wd_agent_key
DO UPDATE SET label = coalesce(%(label)s::text, a.label)
RETURNING a.community_id, a.pubkey, a.label, a.enabled, a.added_at, a.revoked_at;

-- name: FAIL_WITH_ERROR --
WITH note AS MATERIALIZED (SELECT set_config('workflow_delivery.error_traceback', %(traceback)s, true) AS traceback)
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'failed', finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL, last_error_type = %(error_type)s, last_error_message = %(error_message)s, last_error_at = statement_timestamp()
  FROM note
 WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING d.status;

-- name: FAIL_WITH_ERROR_AND_CLAIM_NEXT --
WITH note AS MATERIALIZED (SELECT set_config('workflow_delivery.error_traceback', %(traceback)s, true) AS traceback),
settled AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'failed', finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL, last_error_type = %(error_type)s, last_error_message = %(error_message)s, last_error_at = statement_timestamp()
  FROM note
 WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING d.status
),
picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE EXISTS (SELECT 1 FROM settled) AND community_id = %(community_id)s AND target_pubkey = %(next_target_pubkey)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT s.status,
       (SELECT c.status FROM "workflow_agent_deliveries" AS c WHERE s.status IS NULL AND 
  c.community_id = %(community_id)s AND c.id = %(delivery_id)s
  AND c.target_pubkey = %(target_pubkey)s AND c.lease_generation = %(generation)s
 FOR SHARE),
       n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at"
  FROM (SELECT 1) AS one
  LEFT JOIN settled AS s ON true
  LEFT JOIN claimed AS n ON true;

-- name: FINISH --
UPDATE "workflow_agent_deliveries" AS d
   SET status = %(outcome)s, finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL
 WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING d.status;

-- name: FINISH_AND_CLAIM_NEXT --
WITH settled AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = %(outcome)s, finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL
 WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING d.status
),
picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE EXISTS (SELECT 1 FROM settled) AND community_id = %(community_id)s AND target_pubkey = %(next_target_pubkey)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT s.status,
       (SELECT c.status FROM "workflow_agent_deliveries" AS c WHERE s.status IS NULL AND 
  c.community_id = %(community_id)s AND c.id = %(delivery_id)s
  AND c.target_pubkey = %(target_pubkey)s AND c.lease_generation = %(generation)s
 FOR SHARE),
       n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at"
  FROM (SELECT 1) AS one
  LEFT JOIN settled AS s ON true
  LEFT JOIN claimed AS n ON true;

-- name: FINISH_BATCH --
WITH leases AS (
    SELECT * FROM unnest(%(community_ids)s::uuid[], %(delivery_ids)s::uuid[],
                         %(target_pubkeys)s::bytea[], %(generations)s::bigint[],
                         %(outcomes)s::text[])
           WITH ORDINALITY AS l (community_id, id, target_pubkey, lease_generation, outcome, n)
),
settled AS (
    UPDATE "workflow_agent_deliveries" AS d
       SET status = l.outcome, finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL
      FROM leases AS l
     WHERE 
  d.community_id = l.community_id AND d.id = l.id
  AND d.target_pubkey = l.target_pubkey AND d.lease_generation = l.lease_generation

  AND d.status = 'claimed' AND d.lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || d.community_id::text, 0)) IS NOT NULL

    RETURNING l.n
)
SELECT l.n, s.n IS NOT NULL,
       (SELECT c.status FROM "workflow_agent_deliveries" AS c WHERE s.n IS NULL AND 
  c.community_id = l.community_id AND c.id = l.id
  AND c.target_pubkey = l.target_pubkey AND c.lease_generation = l.lease_generation
 FOR SHARE)
  FROM leases AS l LEFT JOIN settled AS s ON s.n = l.n;

-- name: HEARTBEAT_RENEW --
UPDATE "workflow_agent_deliveries"
   SET lease_until = statement_timestamp() + make_interval(secs => %(lease_seconds)s)
 WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL
  AND (SELECT set_config('lock_timeout', %(lock_timeout)s, true)) IS NOT NULL
RETURNING lease_until;

-- name: HELD_FINISH --
UPDATE "workflow_agent_deliveries"
   SET status = %(outcome)s, finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL
 WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()

RETURNING status;

-- name: HELD_LIVE --
SELECT lease_until FROM "workflow_agent_deliveries" WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp();

-- name: HOLD_LOCK --
SELECT lease_until FROM "workflow_agent_deliveries" WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL
   FOR UPDATE;

-- name: INSERT_DELIVERIES --
WITH fence AS MATERIALIZED (SELECT wd_require_community_write(%(community)s::uuid, 'INSERT', 'workflow_agent_deliveries', current_schema())::text AS fenced )
INSERT INTO "workflow_agent_deliveries" ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")
SELECT v.* FROM (SELECT * FROM unnest(%(id)s::uuid[], %(community_id)s::uuid[], %(workflow_id)s::uuid[], %(run_id)s::uuid[], %(step_id)s::text[], %(target_pubkey)s::bytea[], %(definition_event_id)s::bytea[], %(message_event_id)s::bytea[], %(message_event_created_at)s::timestamptz[], %(cause_kind)s::text[], %(cause_event_id)s::bytea[], %(cause_scheduled_for)s::timestamptz[], %(cause_webhook_invocation_id)s::uuid[]) AS v ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")) AS v CROSS JOIN fence
ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING RETURNING id, community_id, target_pubkey;

-- name: INSERT_SHARED_DELIVERIES --
WITH fence AS MATERIALIZED (SELECT wd_require_community_write(%(community)s::uuid, 'INSERT', 'workflow_agent_deliveries', current_schema())::text AS fenced )
INSERT INTO "workflow_agent_deliveries" ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")
SELECT v.* FROM (SELECT v."id", s."community_id", s."workflow_id", s."run_id", s."step_id", v."target_pubkey", s."definition_event_id", s."message_event_id", s."message_event_created_at", s."cause_kind", s."cause_event_id", s."cause_scheduled_for", s."cause_webhook_invocation_id" FROM (SELECT %(community_id)s::uuid AS "community_id", %(workflow_id)s::uuid AS "workflow_id", %(run_id)s::uuid AS "run_id", %(step_id)s::text AS "step_id", %(definition_event_id)s::bytea AS "definition_event_id", %(message_event_id)s::bytea AS "message_event_id", %(message_event_created_at)s::timestamptz AS "message_event_created_at", %(cause_kind)s::text AS "cause_kind", %(cause_event_id)s::bytea AS "cause_event_id", %(cause_scheduled_for)s::timestamptz AS "cause_scheduled_for", %(cause_webhook_invocation_id)s::uuid AS "cause_webhook_invocation_id") AS s CROSS JOIN unnest(%(id)s::uuid[], %(target_pubkey)s::bytea[]) AS v ("id", "target_pubkey")) AS v CROSS JOIN fence
ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING RETURNING id, community_id, target_pubkey;

-- name: KEEP_AGENT_TURN --
INSERT INTO "workflow_delivery_agent_turns"
    (community_id, delivery_id, attempts, generation, outcome, stop_reason, text,
     said_bytes, tool_calls, permissions)
VALUES (%(community_id)s::uuid, %(delivery_id)s::uuid, %(attempts)s, %(generation)s,
        %(outcome)s, %(stop_reason)s, %(text)s, %(said_bytes)s, %(tool_calls)s::jsonb,
        %(permissions)s::jsonb);

-- name: LOCK_AND_INSERT_DELIVERIES --
WITH step_lock AS MATERIALIZED (SELECT pg_advisory_xact_lock(hashtextextended(
           'workflow_delivery.delivery_identity:' || %(community)s::text || ':'
           || %(run)s::text || ':' || %(step)s, 0))::text AS locked),
fence AS MATERIALIZED (SELECT wd_require_community_write(%(community)s::uuid, 'INSERT', 'workflow_agent_deliveries', current_schema())::text AS fenced FROM step_lock)
INSERT INTO "workflow_agent_deliveries" ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")
SELECT v.* FROM (SELECT * FROM unnest(%(id)s::uuid[], %(community_id)s::uuid[], %(workflow_id)s::uuid[], %(run_id)s::uuid[], %(step_id)s::text[], %(target_pubkey)s::bytea[], %(definition_event_id)s::bytea[], %(message_event_id)s::bytea[], %(message_event_created_at)s::timestamptz[], %(cause_kind)s::text[], %(cause_event_id)s::bytea[], %(cause_scheduled_for)s::timestamptz[], %(cause_webhook_invocation_id)s::uuid[]) AS v ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")) AS v CROSS JOIN fence
ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING RETURNING id, community_id, target_pubkey;

-- name: LOCK_AND_INSERT_SHARED_DELIVERIES --
WITH step_lock AS MATERIALIZED (SELECT pg_advisory_xact_lock(hashtextextended(
           'workflow_delivery.delivery_identity:' || %(community)s::text || ':'
           || %(run)s::text || ':' || %(step)s, 0))::text AS locked),
fence AS MATERIALIZED (SELECT wd_require_community_write(%(community)s::uuid, 'INSERT', 'workflow_agent_deliveries', current_schema())::text AS fenced FROM step_lock)
INSERT INTO "workflow_agent_deliveries" ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")
SELECT v.* FROM (SELECT v."id", s."community_id", s."workflow_id", s."run_id", s."step_id", v."target_pubkey", s."definition_event_id", s."message_event_id", s."message_event_created_at", s."cause_kind", s."cause_event_id", s."cause_scheduled_for", s."cause_webhook_invocation_id" FROM (SELECT %(community_id)s::uuid AS "community_id", %(workflow_id)s::uuid AS "workflow_id", %(run_id)s::uuid AS "run_id", %(step_id)s::text AS "step_id", %(definition_event_id)s::bytea AS "definition_event_id", %(message_event_id)s::bytea AS "message_event_id", %(message_event_created_at)s::timestamptz AS "message_event_created_at", %(cause_kind)s::text AS "cause_kind", %(cause_event_id)s::bytea AS "cause_event_id", %(cause_scheduled_for)s::timestamptz AS "cause_scheduled_for", %(cause_webhook_invocation_id)s::uuid AS "cause_webhook_invocation_id") AS s CROSS JOIN unnest(%(id)s::uuid[], %(target_pubkey)s::bytea[]) AS v ("id", "target_pubkey")) AS v CROSS JOIN fence
ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING RETURNING id, community_id, target_pubkey;

-- name: LOCK_COMMUNITY_EXCLUSIVE --
SELECT pg_advisory_xact_lock(wd_community_deletion_key(%(community_id)s::uuid));

-- name: LOCK_ROSTER_EXCLUSIVE --
SELECT wd_require_community_write(%(community_id)s::uuid, 'UPDATE', 'community_agents', current_schema()),
       pg_advisory_xact_lock(wd_community_roster_key(%(community_id)s::uuid));

-- name: LOCK_STEP_IDENTITY --
SELECT pg_advisory_xact_lock(hashtextextended(
           'workflow_delivery.delivery_identity:' || %(community)s::text || ':'
           || %(run)s::text || ':' || %(step)s, 0));

-- name: MARK_FAILED --
WITH operable AS MATERIALIZED (
    SELECT CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0)) THEN community_write_allowed(%(community_id)s::uuid) ELSE false END AS ok,
           set_config('workflow_delivery.recorded_by_statement', 'on', true) AS recording
),
chosen AS (
    SELECT d.id, d.status, coalesce(d.last_claimed_at, d.claimed_at) AS claimed_at
      FROM "workflow_agent_deliveries" AS d
     WHERE d.community_id = %(community_id)s AND d.id = ANY(%(delivery_ids)s)
       AND d.status IN ('pending', 'claimed')
       AND (SELECT ok FROM operable)
       FOR UPDATE OF d
),
moved AS (
    UPDATE "workflow_agent_deliveries" AS d
       SET status = 'failed', lease_generation = d.lease_generation + 1, finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL, available_at = NULL
      FROM chosen
     WHERE d.community_id = %(community_id)s AND d.id = chosen.id
    RETURNING d.community_id, d.id, chosen.status AS status_before, d.status,
              d.lease_generation, d.attempts,
              CASE WHEN chosen.status = 'claimed' THEN chosen.claimed_at END AS claimed_at,
              'operator_failed' AS kind
),
recorded AS (
    INSERT INTO "workflow_delivery_timeline"
        (community_id, delivery_id, at, kind, generation, attempts, status_before,
         status_after, actor)
    SELECT m.community_id, m.id, e.at, e.kind, e.generation, m.attempts, e.status_before,
           e.status_after, e.actor
      FROM moved AS m
     CROSS JOIN LATERAL (
           VALUES (1, m.claimed_at, 'claimed', m.lease_generation - 1, 'pending', 'claimed',
                   'holder'),
                  (2, clock_timestamp(), m.kind, m.lease_generation, m.status_before, m.status,
                   %(actor)s::text)
     ) AS e (n, at, kind, generation, status_before, status_after, actor)
     WHERE current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
       AND (e.n = 2 OR (m.status_before = 'claimed' AND NOT EXISTS (
           SELECT 1 FROM "workflow_delivery_timeline" AS t
            WHERE t.community_id = m.community_id AND t.delivery_id = m.id
              AND t.status_after = 'claimed' AND t.attempts = m.attempts
       )))
     ORDER BY e.n
),
recording_done AS (
    SELECT count(*) AS count,
           set_config('workflow_delivery.recorded_by_statement', 'off', true) AS name
      FROM moved
)
SELECT moved.id FROM moved, recording_done;

-- name: MESSAGE_EVENTS --
SELECT id, created_at, pubkey, kind, tags::text, content, content_json IS NOT NULL
  FROM "events"
 WHERE community_id = %(community_id)s::uuid AND id = ANY(%(event_ids)s::bytea[]);

-- name: METRICS_CLAIMED --
SELECT community_id, count(*), count(*) FILTER (WHERE lease_until < now())
  FROM "workflow_agent_deliveries" WHERE status = 'claimed' GROUP BY community_id;

-- name: METRICS_COMMUNITIES --
SELECT id, host, deletion_state FROM "communities";

-- name: METRICS_PENDING --
SELECT community_id, count(*), extract(epoch FROM now() - min(created_at))
  FROM "workflow_agent_deliveries" WHERE status = 'pending' GROUP BY community_id;

-- name: METRICS_TERMINAL --
SELECT community_id, status, count(*)
  FROM "workflow_agent_deliveries" WHERE status IN ('finished', 'failed') GROUP BY community_id, status;

-- name: OPERATOR_RETRY --
WITH operable AS MATERIALIZED (
    SELECT CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0)) THEN community_write_allowed(%(community_id)s::uuid) ELSE false END AS ok,
           set_config('workflow_delivery.recorded_by_statement', 'on', true) AS recording
),
chosen AS (
    SELECT d.id FROM "workflow_agent_deliveries" AS d
     WHERE d.community_id = %(community_id)s AND d.id = ANY(%(delivery_ids)s)
       AND d.status = 'failed' AND (SELECT ok FROM operable)
       FOR UPDATE OF d
),
moved AS (
    UPDATE "workflow_agent_deliveries" AS d
       SET status = 'pending', lease_generation = d.lease_generation + 1,
           finished_at = NULL, available_at = NULL, attempts_at_retry = d.attempts
      FROM chosen
     WHERE d.community_id = %(community_id)s AND d.id = chosen.id
    RETURNING d.community_id, d.id, d.lease_generation, d.attempts
),
recorded AS (
    INSERT INTO "workflow_delivery_timeline"
        (community_id, delivery_id, at, kind, generation, attempts, status_before,
         status_after, actor, reason)
    SELECT m.community_id, m.id, clock_timestamp(), 'operator_retried', m.lease_generation,
           m.attempts, 'failed', 'pending', %(actor)s::text, %(reason)s::text
      FROM moved AS m
     WHERE current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
),
recording_done AS (
    SELECT count(*) AS count,
           set_config('workflow_delivery.recorded_by_statement', 'off', true) AS name
      FROM moved
)
SELECT moved.id FROM moved, recording_done;

-- name: PRESENT_EXECUTOR --
SELECT wd_present_executor(%(community_id)s::uuid, %(generation)s::bigint);

-- name: PRUNE_BATCH --
WITH allowed AS MATERIALIZED (
    SELECT id FROM "communities"
     WHERE deletion_state = 'active' AND wd_community_prune_allowed(id)
),
doomed AS (
    SELECT d.community_id, d.id FROM "workflow_agent_deliveries" AS d JOIN allowed AS a ON a.id = d.community_id
     WHERE d.status IN ('finished', 'failed') AND d.finished_at <= %(cutoff)s
     LIMIT %(limit)s
     FOR UPDATE OF d SKIP LOCKED
)
DELETE FROM "workflow_agent_deliveries" AS d
 USING doomed
 WHERE d.community_id = doomed.community_id AND d.id = doomed.id
RETURNING d.community_id;

-- name: PRUNE_COUNT --
SELECT c.id, c.host, count(*)
  FROM "communities" AS c JOIN "workflow_agent_deliveries" AS d ON d.community_id = c.id
 WHERE c.deletion_state = 'active' AND d.status IN ('finished', 'failed')
   AND d.finished_at <= %(cutoff)s
 GROUP BY c.id, c.host ORDER BY c.host;

-- name: PRUNE_CUTOFF --
SELECT statement_timestamp() - %(age)s::interval;

-- name: PRUNE_REPLAYS_BATCH --
WITH open AS (
    SELECT id FROM "communities"
     WHERE deletion_state = 'active'
       AND pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0))
), doomed AS (
    SELECT r.id FROM "agent_request_replays" AS r
     WHERE r.event_created_at < now() - make_interval(secs => %(horizon)s)
       AND r.community_id IN (SELECT id FROM open)
     LIMIT %(limit)s
     FOR UPDATE OF r SKIP LOCKED
)
DELETE FROM "agent_request_replays" AS r USING doomed WHERE r.id = doomed.id;

-- name: PURGE[workflow_delivery_agent_turns] --
DELETE FROM "workflow_delivery_agent_turns" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "workflow_delivery_agent_turns" WHERE community_id = %(community_id)s LIMIT %(limit)s));

-- name: PURGE[community_agents] --
DELETE FROM "community_agents" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "community_agents" WHERE community_id = %(community_id)s LIMIT %(limit)s));

-- name: PURGE[workflow_delivery_idle_wake_targets] --
DELETE FROM "workflow_delivery_idle_wake_targets" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "workflow_delivery_idle_wake_targets" WHERE community_id = %(community_id)s LIMIT %(limit)s));

-- name: PURGE[workflow_delivery_timeline] --
DELETE FROM "workflow_delivery_timeline" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "workflow_delivery_timeline" WHERE community_id = %(community_id)s LIMIT %(limit)s));

-- name: PURGE[agent_request_replays] --
DELETE FROM "agent_request_replays" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "agent_request_replays" WHERE community_id = %(community_id)s LIMIT %(limit)s));

-- name: PURGE[workflow_agent_deliveries] --
DELETE FROM "workflow_agent_deliveries" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "workflow_agent_deliveries" WHERE community_id = %(community_id)s LIMIT %(limit)s));

-- name: PURGE[workflow_runs] --
DELETE FROM "workflow_runs" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "workflow_runs" WHERE community_id = %(community_id)s LIMIT %(limit)s));

-- name: PURGE[workflows] --
DELETE FROM "workflows" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "workflows" WHERE community_id = %(community_id)s LIMIT %(limit)s));

-- name: PURGE[events] --
DELETE FROM "events" WHERE ctid = ANY (ARRAY(SELECT ctid FROM "events" WHERE community_id = %(community_id)s LIMIT %(limit)s));

-- name: REGISTER_IDLE --
INSERT INTO "workflow_delivery_idle_wake_targets" (community_id, target_pubkey, pid, backend_start)
SELECT %(community_id)s::uuid, t, s.pid, s.backend_start
  FROM unnest(%(target_pubkeys)s::bytea[]) AS t,
       (SELECT coalesce(%(pid)s::integer, a.pid) AS pid,
               coalesce(%(backend_start)s::timestamptz, a.backend_start) AS backend_start
          FROM pg_catalog.pg_stat_get_activity(pg_catalog.pg_backend_pid()) AS a) AS s
ON CONFLICT (community_id, target_pubkey) DO UPDATE
   SET pid = excluded.pid, backend_start = excluded.backend_start,
       registered_at = excluded.registered_at;

-- name: REINSTATE_AGENT --
UPDATE "community_agents" AS a
   SET enabled = true, revoked_at = NULL
 WHERE a.community_id = %(community_id)s AND a.pubkey = %(pubkey)s
RETURNING a.community_id, a.pubkey, a.label, a.enabled, a.added_at, a.revoked_at;

-- name: RELEASE --
WITH operable AS MATERIALIZED (
    SELECT CASE WHEN pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || %(community_id)s::uuid::text, 0)) THEN community_write_allowed(%(community_id)s::uuid) ELSE false END AS ok,
           set_config('workflow_delivery.recorded_by_statement', 'on', true) AS recording
),
chosen AS (
    SELECT d.id, d.status, coalesce(d.last_claimed_at, d.claimed_at) AS claimed_at
      FROM "workflow_agent_deliveries" AS d
     WHERE d.community_id = %(community_id)s AND d.id = ANY(%(delivery_ids)s)
       AND d.status IN ('claimed')
       AND (SELECT ok FROM operable)
       FOR UPDATE OF d
),
moved AS (
    UPDATE "workflow_agent_deliveries" AS d
       SET status = 'pending', lease_generation = d.lease_generation + 1, lease_until = NULL, claimed_at = NULL
      FROM chosen
     WHERE d.community_id = %(community_id)s AND d.id = chosen.id
    RETURNING d.community_id, d.id, chosen.status AS status_before, d.status,
              d.lease_generation, d.attempts,
              CASE WHEN chosen.status = 'claimed' THEN chosen.claimed_at END AS claimed_at,
              'released' AS kind
),
recorded AS (
    INSERT INTO "workflow_delivery_timeline"
        (community_id, delivery_id, at, kind, generation, attempts, status_before,
         status_after, actor)
    SELECT m.community_id, m.id, e.at, e.kind, e.generation, m.attempts, e.status_before,
           e.status_after, e.actor
      FROM moved AS m
     CROSS JOIN LATERAL (
           VALUES (1, m.claimed_at, 'claimed', m.lease_generation - 1, 'pending', 'claimed',
                   'holder'),
                  (2, clock_timestamp(), m.kind, m.lease_generation, m.status_before, m.status,
                   %(actor)s::text)
     ) AS e (n, at, kind, generation, status_before, status_after, actor)
     WHERE current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
       AND (e.n = 2 OR (m.status_before = 'claimed' AND NOT EXISTS (
           SELECT 1 FROM "workflow_delivery_timeline" AS t
            WHERE t.community_id = m.community_id AND t.delivery_id = m.id
              AND t.status_after = 'claimed' AND t.attempts = m.attempts
       )))
     ORDER BY e.n
),
recording_done AS (
    SELECT count(*) AS count,
           set_config('workflow_delivery.recorded_by_statement', 'off', true) AS name
      FROM moved
)
SELECT moved.id FROM moved, recording_done;

-- name: RELEASE_AGENT_LEASES --
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'pending', lease_generation = d.lease_generation + 1, lease_until = NULL, claimed_at = NULL
 WHERE d.community_id = %(community_id)s AND d.target_pubkey = %(pubkey)s
   AND d.status = 'claimed'
RETURNING d.id;

-- name: RELEASE_LEASE --
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'pending', lease_generation = d.lease_generation + 1, lease_until = NULL, claimed_at = NULL
 WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING d.id;

-- name: RENEW --
UPDATE "workflow_agent_deliveries"
   SET lease_until = statement_timestamp() + make_interval(secs => %(lease_seconds)s)
 WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING lease_until;

-- name: REQUIRE_READ_COMMITTED --
SELECT wd_require_read_committed();

-- name: RETRY --
WITH note AS MATERIALIZED (SELECT set_config('workflow_delivery.error_traceback', %(traceback)s, true) AS traceback)
UPDATE "workflow_agent_deliveries" AS d
   SET status = CASE WHEN d.attempts - d.attempts_at_retry >= p.cap THEN 'failed' ELSE 'pending' END,
       lease_generation = d.lease_generation + 1, lease_until = NULL, claimed_at = NULL,
       finished_at = CASE WHEN d.attempts - d.attempts_at_retry >= p.cap THEN statement_timestamp() END,
       available_at = CASE WHEN d.attempts - d.attempts_at_retry >= p.cap THEN NULL
           ELSE statement_timestamp() + make_interval(secs => coalesce(
               p.delay,
               least(p.most, p.base * power(2::float8, least(greatest(d.attempts - 1, 0), 60)))
               * (0.5 + random() / 2)))
       END,
       last_error_type = %(error_type)s, last_error_message = %(error_message)s, last_error_at = statement_timestamp()
  FROM note, (SELECT %(cap)s::integer AS cap, %(delay)s::float8 AS delay,
                     %(base)s::float8 AS base, %(most)s::float8 AS most) AS p
 WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING d.status, d.available_at, d.attempts;

-- name: REVOKE_AGENT --
UPDATE "community_agents" AS a
   SET enabled = false, revoked_at = coalesce(a.revoked_at, statement_timestamp())
 WHERE a.community_id = %(community_id)s AND a.pubkey = %(pubkey)s
RETURNING a.community_id, a.pubkey, a.label, a.enabled, a.added_at, a.revoked_at;

-- name: SERVED_CLAIM --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = (SELECT community_id FROM recorded) AND target_pubkey = %(pubkey)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || (SELECT community_id FROM recorded)::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT %(limit)s
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: SERVED_CLAIM_BY_ID --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = (SELECT community_id FROM recorded) AND target_pubkey = %(pubkey)s
       AND id = %(delivery_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || (SELECT community_id FROM recorded)::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: SERVED_CLAIM_BY_ID_EXPECTED[cause_event_id] --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = (SELECT community_id FROM recorded) AND target_pubkey = %(pubkey)s
       AND id = %(delivery_id)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_event_id = %(cause_event_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || (SELECT community_id FROM recorded)::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: SERVED_CLAIM_BY_ID_EXPECTED[cause_scheduled_for] --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = (SELECT community_id FROM recorded) AND target_pubkey = %(pubkey)s
       AND id = %(delivery_id)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_scheduled_for = %(cause_scheduled_for)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || (SELECT community_id FROM recorded)::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: SERVED_CLAIM_BY_ID_EXPECTED[cause_webhook_invocation_id] --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = (SELECT community_id FROM recorded) AND target_pubkey = %(pubkey)s
       AND id = %(delivery_id)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_webhook_invocation_id = %(cause_webhook_invocation_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || (SELECT community_id FROM recorded)::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: SERVED_CLAIM_EXPECTED[cause_event_id] --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = (SELECT community_id FROM recorded) AND target_pubkey = %(pubkey)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_event_id = %(cause_event_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || (SELECT community_id FROM recorded)::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: SERVED_CLAIM_EXPECTED[cause_scheduled_for] --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = (SELECT community_id FROM recorded) AND target_pubkey = %(pubkey)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_scheduled_for = %(cause_scheduled_for)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || (SELECT community_id FROM recorded)::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: SERVED_CLAIM_EXPECTED[cause_webhook_invocation_id] --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE community_id = (SELECT community_id FROM recorded) AND target_pubkey = %(pubkey)s
       AND community_id = %(expected_community_id)s::uuid
       AND target_pubkey = %(expected_target_pubkey)s::bytea
       AND workflow_id = %(workflow_id)s AND run_id = %(run_id)s AND step_id = %(step_id)s
       AND definition_event_id = %(definition_event_id)s
       AND message_event_id = %(message_event_id)s
       AND cause_kind = %(cause_kind)s AND cause_webhook_invocation_id = %(cause_webhook_invocation_id)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || (SELECT community_id FROM recorded)::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM admission AS a
  LEFT JOIN claimed AS n ON true
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: SERVED_FINISH --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), settled AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = %(outcome)s, finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL
 WHERE 
  community_id = (SELECT community_id FROM recorded) AND id = %(delivery_id)s
  AND target_pubkey = %(pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING d.status
), seen AS (
    SELECT a.recorded, s.status AS settled,
           (SELECT c.status FROM "workflow_agent_deliveries" AS c WHERE a.recorded AND s.status IS NULL AND 
  c.community_id = a.community_id AND c.id = %(delivery_id)s
  AND c.target_pubkey = %(pubkey)s AND c.lease_generation = %(generation)s
 FOR SHARE) AS status
      FROM admission AS a LEFT JOIN settled AS s ON true
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, seen.settled, seen.status, CASE WHEN seen.recorded AND seen.settled IS NULL
                 AND (seen.status IS NULL OR seen.status NOT IN ('finished', 'failed'))
            THEN wd_refuse_request('lease_lost') END
  FROM admission AS a, seen;

-- name: SERVED_FINISH_AND_CLAIM_NEXT --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), settled AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = %(outcome)s, finished_at = statement_timestamp(), lease_until = NULL, claimed_at = NULL
 WHERE 
  community_id = (SELECT community_id FROM recorded) AND id = %(delivery_id)s
  AND target_pubkey = %(pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING d.status
),
picked AS (
    SELECT id FROM "workflow_agent_deliveries"
     WHERE EXISTS (SELECT 1 FROM settled) AND community_id = (SELECT community_id FROM recorded) AND target_pubkey = %(pubkey)s
       AND status = 'pending'
       AND (available_at IS NULL OR available_at <= statement_timestamp())
       AND (SELECT pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || (SELECT community_id FROM recorded)::uuid::text, 0))) IS NOT NULL
     ORDER BY created_at, id
     LIMIT 1
     FOR UPDATE SKIP LOCKED
),
stamp AS (SELECT clock_timestamp() AS at FROM (SELECT count(*) FROM picked) AS taken),
claimed AS (
UPDATE "workflow_agent_deliveries" AS d
   SET status = 'claimed',
       lease_generation = d.lease_generation + 1,
       claimed_at = stamp.at,
       lease_until = stamp.at + make_interval(secs => %(lease_seconds)s),
       available_at = NULL
  FROM picked, stamp
 WHERE d.id = picked.id
RETURNING d."id", d."community_id", d."workflow_id", d."run_id", d."step_id", d."target_pubkey", d."definition_event_id", d."message_event_id", d."message_event_created_at", d."cause_kind", d."cause_event_id", d."cause_scheduled_for", d."cause_webhook_invocation_id", d."status", d."lease_generation", d."lease_until", d."claimed_at", d."finished_at", d."created_at", d."attempts", d."available_at", d."last_error_type", d."last_error_message", d."last_error_at"
),
seen AS (
    SELECT a.recorded, s.status AS settled,
           (SELECT c.status FROM "workflow_agent_deliveries" AS c WHERE a.recorded AND s.status IS NULL AND 
  c.community_id = a.community_id AND c.id = %(delivery_id)s
  AND c.target_pubkey = %(pubkey)s AND c.lease_generation = %(generation)s
 FOR SHARE) AS status
      FROM admission AS a LEFT JOIN settled AS s ON true
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, seen.settled, seen.status, CASE WHEN seen.recorded AND seen.settled IS NULL
                 AND (seen.status IS NULL OR seen.status NOT IN ('finished', 'failed'))
            THEN wd_refuse_request('lease_lost') END,
       n."id", n."community_id", n."workflow_id", n."run_id", n."step_id", n."target_pubkey", n."definition_event_id", n."message_event_id", n."message_event_created_at", n."cause_kind", n."cause_event_id", n."cause_scheduled_for", n."cause_webhook_invocation_id", n."status", n."lease_generation", n."lease_until", n."claimed_at", n."finished_at", n."created_at", n."attempts", n."available_at", n."last_error_type", n."last_error_message", n."last_error_at", e.id, e.created_at, e.pubkey, e.kind, e.tags::text, e.content, e.content_json IS NOT NULL
  FROM admission AS a CROSS JOIN seen
  LEFT JOIN claimed AS n ON true
  LEFT JOIN "events" AS e
    ON e.community_id = n.community_id AND e.created_at = n.message_event_created_at
   AND e.id = n.message_event_id;

-- name: SERVED_RENEW --
WITH clock AS (
    SELECT abs(extract(epoch FROM now()) - %(created_at)s::bigint) <= %(skew)s::bigint AS fresh
), community AS (
    SELECT id FROM "communities" WHERE lower(host) = lower(%(host)s::text)
), gate AS MATERIALIZED (
    SELECT id, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS open
      FROM community
), agent AS MATERIALIZED (
    SELECT CASE WHEN gate.open THEN wd_agent_standing(gate.id, %(pubkey)s::bytea)
                ELSE 'deleting' END AS standing
      FROM gate
), recorded AS (
    INSERT INTO "agent_request_replays" (community_id, event_id, event_created_at)
    SELECT community.id, %(event_id)s::bytea, to_timestamp(%(created_at)s::bigint)
      FROM community, clock, agent WHERE clock.fresh AND agent.standing = 'enabled'
    ON CONFLICT ON CONSTRAINT wd_replay_event_once DO NOTHING
    RETURNING community_id
), admission AS (
    SELECT (SELECT id FROM community) AS community_id, clock.fresh,
           EXISTS (SELECT 1 FROM recorded) AS recorded, (SELECT standing FROM agent) AS standing
      FROM clock
), renewed AS (
UPDATE "workflow_agent_deliveries"
   SET lease_until = statement_timestamp() + make_interval(secs => %(lease_seconds)s)
 WHERE 
  community_id = (SELECT community_id FROM recorded) AND id = %(delivery_id)s
  AND target_pubkey = %(pubkey)s AND lease_generation = %(generation)s

  AND status = 'claimed' AND lease_until >= statement_timestamp()
  AND pg_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || community_id::text, 0)) IS NOT NULL

RETURNING lease_until
)
SELECT a.community_id, a.fresh, a.recorded, a.standing, r.lease_until,
       CASE WHEN a.recorded AND r.lease_until IS NULL THEN wd_refuse_request('lease_lost') END
  FROM admission AS a LEFT JOIN renewed AS r ON true;

-- name: SETTLES_PER_MINUTE --
SELECT minutes.m, count(s.finished_at)
  FROM generate_series(0, 59) AS minutes (m)
  LEFT JOIN (
       SELECT d.finished_at
         FROM "communities" AS c
        CROSS JOIN (VALUES ('finished'), ('failed')) AS t (status)
        CROSS JOIN LATERAL (
              SELECT r.finished_at FROM "workflow_agent_deliveries" AS r
               WHERE r.community_id = c.id AND r.status = t.status
                 AND r.finished_at > now() - interval '60 minutes'
        ) AS d
  ) AS s
    ON 59 - greatest(0, floor(extract(epoch FROM now() - s.finished_at) / 60)::int) = minutes.m
 GROUP BY minutes.m ORDER BY minutes.m;

-- name: SET_ACTOR --
SELECT set_config('workflow_delivery.actor', %(actor)s, true);

-- name: SET_COMMUNITY_STATE --
UPDATE "communities" SET deletion_state = %(state)s WHERE id = %(community_id)s
RETURNING deletion_fence_generation;

-- name: SET_TIMELINE --
SELECT set_config('workflow_delivery.timeline', %(timeline)s, false);

-- name: STATUS_BY_CAPABILITY --
SELECT status FROM "workflow_agent_deliveries" WHERE 
  community_id = %(community_id)s AND id = %(delivery_id)s
  AND target_pubkey = %(target_pubkey)s AND lease_generation = %(generation)s;

-- name: STEP_EXISTS --
SELECT EXISTS (
    SELECT 1 FROM "workflow_agent_deliveries"
     WHERE community_id = %(community)s AND run_id = %(run)s AND step_id = %(step)s
);

-- name: TARGET_STATE --
WITH community AS (
    SELECT host, deletion_state FROM "communities" WHERE id = %(community)s
),
pending AS (
    SELECT count(*) AS total,
           count(*) FILTER (WHERE available_at > statement_timestamp()) AS backing_off,
           min(available_at) FILTER (WHERE available_at > statement_timestamp()) AS next_at,
           min(created_at) AS oldest
      FROM "workflow_agent_deliveries"
     WHERE community_id = %(community)s AND target_pubkey = %(target)s AND status = 'pending'
),
held AS MATERIALIZED (
    SELECT id, claimed_at, last_claimed_at, lease_until, last_error_type, last_error_message, last_error_at
      FROM "workflow_agent_deliveries"
     WHERE community_id = %(community)s AND status = 'claimed' AND target_pubkey = %(target)s
),
claimed AS (
    SELECT count(*) AS total,
           count(*) FILTER (WHERE lease_until < statement_timestamp()) AS expired,
           min(lease_until) FILTER (WHERE lease_until < statement_timestamp()) AS first_expired,
           max(lease_until) FILTER (WHERE lease_until >= statement_timestamp()) AS live_until,
           max(claimed_at) AS last_claimed
      FROM held
),
recent AS MATERIALIZED (
    SELECT * FROM (
        (SELECT id, target_pubkey, status, attempts, attempts_at_retry, finished_at, last_claimed_at, last_error_type, last_error_message, last_error_at FROM "workflow_agent_deliveries"
          WHERE community_id = %(community)s AND status = 'finished'
          ORDER BY finished_at DESC LIMIT %(window)s)
        UNION ALL
        (SELECT id, target_pubkey, status, attempts, attempts_at_retry, finished_at, last_claimed_at, last_error_type, last_error_message, last_error_at FROM "workflow_agent_deliveries"
          WHERE community_id = %(community)s AND status = 'failed'
          ORDER BY finished_at DESC LIMIT %(window)s)
    ) AS settles
     ORDER BY finished_at DESC LIMIT %(window)s
),
settled AS (
    SELECT count(*) AS window_rows, min(finished_at) AS window_since,
           count(*) FILTER (WHERE target_pubkey = %(target)s) AS total,
           max(finished_at) FILTER (WHERE target_pubkey = %(target)s) AS last_settled,
           count(*) FILTER (
               WHERE target_pubkey = %(target)s AND status = 'failed'
                 AND attempts - attempts_at_retry >= %(cap)s
           ) AS exhausted
      FROM recent
),
error AS (
    SELECT * FROM (
        SELECT last_error_type, last_error_message, last_error_at FROM "workflow_agent_deliveries"
         WHERE community_id = %(community)s AND target_pubkey = %(target)s
           AND status = 'pending' AND last_error_at IS NOT NULL
        UNION ALL
        SELECT last_error_type, last_error_message, last_error_at FROM held WHERE last_error_at IS NOT NULL
        UNION ALL
        SELECT last_error_type, last_error_message, last_error_at FROM recent
         WHERE target_pubkey = %(target)s AND last_error_at IS NOT NULL
    ) AS errors
     ORDER BY last_error_at DESC LIMIT 1
),
claim AS (
    SELECT max(last_claimed_at) AS last_claimed
      FROM (
            SELECT last_claimed_at FROM held
            UNION ALL
            SELECT last_claimed_at FROM recent WHERE target_pubkey = %(target)s
            UNION ALL
            SELECT max(last_claimed_at) FROM "workflow_agent_deliveries"
             WHERE community_id = %(community)s AND target_pubkey = %(target)s
               AND status = 'pending'
      ) AS seen
),
idle AS (
    SELECT i.registered_at,
           CASE WHEN a.pid IS NULL THEN 'gone'
                WHEN a.backend_start IS NULL THEN 'unseen'
                WHEN a.backend_start = i.backend_start THEN 'live'
                ELSE 'gone'
           END AS session
      FROM "workflow_delivery_idle_wake_targets" AS i
      LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid = i.pid
     WHERE i.community_id = %(community)s AND i.target_pubkey = %(target)s
)
SELECT statement_timestamp(), community.host, community.deletion_state,
       pending.total, pending.backing_off, pending.next_at, pending.oldest,
       claimed.total, claimed.expired, claimed.first_expired, claimed.live_until,
       greatest(claimed.last_claimed, claim.last_claimed),
       settled.window_rows, settled.window_since, settled.total, settled.last_settled,
       settled.exhausted,
       error.last_error_type, error.last_error_message, error.last_error_at,
       idle.registered_at, idle.session
  FROM pending
 CROSS JOIN claimed
 CROSS JOIN settled
 CROSS JOIN claim
  LEFT JOIN community ON true
  LEFT JOIN error ON true
  LEFT JOIN idle ON true;

-- name: UNREGISTER_IDLE --
DELETE FROM "workflow_delivery_idle_wake_targets"
 WHERE community_id = %(community_id)s::uuid
   AND target_pubkey = ANY(%(target_pubkeys)s::bytea[]);

-- name: WAKE_IDLE_AFTER_COMMIT --
WITH no_flush AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)),
created AS (
    SELECT c.* FROM no_flush,
           unnest(%(ids)s::uuid[], %(community_ids)s::uuid[], %(target_pubkeys)s::bytea[])
           AS c (id, community_id, target_pubkey)
),
woken AS (
    DELETE FROM "workflow_delivery_idle_wake_targets" AS i USING created AS c
     WHERE i.community_id = c.community_id AND i.target_pubkey = c.target_pubkey
    RETURNING i.community_id, i.target_pubkey, c.id
),
sent AS MATERIALIZED (
    SELECT count(pg_notify('workflow_delivery_wake', w.community_id::text || ':'
                           || encode(w.target_pubkey, 'hex') || ':' || w.id::text)) AS n
      FROM woken AS w
)
SELECT n FROM sent;

-- name: WITHDRAW_EXECUTOR --
SELECT wd_withdraw_executor();

-- name: notifying(INSERT_DELIVERIES) --
WITH created AS (WITH fence AS MATERIALIZED (SELECT wd_require_community_write(%(community)s::uuid, 'INSERT', 'workflow_agent_deliveries', current_schema())::text AS fenced )
INSERT INTO "workflow_agent_deliveries" ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")
SELECT v.* FROM (SELECT * FROM unnest(%(id)s::uuid[], %(community_id)s::uuid[], %(workflow_id)s::uuid[], %(run_id)s::uuid[], %(step_id)s::text[], %(target_pubkey)s::bytea[], %(definition_event_id)s::bytea[], %(message_event_id)s::bytea[], %(message_event_created_at)s::timestamptz[], %(cause_kind)s::text[], %(cause_event_id)s::bytea[], %(cause_scheduled_for)s::timestamptz[], %(cause_webhook_invocation_id)s::uuid[]) AS v ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")) AS v CROSS JOIN fence
ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING RETURNING id, community_id, target_pubkey),
woken AS (
    DELETE FROM "workflow_delivery_idle_wake_targets" AS i USING created AS c
     WHERE i.community_id = c.community_id AND i.target_pubkey = c.target_pubkey
    RETURNING i.community_id, i.target_pubkey, c.id
),
sent AS MATERIALIZED (
    SELECT count(pg_notify('workflow_delivery_wake', w.community_id::text || ':'
                           || encode(w.target_pubkey, 'hex') || ':' || w.id::text)) AS n
      FROM woken AS w
)
SELECT created.id, created.community_id, created.target_pubkey FROM created CROSS JOIN sent;

-- name: notifying(INSERT_SHARED_DELIVERIES) --
WITH created AS (WITH fence AS MATERIALIZED (SELECT wd_require_community_write(%(community)s::uuid, 'INSERT', 'workflow_agent_deliveries', current_schema())::text AS fenced )
INSERT INTO "workflow_agent_deliveries" ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")
SELECT v.* FROM (SELECT v."id", s."community_id", s."workflow_id", s."run_id", s."step_id", v."target_pubkey", s."definition_event_id", s."message_event_id", s."message_event_created_at", s."cause_kind", s."cause_event_id", s."cause_scheduled_for", s."cause_webhook_invocation_id" FROM (SELECT %(community_id)s::uuid AS "community_id", %(workflow_id)s::uuid AS "workflow_id", %(run_id)s::uuid AS "run_id", %(step_id)s::text AS "step_id", %(definition_event_id)s::bytea AS "definition_event_id", %(message_event_id)s::bytea AS "message_event_id", %(message_event_created_at)s::timestamptz AS "message_event_created_at", %(cause_kind)s::text AS "cause_kind", %(cause_event_id)s::bytea AS "cause_event_id", %(cause_scheduled_for)s::timestamptz AS "cause_scheduled_for", %(cause_webhook_invocation_id)s::uuid AS "cause_webhook_invocation_id") AS s CROSS JOIN unnest(%(id)s::uuid[], %(target_pubkey)s::bytea[]) AS v ("id", "target_pubkey")) AS v CROSS JOIN fence
ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING RETURNING id, community_id, target_pubkey),
woken AS (
    DELETE FROM "workflow_delivery_idle_wake_targets" AS i USING created AS c
     WHERE i.community_id = c.community_id AND i.target_pubkey = c.target_pubkey
    RETURNING i.community_id, i.target_pubkey, c.id
),
sent AS MATERIALIZED (
    SELECT count(pg_notify('workflow_delivery_wake', w.community_id::text || ':'
                           || encode(w.target_pubkey, 'hex') || ':' || w.id::text)) AS n
      FROM woken AS w
)
SELECT created.id, created.community_id, created.target_pubkey FROM created CROSS JOIN sent;

-- name: notifying(LOCK_AND_INSERT_DELIVERIES) --
WITH created AS (WITH step_lock AS MATERIALIZED (SELECT pg_advisory_xact_lock(hashtextextended(
           'workflow_delivery.delivery_identity:' || %(community)s::text || ':'
           || %(run)s::text || ':' || %(step)s, 0))::text AS locked),
fence AS MATERIALIZED (SELECT wd_require_community_write(%(community)s::uuid, 'INSERT', 'workflow_agent_deliveries', current_schema())::text AS fenced FROM step_lock)
INSERT INTO "workflow_agent_deliveries" ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")
SELECT v.* FROM (SELECT * FROM unnest(%(id)s::uuid[], %(community_id)s::uuid[], %(workflow_id)s::uuid[], %(run_id)s::uuid[], %(step_id)s::text[], %(target_pubkey)s::bytea[], %(definition_event_id)s::bytea[], %(message_event_id)s::bytea[], %(message_event_created_at)s::timestamptz[], %(cause_kind)s::text[], %(cause_event_id)s::bytea[], %(cause_scheduled_for)s::timestamptz[], %(cause_webhook_invocation_id)s::uuid[]) AS v ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")) AS v CROSS JOIN fence
ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING RETURNING id, community_id, target_pubkey),
woken AS (
    DELETE FROM "workflow_delivery_idle_wake_targets" AS i USING created AS c
     WHERE i.community_id = c.community_id AND i.target_pubkey = c.target_pubkey
    RETURNING i.community_id, i.target_pubkey, c.id
),
sent AS MATERIALIZED (
    SELECT count(pg_notify('workflow_delivery_wake', w.community_id::text || ':'
                           || encode(w.target_pubkey, 'hex') || ':' || w.id::text)) AS n
      FROM woken AS w
)
SELECT created.id, created.community_id, created.target_pubkey FROM created CROSS JOIN sent;

-- name: notifying(LOCK_AND_INSERT_SHARED_DELIVERIES) --
WITH created AS (WITH step_lock AS MATERIALIZED (SELECT pg_advisory_xact_lock(hashtextextended(
           'workflow_delivery.delivery_identity:' || %(community)s::text || ':'
           || %(run)s::text || ':' || %(step)s, 0))::text AS locked),
fence AS MATERIALIZED (SELECT wd_require_community_write(%(community)s::uuid, 'INSERT', 'workflow_agent_deliveries', current_schema())::text AS fenced FROM step_lock)
INSERT INTO "workflow_agent_deliveries" ("id", "community_id", "workflow_id", "run_id", "step_id", "target_pubkey", "definition_event_id", "message_event_id", "message_event_created_at", "cause_kind", "cause_event_id", "cause_scheduled_for", "cause_webhook_invocation_id")
SELECT v.* FROM (SELECT v."id", s."community_id", s."workflow_id", s."run_id", s."step_id", v."target_pubkey", s."definition_event_id", s."message_event_id", s."message_event_created_at", s."cause_kind", s."cause_event_id", s."cause_scheduled_for", s."cause_webhook_invocation_id" FROM (SELECT %(community_id)s::uuid AS "community_id", %(workflow_id)s::uuid AS "workflow_id", %(run_id)s::uuid AS "run_id", %(step_id)s::text AS "step_id", %(definition_event_id)s::bytea AS "definition_event_id", %(message_event_id)s::bytea AS "message_event_id", %(message_event_created_at)s::timestamptz AS "message_event_created_at", %(cause_kind)s::text AS "cause_kind", %(cause_event_id)s::bytea AS "cause_event_id", %(cause_scheduled_for)s::timestamptz AS "cause_scheduled_for", %(cause_webhook_invocation_id)s::uuid AS "cause_webhook_invocation_id") AS s CROSS JOIN unnest(%(id)s::uuid[], %(target_pubkey)s::bytea[]) AS v ("id", "target_pubkey")) AS v CROSS JOIN fence
ON CONFLICT ON CONSTRAINT wd_delivery_identity_key DO NOTHING RETURNING id, community_id, target_pubkey),
woken AS (
    DELETE FROM "workflow_delivery_idle_wake_targets" AS i USING created AS c
     WHERE i.community_id = c.community_id AND i.target_pubkey = c.target_pubkey
    RETURNING i.community_id, i.target_pubkey, c.id
),
sent AS MATERIALIZED (
    SELECT count(pg_notify('workflow_delivery_wake', w.community_id::text || ':'
                           || encode(w.target_pubkey, 'hex') || ':' || w.id::text)) AS n
      FROM woken AS w
)
SELECT created.id, created.community_id, created.target_pubkey FROM created CROSS JOIN sent;

-- name: reap_batch(500, 20) --
WITH recording AS MATERIALIZED (SELECT set_config('workflow_delivery.recorded_by_statement', 'on', true) AS name),
-- Rows another transaction holds (a holder inside holding() past its lease) are
-- skipped before each LIMIT counts, so locked rows never fill a batch or a candidate
-- slot and every unlocked expired lease is reachable.
candidates AS MATERIALIZED (
    SELECT c.id, e.oldest
      FROM recording, "communities" AS c
     CROSS JOIN LATERAL (
           SELECT r.lease_until AS oldest FROM "workflow_agent_deliveries" AS r
            WHERE r.community_id = c.id AND r.status = 'claimed' AND r.lease_until < statement_timestamp()
            ORDER BY r.lease_until LIMIT 1
              FOR UPDATE OF r SKIP LOCKED
     ) AS e
     WHERE c.deletion_state = 'active'
     ORDER BY e.oldest
     LIMIT 500
),
tried AS MATERIALIZED (
    SELECT id, oldest, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS locked
      FROM candidates
),
open AS MATERIALIZED (
    SELECT id FROM tried WHERE CASE WHEN locked THEN community_write_allowed(id) ELSE false END
),
expired AS (
    SELECT d.id, coalesce(d.last_claimed_at, d.claimed_at) AS claimed_at
      FROM "workflow_agent_deliveries" AS d
     WHERE d.id IN (
           SELECT x.id FROM open
            CROSS JOIN LATERAL (
                  SELECT r.id, r.lease_until FROM "workflow_agent_deliveries" AS r
                   WHERE r.community_id = open.id AND r.status = 'claimed' AND r.lease_until < statement_timestamp()
                   ORDER BY r.lease_until LIMIT 500
                     FOR UPDATE OF r SKIP LOCKED
            ) AS x
            ORDER BY x.lease_until LIMIT 500
     )
       AND d.status = 'claimed' AND d.lease_until < statement_timestamp()
       FOR UPDATE OF d SKIP LOCKED
),
moved AS (
    UPDATE "workflow_agent_deliveries" AS d
       SET status = CASE WHEN d.attempts - d.attempts_at_retry >= 20::integer THEN 'failed' ELSE 'pending' END,
       lease_generation = d.lease_generation + 1, lease_until = NULL, claimed_at = NULL,
       finished_at = CASE WHEN d.attempts - d.attempts_at_retry >= 20::integer THEN statement_timestamp() END
      FROM expired
     WHERE d.id = expired.id
    RETURNING d.community_id, d.id, 'claimed' AS status_before, d.status, d.lease_generation,
              d.attempts, expired.claimed_at,
              CASE WHEN d.status = 'failed' THEN 'attempts_exhausted' ELSE 'reaped' END AS kind
),
recorded AS (
    INSERT INTO "workflow_delivery_timeline"
        (community_id, delivery_id, at, kind, generation, attempts, status_before,
         status_after, actor)
    SELECT m.community_id, m.id, e.at, e.kind, e.generation, m.attempts, e.status_before,
           e.status_after, e.actor
      FROM moved AS m
     CROSS JOIN LATERAL (
           VALUES (1, m.claimed_at, 'claimed', m.lease_generation - 1, 'pending', 'claimed',
                   'holder'),
                  (2, clock_timestamp(), m.kind, m.lease_generation, m.status_before, m.status,
                   'reaper')
     ) AS e (n, at, kind, generation, status_before, status_after, actor)
     WHERE current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
       AND (e.n = 2 OR (m.status_before = 'claimed' AND NOT EXISTS (
           SELECT 1 FROM "workflow_delivery_timeline" AS t
            WHERE t.community_id = m.community_id AND t.delivery_id = m.id
              AND t.status_after = 'claimed' AND t.attempts = m.attempts
       )))
     ORDER BY e.n
),
recording_done AS (
    SELECT count(*) AS count,
           set_config('workflow_delivery.recorded_by_statement', 'off', true) AS name
      FROM moved
)
SELECT recording_done.count,
       (SELECT count(*) FROM moved WHERE status = 'failed'),
       ARRAY(SELECT id FROM tried WHERE NOT locked ORDER BY id)
  FROM recording_done;

-- name: reap_batch(500, None) --
WITH recording AS MATERIALIZED (SELECT set_config('workflow_delivery.recorded_by_statement', 'on', true) AS name),
-- Rows another transaction holds (a holder inside holding() past its lease) are
-- skipped before each LIMIT counts, so locked rows never fill a batch or a candidate
-- slot and every unlocked expired lease is reachable.
candidates AS MATERIALIZED (
    SELECT c.id, e.oldest
      FROM recording, "communities" AS c
     CROSS JOIN LATERAL (
           SELECT r.lease_until AS oldest FROM "workflow_agent_deliveries" AS r
            WHERE r.community_id = c.id AND r.status = 'claimed' AND r.lease_until < statement_timestamp()
            ORDER BY r.lease_until LIMIT 1
              FOR UPDATE OF r SKIP LOCKED
     ) AS e
     WHERE c.deletion_state = 'active'
     ORDER BY e.oldest
     LIMIT 500
),
tried AS MATERIALIZED (
    SELECT id, oldest, pg_try_advisory_xact_lock_shared(hashtextextended('workflow_delivery.community_deletion:' || id::text, 0)) AS locked
      FROM candidates
),
open AS MATERIALIZED (
    SELECT id FROM tried WHERE CASE WHEN locked THEN community_write_allowed(id) ELSE false END
),
expired AS (
    SELECT d.id, coalesce(d.last_claimed_at, d.claimed_at) AS claimed_at
      FROM "workflow_agent_deliveries" AS d
     WHERE d.id IN (
           SELECT x.id FROM open
            CROSS JOIN LATERAL (
                  SELECT r.id, r.lease_until FROM "workflow_agent_deliveries" AS r
                   WHERE r.community_id = open.id AND r.status = 'claimed' AND r.lease_until < statement_timestamp()
                   ORDER BY r.lease_until LIMIT 500
                     FOR UPDATE OF r SKIP LOCKED
            ) AS x
            ORDER BY x.lease_until LIMIT 500
     )
       AND d.status = 'claimed' AND d.lease_until < statement_timestamp()
       FOR UPDATE OF d SKIP LOCKED
),
moved AS (
    UPDATE "workflow_agent_deliveries" AS d
       SET status = CASE WHEN d.attempts - d.attempts_at_retry >= NULL::integer THEN 'failed' ELSE 'pending' END,
       lease_generation = d.lease_generation + 1, lease_until = NULL, claimed_at = NULL,
       finished_at = CASE WHEN d.attempts - d.attempts_at_retry >= NULL::integer THEN statement_timestamp() END
      FROM expired
     WHERE d.id = expired.id
    RETURNING d.community_id, d.id, 'claimed' AS status_before, d.status, d.lease_generation,
              d.attempts, expired.claimed_at,
              CASE WHEN d.status = 'failed' THEN 'attempts_exhausted' ELSE 'reaped' END AS kind
),
recorded AS (
    INSERT INTO "workflow_delivery_timeline"
        (community_id, delivery_id, at, kind, generation, attempts, status_before,
         status_after, actor)
    SELECT m.community_id, m.id, e.at, e.kind, e.generation, m.attempts, e.status_before,
           e.status_after, e.actor
      FROM moved AS m
     CROSS JOIN LATERAL (
           VALUES (1, m.claimed_at, 'claimed', m.lease_generation - 1, 'pending', 'claimed',
                   'holder'),
                  (2, clock_timestamp(), m.kind, m.lease_generation, m.status_before, m.status,
                   'reaper')
     ) AS e (n, at, kind, generation, status_before, status_after, actor)
     WHERE current_setting('workflow_delivery.timeline', true) IS DISTINCT FROM 'off'
       AND (e.n = 2 OR (m.status_before = 'claimed' AND NOT EXISTS (
           SELECT 1 FROM "workflow_delivery_timeline" AS t
            WHERE t.community_id = m.community_id AND t.delivery_id = m.id
              AND t.status_after = 'claimed' AND t.attempts = m.attempts
       )))
     ORDER BY e.n
),
recording_done AS (
    SELECT count(*) AS count,
           set_config('workflow_delivery.recorded_by_statement', 'off', true) AS name
      FROM moved
)
SELECT recording_done.count,
       (SELECT count(*) FROM moved WHERE status = 'failed'),
       ARRAY(SELECT id FROM tried WHERE NOT locked ORDER BY id)
  FROM recording_done;
