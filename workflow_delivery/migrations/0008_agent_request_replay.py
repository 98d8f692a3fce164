"""The replay guard of the agent HTTP API (NIP-98): the id of every signed request
event accepted, unique per community, so the same signed request is served once even
when it arrives twice at once through different processes. It is a tenant table like
the others: it references its community (RESTRICT), carries the community write
fence, and ``purge_community`` deletes its rows. Rows are pruned once their event is
too old to pass the freshness window."""

import django.contrib.postgres.functions
import django.db.models.deletion
import django.db.models.functions.text
import django.db.models.lookups
from django.db import migrations, models

TABLE = "agent_request_replays"


class Migration(migrations.Migration):
    dependencies = [
        ("workflow_delivery", "0007_attempts_and_timeline"),
    ]

    operations = [
        migrations.CreateModel(
            name="AgentRequestReplay",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("event_id", models.BinaryField()),
                ("event_created_at", models.DateTimeField()),
                (
                    "seen_at",
                    models.DateTimeField(
                        db_default=django.contrib.postgres.functions.TransactionNow(),
                        editable=False,
                    ),
                ),
                (
                    "community",
                    models.ForeignKey(
                        db_constraint=False,
                        db_index=False,
                        on_delete=django.db.models.deletion.DO_NOTHING,
                        related_name="+",
                        to="workflow_delivery.community",
                    ),
                ),
            ],
            options={
                "db_table": TABLE,
                "indexes": [models.Index(fields=["event_created_at"], name="wd_replay_prune_idx")],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("community", "event_id"), name="wd_replay_event_key"
                    ),
                    models.CheckConstraint(
                        condition=django.db.models.lookups.Exact(
                            django.db.models.functions.text.Length("event_id"), 32
                        ),
                        name="wd_replay_event_id_32_bytes",
                    ),
                ],
            },
        ),
        migrations.RunSQL(
            sql=(
                f"ALTER TABLE {TABLE} ADD CONSTRAINT wd_replay_community_fk FOREIGN KEY "
                "(community_id) REFERENCES communities (id) ON DELETE RESTRICT;"
            ),
            reverse_sql=f"ALTER TABLE {TABLE} DROP CONSTRAINT wd_replay_community_fk;",
        ),
        migrations.RunSQL(
            sql=(
                "CREATE TRIGGER wd_community_write_fence BEFORE INSERT OR UPDATE OR DELETE "
                "ON agent_request_replays FOR EACH ROW EXECUTE FUNCTION wd_enforce_community_write_fence();"
            ),
            reverse_sql="DROP TRIGGER wd_community_write_fence ON agent_request_replays;",
        ),
    ]
