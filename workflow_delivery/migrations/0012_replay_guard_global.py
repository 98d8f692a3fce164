"""The replay guard holds a signed request's event id once across every community.

A community's host no longer scopes the guard: behind a shared origin
(``WORKFLOW_DELIVERY_API_ORIGIN``) the signed URL is the same for every community,
so a guard unique per community let one signed request be served once in each.
``wd_replay_event_once`` replaces ``wd_replay_event_key``; rows already recorded
twice (in two communities) keep their first arrival (the later one is deleted where
its community still accepts writes). Reversing restores the
per-community key, which every row then satisfies.
"""

from django.db import migrations, models

TABLE = "agent_request_replays"

KEEP_FIRST_ARRIVAL = f"""
DELETE FROM {TABLE} AS later
 USING {TABLE} AS earlier
 WHERE later.event_id = earlier.event_id AND later.id > earlier.id
   AND later.community_id IN (SELECT id FROM communities WHERE deletion_state = 'active')
"""


class Migration(migrations.Migration):
    dependencies = [("workflow_delivery", "0011_statement_level_timeline")]

    operations = [
        migrations.RunSQL(KEEP_FIRST_ARRIVAL, reverse_sql=migrations.RunSQL.noop),
        migrations.RemoveConstraint(model_name="agentrequestreplay", name="wd_replay_event_key"),
        migrations.AddConstraint(
            model_name="agentrequestreplay",
            constraint=models.UniqueConstraint(fields=["event_id"], name="wd_replay_event_once"),
        ),
    ]
